"""The learner process of the fault simulation: the learner loop, its coordinator, its poller.

Learner rank 0 hosts the coordinator, so one process holds three parts, and a kill takes all
three (docs/DESIGN.md section 10: only the learner's checkpoints are durable):

- the coordinator: the real :class:`~asyncrl.control.state.ControlState`, answering the
  servers' requests as :mod:`asyncrl.control.loop` does (without the long-polls: a held
  request is I/O, not a decision), fresh on a start without a checkpoint, restored from the
  checkpoint's ``state_dict`` otherwise;
- the learner loop (:mod:`learner.loop`, :mod:`learner.control_plane`): hello to the buffer
  with the checkpoint's last batch, the replay (``set_replay(replayed_version(...))``), then
  per step a batch request, training (a virtual delay), ``trained``, a push every
  ``sync_every`` steps (``adopt`` a replayed version, or ``begin_sync``/``finish_sync``), a
  checkpoint every ``save_freq`` steps followed by the acks of the batches it holds (each
  batch acked once trained when ``save_freq <= 0``), catch-ups after a step and while no
  batch comes (only once it holds weights to send: restored or pushed);
- the coordinator's poller of the buffer: drop reports and scored validation ids read by
  (session, cursor), the inventory when :class:`~asyncrl.control.recovery.Recovery` says
  one is due, and otherwise the audit of acknowledged groups the buffer never received.

A learner started without a checkpoint says so in its hello (``resumed`` False: it replays
nothing) and offers its initial weights to catch-ups, as the real loop does.

It is a state machine stepped by the schedule (``phase``); what it decides is the real
classes' decision.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.control import messages as m
from asyncrl.control.admission import push_due, replayed_version
from asyncrl.sync.plan import WeightPlan
from asyncrl.wire import Batch
from benchmarks import fault_api as api
from benchmarks.fault_checks import Line
from benchmarks.fault_net import Endpoint, Msg
from benchmarks.fault_world import (
    AckReq,
    AuditRep,
    AuditReq,
    BatchRep,
    BatchReq,
    Checkpoint,
    HelloReq,
    InventoryRep,
    InventoryReq,
    ReportsRep,
    ReportsReq,
    Welcome,
)

if TYPE_CHECKING:
    from asyncrl.control.state import ControlState
    from benchmarks.fault_world import World

log = logging.getLogger(__name__)

MAX_GRANT = 4  # control.tasks_per_request's cap at the coordinator
# A learner started without a checkpoint offers its initial weights to catch-ups (the loop
# calls control.resume on every start); before that fix only a restored one did.
RESUME_FRESH = True
PLAN = WeightPlan()


class LearnerProc(Endpoint):
    """Learner + coordinator + poller; ``start`` is a (re)start of the process."""

    def __init__(self, world: World):
        super().__init__("L", world.net, inc=0, alive=False)
        self.world = world
        self.state: ControlState | None = None
        self.phase = "dead"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start from the latest checkpoint, or fresh (a new id family, initial weights)."""
        w, cfg = self.world, self.world.cfg
        self.reborn()
        tag = f"c{self.inc}"
        ck = self.restored = w.checkpoint
        if ck is not None:
            saved = json.loads(json.dumps(ck.coordinator))
            self.state = api.restored_state(cfg, w.train_rows, w.val_rows, tag, saved)
            self.family, self.line = ck.family, ck.line.copy()
            self.step, self.version = ck.step, ck.version
            self.last = (ck.last_batch_session, ck.last_batch_id)
        else:
            self.state = api.new_state(cfg, w.train_rows, w.val_rows, tag)
            self.family, self.line = w.checker.new_family(), Line()
            self.step = self.version = 0
            self.last = ("", None)
        self.state.start_run()
        w.dirty = True
        # resume(): the weights at start (restored or initial) serve catch-ups.
        self.pushed = ck is not None or RESUME_FRESH
        self.pushed_weights = self.line.weights
        self.pushing_version = 0
        self.unacked: list[int] = []
        self.acks: list[list[int]] = []  # acks waiting for the buffer socket
        self.batch: Any = None
        self.train_due = 0.0
        self.round: tuple[int, float] | None = None  # (sync id, deadline) in progress
        self.next_phase = ""
        self.cursor = (0, 0)
        self.cursor_session = ""
        self.phase = "hello"

    def kill(self) -> None:
        self.die()
        self.state = None
        self.phase = "dead"
        self.round = None

    def sending(self, sync_id: int) -> bool:
        """Whether this process is sending sync ``sync_id`` now (a member's load works)."""
        return self.alive and self.round is not None and self.round[0] == sync_id

    # ------------------------------------------------------------------ coordinator
    def handle(self, msg: Msg) -> Any:
        """A server's request to the coordinator; the reply (as the control loop's)."""
        st, now, body = self.state, self.world.now, msg.body
        assert st is not None
        self.world.dirty = True
        if isinstance(body, m.TaskRequest):
            return self._dealing(
                body.server_id,
                lambda: st.grant(
                    body.server_id, min(body.max_tasks, MAX_GRANT), now, body.request_id
                ),
            )
        if isinstance(body, m.SlotRequest):
            return self._dealing(
                body.server_id, lambda: st.grant_slot(body.server_id, now, body.request_id)
            )
        if isinstance(body, m.TaskAck):
            b = body
            return st.ack(
                b.server_id, b.task_ids, now, b.filtered, b.prompt_too_long, b.attempts, b.session
            )
        if isinstance(body, m.TaskNack):
            st.nack(body.server_id, body.task_ids, body.reason, now, body.attempts, body.session)
            return "ok"
        if isinstance(body, m.Register):
            return st.register(body, now)
        if isinstance(body, m.Heartbeat):
            st.beat(body, now)
            return st.news(body) or st.idle_announcement(body.server_id)
        if isinstance(body, m.SyncDone):
            st.sync_done(body, now)
            return "ok"
        raise TypeError(f"the coordinator got {type(body).__name__}")

    def _dealing(self, server_id: str, grant: Any) -> m.TaskGrant:
        """A grant, shown to the checker with each dealt id's state before the deal (a
        resent grant, the answer to a retried request, deals nothing)."""
        st = self.state
        assert st is not None
        rec = st.servers.get(server_id)
        kept: list[m.TaskGrant] = []  # the grants a retried request gets again
        if rec is not None:
            kept = [*([rec.last_grant[1]] if rec.last_grant else []), *rec.slot_grants.values()]
        before = {tid: e.state for tid, e in st.ledger.entries.items()}
        out: m.TaskGrant = grant()
        resent = any(g is out for g in kept)
        if out.tasks and not resent:
            self.world.checker.dealt(self.family, [t.task_id for t in out.tasks], before)
        return out

    def poll(self) -> None:
        """The poller's next request: the buffer's reports (and its inventory when due)."""
        if self.state is None:
            return
        cfg = self.world.cfg
        self.request(
            "poll", "B", ReportsReq(self.cursor_session, self.cursor), now=self.world.now,
            timeout=cfg.poll_timeout_s, on_reply=self._reports,
        )  # fmt: skip

    def _reports(self, rep: Any) -> None:
        st = self.state
        if st is None or not isinstance(rep, ReportsRep):
            return
        self.world.dirty = True
        self.cursor_session, self.cursor = rep.session, rep.cursor  # moved: a reply came
        st.ledger.dropped(rep.dropped)
        st.trained(list(rep.validated))
        if st.recovery.buffer_contact(rep.session, self.world.now):
            self.request(
                "poll", "B", InventoryReq(), now=self.world.now,
                timeout=self.world.cfg.poll_timeout_s, on_reply=self._inventory,
            )  # fmt: skip
        else:
            self._audit()

    def _inventory(self, rep: Any) -> None:
        st = self.state
        if st is not None and isinstance(rep, InventoryRep):
            self.world.dirty = True
            st.reconcile_buffer(rep.held, rep.dropped)
            st.trained(rep.validated)

    def _audit(self) -> None:
        """Acknowledged groups checked against the buffer, when an audit is due."""
        st = self.state
        audit = api.audit_request(st, self.world.now) if st is not None else None
        if audit is None:
            return
        ids, before = audit

        def answered(rep: Any) -> None:
            if self.state is st and st is not None and isinstance(rep, AuditRep):
                self.world.dirty = True
                api.audited(st, rep.unknown, rep.paused, before)

        self.request(
            "poll", "B", AuditReq(ids), now=self.world.now,
            timeout=self.world.cfg.poll_timeout_s, on_reply=answered,
        )  # fmt: skip

    def reap(self) -> None:
        if self.state is not None:
            self.world.dirty = True
            self.state.reap(self.world.now)

    # ------------------------------------------------------------------ learner loop
    def advance(self) -> None:
        """One move of the learner loop, when it can make one."""
        if self.state is None:
            return
        self.world.dirty = True
        self._send_acks()
        phase = self.phase
        if phase == "hello":
            self._hello()
        elif phase == "ready":
            self._want_batch()
        elif phase == "training" and self.world.now >= self.train_due:
            self._trained()
        elif phase in ("syncing", "catchup"):
            self._round_end()

    def _hello(self) -> None:
        ck = self.restored
        req = HelloReq(
            acked_through=ck.last_batch_id if ck is not None else None,
            session=ck.last_batch_session if ck is not None else "",
            consumer="learner",
            line=self.line.copy(),
            resumed=ck is not None,
        )
        self.request(
            "buf", "B", req, now=self.world.now, timeout=self.world.cfg.control_timeout_s,
            on_reply=self._welcome,
        )  # fmt: skip

    def _welcome(self, rep: Any) -> None:
        st, ck, cfg = self.state, self.restored, self.world.cfg
        if st is None or not isinstance(rep, Welcome):
            return
        if ck is None:  # versions go on above what the surviving buffer has seen
            api.at_least(st, rep.policy_version)
        else:  # the replay of the redelivered batches reproduces versions
            through = replayed_version(
                ck.version, ck.step, rep.redelivering, cfg.sync_every, cfg.total_steps
            )
            st.versions.set_replay(through)
            if rep.policy_version > through:  # as rank 0 does (learner/control_plane.py)
                api.at_least(st, rep.policy_version)
        self.phase = "done" if self.step >= cfg.total_steps else "ready"

    def _want_batch(self) -> None:
        st, cfg, now = self.state, self.world.cfg, self.world.now
        assert st is not None
        if self._catchup("ready"):
            return
        req = BatchReq(self.version, "learner", self.last, self.line)
        if self.request(
            "buf", "B", req, now=now, timeout=cfg.batch_wait_s + cfg.batch_timeout_s,
            on_reply=self._got, on_timeout=self._no_batch,
        ):  # fmt: skip
            self.phase = "waiting"

    def _no_batch(self) -> None:
        if self.phase == "waiting":
            self.phase = "ready"

    def _got(self, rep: Any) -> None:
        if self.phase != "waiting" or not isinstance(rep, BatchRep):
            return
        if rep.batch is None:
            self.phase = "ready"
            return
        self.last = (api.batch_session(rep.batch, rep.session), rep.batch.batch_id)
        batch = self._untrained(rep.batch)
        if batch is None:
            self.phase = "ready"
            return
        self.batch, self.phase = batch, "training"
        self.train_due = self.world.now + self.world.cfg.train_s

    def _untrained(self, batch: Batch) -> Batch | None:
        """As the learner's rank 0 does (learner/control_plane.py): groups these weights
        trained already are left out; a batch with nothing left is acknowledged at once."""
        st = self.state
        assert st is not None
        seen = st.ledger.already_trained(batch.task_ids)
        if not seen:
            return batch
        groups = [g for g in batch.groups if g.task_id not in seen]
        if groups:
            return msgspec.structs.replace(batch, groups=groups)
        self.acks.append([batch.batch_id])
        return None

    def _trained(self) -> None:
        st, cfg, batch = self.state, self.world.cfg, self.batch
        assert st is not None and batch is not None
        ids = sorted({g.task_id for g in batch.groups})
        self.world.checker.trained(self, batch)
        self.line.add(self.last[0], batch.batch_id, ids)
        self.step += 1
        st.trained(ids)  # before the push: the window moves by what it consumed
        if cfg.save_freq > 0:
            self.unacked.append(batch.batch_id)
        else:
            self.acks.append([batch.batch_id])
        self.batch = None
        if push_due(self.step, cfg.sync_every, cfg.total_steps):
            self._push()
        else:
            self._after_push()

    def _push(self) -> None:
        st = self.state
        assert st is not None
        target = self.version + 1
        self.pushed, self.pushed_weights = True, self.line.weights
        if st.versions.adopt(target):
            self.world.checker.adopted(self.world, target)
            self.version = max(st.version, self.pushing_version)
            self._after_push()
            return
        rnd = st.versions.begin_sync(PLAN)
        self.pushing_version = rnd.version
        self._begin_round(rnd.sync_id, "main")

    def _begin_round(self, sync_id: int, then: str) -> None:
        self.round = (sync_id, self.world.now + self.world.cfg.sync_timeout_s)
        self.phase, self.next_phase = ("syncing" if then == "main" else "catchup"), then
        self._round_end()  # a round without members ends at once

    def _round_end(self) -> None:
        st, now = self.state, self.world.now
        assert st is not None and self.round is not None
        if st.syncs.waiting_for() and now < self.round[1]:
            return
        st.versions.finish_sync(True, now=now)
        self.round = None
        if self.next_phase == "main":
            self.version = max(st.version, self.pushing_version)
            self._after_push()
        elif self.next_phase == "after_step":
            self._after_push(saved=True)
        else:
            self.phase = "ready"

    def _after_push(self, saved: bool = False) -> None:
        """Checkpoint when due, serve catch-ups, then the step is over (loop._one_step)."""
        cfg, st = self.world.cfg, self.state
        assert st is not None
        due = cfg.save_freq > 0 and self.step % cfg.save_freq == 0
        if not saved and due and self.step < cfg.total_steps:
            self._save()
        if self._catchup("after_step"):
            return
        st.on_step(self.step)
        if self.step >= cfg.total_steps:
            self._save()  # the final checkpoint, whatever save_freq says
            self.phase = "done"
        else:
            self.phase = "ready"

    def _catchup(self, then: str) -> bool:
        """Start a catch-up for the first server waiting for one; False when none is
        (or this process has no weights to send yet)."""
        st = self.state
        assert st is not None
        waiting = st.versions.pending_catchups(self.world.now) if self.pushed else []
        if not waiting:
            return False
        rnd = st.versions.begin_catchup(waiting[0], PLAN)
        self._begin_round(rnd.sync_id, then)
        return True

    def _save(self) -> None:
        st = self.state
        assert st is not None
        self.world.checkpoint = Checkpoint(
            coordinator=json.loads(json.dumps(st.state_dict())),
            step=self.step,
            version=self.version,
            last_batch_id=self.last[1],
            last_batch_session=self.last[0],
            line=self.line.copy(),
            family=self.family,
        )
        if self.unacked:
            self.acks.append(self.unacked)
            self.unacked = []

    def _send_acks(self) -> None:
        """Acks go out on the learner's buffer socket once it is free (one call each; a
        lost one is not retried: the next hello acknowledges what a checkpoint holds)."""
        if self.acks and not self.busy("buf") and self.phase != "waiting":
            ids = self.acks.pop(0)
            self.request(
                "buf", "B", AckReq(ids, self.line), now=self.world.now,
                timeout=self.world.cfg.control_timeout_s, on_reply=lambda _r: None,
            )  # fmt: skip
