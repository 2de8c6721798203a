"""The coordinator's state and rules, without sockets or threads (callers pass ``now``).

:class:`ControlState` ties together the registry of rollout servers, the task ledger
(:mod:`asyncrl.control.ledger`), the policy version and weight syncs
(:mod:`asyncrl.control.versions`, over the rounds of :mod:`asyncrl.control.syncs`),
validation rounds (:mod:`asyncrl.control.validation_schedule`) and shutdown. The service
(:mod:`asyncrl.control.coordinator`) calls it under one lock; tests call it directly.

Registry rules:

- A server is *live* from its :class:`Register` until it leaves, re-registers (a restart:
  the old incarnation counts as dead) or is silent for ``dead_after_s`` (any message counts
  as a sign of life). A dead or departed server's unacknowledged tasks are re-dealt under
  the same ids and it leaves the sync group.
- A server with engine ranks that holds weights older than the current version gets no
  task until a catch-up brings it level (:mod:`asyncrl.control.versions`).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from asyncrl.control import ledger_recovery
from asyncrl.control.grant_size import GrantRoom
from asyncrl.control.group_filter import GroupFilter
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.ledger_checkpoint import load_ledger, save_ledger
from asyncrl.control.messages import (
    Announcement,
    Heartbeat,
    Register,
    Registered,
    SyncDone,
    TaskAckReply,
    TaskGrant,
)
from asyncrl.control.recovery import Recovery
from asyncrl.control.registry import SLOT_GRANTS_KEPT, ServerRecord
from asyncrl.control.server_totals import ServerTotals
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_states import OUT, QUEUED, TERMINAL, is_external, kind_of
from asyncrl.control.validation_schedule import ValidationProgress, ValidationSchedule
from asyncrl.control.versions import Versions

log = logging.getLogger(__name__)


STATE_SCHEMA = 2  # 2: per-task states and consumption (1 still loads)


class ControlState:
    """Registry, tasks, versions, syncs; not thread-safe (the service holds a lock)."""

    def __init__(
        self,
        ledger: TaskLedger,
        syncs: SyncBook,
        *,
        heartbeat_s: float,
        dead_after_s: float,
        store_host: str,
        store_port: int,
        test_freq: int = -1,
        val_before_train: bool = False,
        min_servers_to_start: int = 1,
        catchup_backoff_s: float = 5.0,
        catchup_backoff_max_s: float = 120.0,
        group_filter: GroupFilter | None = None,
    ):
        self.ledger = ledger
        self.syncs = syncs
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.store_host = store_host
        self.store_port = store_port
        self.session = secrets.token_hex(4)
        ledger.session = ledger.session or self.session  # names its external slots
        self.sync_secret = secrets.token_hex(16)  # in every sync group's store prefix
        syncs.session = self.session  # in every SyncStart, named back by its report
        self.servers: dict[str, ServerRecord] = {}
        self.shutting_down = ""  # the reason, once shutdown has begun
        self.step = 0  # the learner's last reported step
        self.counts: Counter[str] = Counter()
        self.settings: dict[str, str] = {}  # a server's must equal these (config.shared)
        self._order = 0
        # Dealing starts once this many servers are registered (then stays on, whatever
        # later happens to them): hand-started servers all get work from the first step.
        self.min_servers_to_start = min_servers_to_start
        self.started = min_servers_to_start <= 1
        self.recovery = Recovery(dead_after_s)
        # The groups of the batch the learner trains now (released, not trained yet): a
        # buffer restarted meanwhile does not hold them, and they are not lost.
        self.in_training: set[str] = set()
        self.group_filter = group_filter or GroupFilter(
            enable=False, max_num_gen_batches=0, batch_size=1
        )
        self.group_filter.attach(ledger.source)
        # The servers' counters over the run (their restarts and the learner's included)
        self.server_totals = ServerTotals()
        # The version, the syncs and the catch-ups: their own rules over the same records.
        self.versions = Versions(
            self.servers,
            ledger,
            syncs,
            self.recovery,
            self.counts,
            catchup_backoff_s=catchup_backoff_s,
            catchup_backoff_max_s=catchup_backoff_max_s,
        )
        # When validation rounds start: the steps it is told, its own rules.
        self.validation = ValidationSchedule(
            ledger.source, test_freq=test_freq, val_before_train=val_before_train
        )

    @property
    def version(self) -> int:
        """The current policy version (the last one pushed or adopted)."""
        return self.ledger.budget.version

    # ------------------------------------------------------------------ registry
    def register(self, msg: Register, now: float) -> Registered:
        """(Re-)register a server; a known id is a restarted server: its old tasks go back."""
        if msg.server_id in self.servers:
            self._remove(msg.server_id, "dead", "re-registered (restarted)")
        replay = self.recovery.replay_through
        if replay is not None and msg.policy_version > max(self.version, replay):
            self.ledger.budget.advance(msg.policy_version)  # the version only: not the window
        self.recovery.registered(msg.server_id)
        self._order += 1
        rec = ServerRecord(
            msg.server_id,
            msg.address,
            msg.engine_world_size,
            msg.policy_version,
            self._order,
            now,
            msg.pid,
        )
        # Version 0 is the initial checkpoint, the same on every role of a fresh run; after a
        # learner restart, the versions its replay reproduces (recovery.py).
        rec.trusted = (msg.policy_version == 0 and self.version == 0) or (
            replay is not None and msg.policy_version <= replay
        )
        rec.weights_partial = msg.weights_partial  # untrusted, whatever the above: a catch-up
        self.servers[msg.server_id] = rec
        self.counts["registrations"] += 1
        if msg.task_ids:
            n = ledger_recovery.adopt(self.ledger, msg.server_id, msg.task_ids, now)
            log.info("%s still holds %d of its tasks: they stay its own", msg.server_id, n)
        if not self.started:
            self.started = len(self.servers) >= self.min_servers_to_start
            log.info(
                "%d of %d rollout servers registered%s",
                len(self.servers),
                self.min_servers_to_start,
                ": dealing starts" if self.started else "",
            )
        return Registered(
            server_id=msg.server_id,
            session=self.session,
            policy_version=self.version,
            sync_store_host=self.store_host,
            sync_store_port=self.store_port,
            generation=self.syncs.generation,
            heartbeat_s=self.heartbeat_s,
            dead_after_s=self.dead_after_s,
            catchup=self.versions.needs_catchup(rec),
            sync_secret=self.sync_secret,
        )

    def touch(self, server_id: str, now: float) -> ServerRecord | None:
        """A sign of life from ``server_id``; its record, or None if it is not registered."""
        rec = self.servers.get(server_id)
        if rec is not None:
            rec.last_seen = now
        return rec

    def sync_done(self, msg: SyncDone, now: float) -> None:
        """A member reported on a sync round: a sign of life, then the versions' rules. A
        member that loaded the round's weights holds whole ones."""
        rec = self.touch(msg.server_id, now)
        self.versions.sync_done(msg, rec)
        if rec is not None and self.syncs.loaded(msg):
            rec.weights_partial = False

    def leave(self, server_id: str, pid: int = 0) -> bool:
        """A server left (or its launcher reaped it). A Leave naming another ``pid`` than
        the registered one is about an earlier incarnation (the restarted server registered
        first): ignored, and False says so."""
        rec = self.servers.get(server_id)
        if rec is not None and pid and rec.pid != pid:
            return False
        if rec is not None:
            self._remove(server_id, "left", "left")
        else:  # a resume need not wait for it to register again: it is dead
            self.recovery.left(server_id)
        return True

    def forgive_silence(self, gap_s: float) -> None:
        """The coordinator did not run for ``gap_s``: move every server's last sign of
        life on by it, so that only silence while it listens counts as death."""
        for rec in self.servers.values():
            rec.last_seen += gap_s

    def reap(self, now: float) -> list[str]:
        """Declare dead every server silent for more than ``dead_after_s``."""
        dead = [s for s, r in self.servers.items() if now - r.last_seen > self.dead_after_s]
        for server_id in dead:
            self._remove(server_id, "dead", f"silent for more than {self.dead_after_s:g}s")
        if self.ledger.unclaimed and not self.recovery.resuming:
            gone = ledger_recovery.give_up_unclaimed(self.ledger)
            log.info("%d external slots no server took back after the resume: given up", len(gone))
        late = self.ledger.reclaim(now)
        if late:
            log.warning(
                "%d tasks outstanding for more than %gs taken back and dealt again (raise "
                "control.task_timeout_s if generations are that slow): %s",
                len(late),
                self.ledger.task_timeout_s,
                late[:5],
            )
        return dead

    def _remove(self, server_id: str, cause: str, why: str) -> None:
        del self.servers[server_id]
        self.ledger.release(server_id, cause)
        again = self.syncs.lose(server_id, why)
        if again is not None:  # lost before its round's group formed: begun again without it
            self.counts["syncs_restarted"] += 1
            for member in again.members:
                self.servers[member].syncing = again.sync_id
        self.counts[f"servers_{cause}"] += 1

    # ------------------------------------------------------------------ announcements
    def beat(self, msg: Heartbeat, now: float) -> ServerRecord | None:
        """A heartbeat's sign of life; None when the server is not registered (here, or in
        this session: after a coordinator restart every server registers again)."""
        rec = self.touch(msg.server_id, now) if msg.session == self.session else None
        if rec is not None:
            # It says a version whose report came after its round closed. Never one above
            # the coordinator's: that heartbeat was built before a catch-up from a restarted
            # learner brought the server down, and arrived after its report (another socket).
            if msg.policy_version <= self.version:
                rec.policy_version = max(rec.policy_version, msg.policy_version)
            rec.metrics = msg.metrics
            self.server_totals.observe(msg.server_id, msg.metrics)
        return rec

    def news(self, msg: Heartbeat) -> Announcement | None:
        """The announcement owed to heartbeat ``msg`` now, or None to hold it (no news)."""
        rec = self.servers.get(msg.server_id) if msg.session == self.session else None
        if rec is None:
            return Announcement(registered=False, policy_version=self.version)
        if self.shutting_down:
            return self.idle_announcement(msg.server_id)
        start = self.syncs.start_for(msg.server_id)
        if start is not None and start.sync_id > msg.seen_sync:
            return Announcement(registered=True, policy_version=self.version, sync=start)
        if self.version > msg.seen_version:
            return Announcement(registered=True, policy_version=self.version)
        return None

    def idle_announcement(self, server_id: str) -> Announcement:
        """The state as it is (sent when a held heartbeat's wait ends, or at shutdown)."""
        rec = self.servers.get(server_id)
        if rec is not None and self.shutting_down:
            rec.told_shutdown = True
        return Announcement(
            registered=rec is not None,
            policy_version=self.version,
            sync=self.syncs.start_for(server_id),
            shutdown=bool(self.shutting_down),
        )

    # ------------------------------------------------------------------ tasks
    def grant(
        self,
        server_id: str,
        max_tasks: int,
        now: float,
        request_id: int | None = None,
        max_bytes: int = 0,
        max_samples: int = 0,
    ) -> TaskGrant:
        """Deal to ``server_id`` what the rules allow (maybe nothing, with the reason), in
        a grant of at most ``max_bytes`` (``control.max_message_mb``; 0: its default) and,
        past its first task, ``max_samples`` responses (the server's free slots; 0: any).

        A retry of the last request that got tasks (same ``request_id``) gets that grant
        again: its reply was lost, and its tasks are outstanding at this server.
        """
        rec = self.touch(server_id, now)
        last = rec.last_grant if rec is not None else None
        if last is not None and request_id is not None and last[0] == request_id:
            self.counts["grants_resent"] += 1
            return last[1]
        reason = self._refusal(rec, now)
        if reason:
            return TaskGrant(tasks=[], policy_version=self.version, reason=reason)
        fit = GrantRoom(max_bytes, max_samples)
        tasks, reason = self.ledger.deal(server_id, max_tasks, now, fit)
        fit.log_dropped()
        if self.group_filter.active:
            tasks = [t if t.validation else msgspec.structs.replace(t, filter=True) for t in tasks]
        self.group_filter.dealt(tasks)
        grant = TaskGrant(tasks=tasks, policy_version=self.version, reason=reason)
        if tasks and request_id is not None:
            rec.last_grant = (request_id, grant)  # type: ignore[union-attr]
        return grant

    def grant_slot(self, server_id: str, now: float, request_id: int | None = None) -> TaskGrant:
        """One external slot for ``server_id`` (its OpenAI endpoint opens a group), or
        none with the reason; a retry of a slot request gets the slot it was granted (one of
        the last :data:`~asyncrl.control.registry.SLOT_GRANTS_KEPT`)."""
        rec = self.touch(server_id, now)
        if rec is not None and request_id is not None and request_id in rec.slot_grants:
            return rec.slot_grants[request_id]
        reason = self._refusal(rec, now)
        task = None
        if not reason:
            task, reason = self.ledger.deal_external(server_id, now)
        if task is not None and self.group_filter.active:
            task = msgspec.structs.replace(task, filter=True)
        detail = self.ledger.budget_holders(server_id) if reason == "budget" else ""
        grant = TaskGrant(
            tasks=[task] if task else [], policy_version=self.version, reason=reason, detail=detail
        )
        if task is not None and request_id is not None and rec is not None:
            rec.slot_grants[request_id] = grant
            while len(rec.slot_grants) > SLOT_GRANTS_KEPT:
                rec.slot_grants.popitem(last=False)
        return grant

    def _refusal(self, rec: ServerRecord | None, now: float) -> str:
        """Why nothing may be dealt to this server now ("" when something may)."""
        if rec is None:
            return "unregistered"
        if self.shutting_down:
            return "shutdown"
        if not self.started or self.recovery.holding(now):
            return "starting"
        if self.versions.needs_catchup(rec):
            return "catchup"
        return ""

    def ack(
        self,
        server_id: str,
        task_ids: list[str],
        now: float,
        filtered: bool = False,
        prompt_too_long: bool = False,
        attempts: list[int] | None = None,
        session: str = "",
    ) -> TaskAckReply:
        self.touch(server_id, now)
        if filtered:  # dropped at the server by algorithm.filter_groups (or, too long, before)
            reason = "prompt_too_long" if prompt_too_long else "filtered"
            done = self.ledger.filtered(server_id, task_ids, reason, attempts, session)
            if not prompt_too_long:  # a prompt never generated says nothing of its groups
                self.group_filter.filtered(len(done), self.step)
                self.group_filter.verdicts(done, filtered=True)
            return TaskAckReply(acked=done, unknown=[t for t in task_ids if t not in done])
        acked, unknown = self.ledger.ack(task_ids, now, server_id)
        # Only a group dealt with the filter on was judged: one dealt past the bound is
        # pushed whatever it scored, and says nothing about its prompt.
        self.group_filter.verdicts(acked, filtered=False)
        return TaskAckReply(acked=acked, unknown=unknown)

    def nack(
        self,
        server_id: str,
        task_ids: list[str],
        reason: str,
        now: float,
        attempts: list[int] | None = None,
        session: str = "",
    ) -> int:
        """Tasks that failed at a live server (``attempts``: each one's attempt as it was
        dealt there, ``session`` the coordinator session that dealt them): dealt again (or
        given up); how many."""
        self.touch(server_id, now)
        back = self.ledger.nack(server_id, task_ids, attempts=attempts, session=session)
        # Dealt again (maybe unfiltered) or given up; not a report the ledger ignored (of an
        # earlier deal, or of a task since dealt elsewhere): that deal still awaits its verdict.
        self.group_filter.forget(t for t in task_ids if not self.ledger.is_out(t))
        given = [t for t in task_ids if is_external(t)]
        if given:  # an endpoint group that will not train: routine, its slot frees
            log.info("%s gave back endpoint slots %s (%s)", server_id, given, reason)
            if len(given) == len(task_ids):
                return back
        log.warning(
            "%s failed %d tasks (%s): %d dealt again, the rest given up after "
            "control.task_retries failures",
            server_id,
            len(task_ids),
            reason or "no reason given",
            back,
        )
        return back

    def training(self, task_ids: list[str]) -> None:
        """The learner took a batch of these tasks' groups to train (until :meth:`trained`):
        a buffer restarted while it trains them has not lost them."""
        self.in_training = set(task_ids)

    def trained(self, task_ids: list[str]) -> None:
        """The learner trained on these tasks' groups (validation: the buffer scored them)."""
        self.in_training.difference_update(task_ids)
        self.ledger.trained(task_ids)
        self.group_filter.trained(sum(kind_of(t) == "train" for t in task_ids))
        # A group the filter judged was pushed, so it carried a signal: its row's verdict,
        # even when its server's ack comes later (then unknown) or never.
        self.group_filter.verdicts(task_ids, filtered=False)

    def reconcile_buffer(
        self,
        held: list[str],
        dropped: list[Any],
        paused: bool = False,
        validated: Sequence[str] = (),
    ) -> int:
        """The buffer's inventory came: adopt what it holds, deal again what it lost. A
        buffer not reading (``paused``: full) may have groups it lacks waiting in its
        socket: none is taken as lost now; the audit asks about them once it reads.
        ``validated``, the validation groups it scored, are done first: not held, they
        would be counted lost and dealt again."""
        self.trained(list(validated))
        cutoff = -math.inf if paused else self.recovery.cutoff
        if paused:
            log.info(
                "the buffer's inventory came while it is not reading (full): groups it "
                "lacks are checked by the next audit, not dealt again now"
            )
        # The batch in training left the old buffer: not held by the new one, not lost.
        training = sorted(self.in_training - set(held))
        lost = ledger_recovery.reconcile(self.ledger, [*held, *training], dropped, cutoff)
        self.recovery.reconciled()
        self.group_filter.verdicts(list(held), filtered=False)  # pushed: see trained()
        if lost:
            log.warning("%d groups the buffer lost (it restarted) are dealt again", lost)
        return lost

    def audit_request(self, now: float) -> tuple[list[str], float] | None:
        """Acknowledged groups to check against the buffer now, with their cutoff, or None
        when no audit is due (:meth:`Recovery.audit_due`)."""
        before = self.recovery.audit_due(now)
        ids = ledger_recovery.acked_before(self.ledger, before) if before is not None else []
        ids = [t for t in ids if t not in self.in_training]  # released to the learner
        return (ids, before) if ids and before is not None else None

    def audited(self, unknown: list[str], paused: bool, before: float) -> int:
        """The buffer never received ``unknown``: dealt again, unless it is not reading."""
        if paused:  # they may still wait in a socket queue
            return 0
        lost = ledger_recovery.lost(self.ledger, unknown, before)
        if lost:
            log.warning("%d acknowledged groups never reached the buffer: dealt again", lost)
        return lost

    # ------------------------------------------------------------------ validation, end
    def start_run(self) -> None:
        """Before the first training task: the validation round of ``val_before_train``."""
        self.validation.start_run(self.step)

    def on_step(self, step: int, weights_step: int | None = None) -> bool:
        """The learner finished ``step`` (the servers hold the weights of ``weights_step``,
        default ``step``); True when a validation round was started."""
        self.step = max(self.step, step)
        entries = self.ledger.entries
        self.group_filter.keep_only(lambda t: t in entries and entries[t].state not in TERMINAL)
        return self.validation.on_step(step, weights_step)

    def start_validation(self, step: int) -> bool:
        """Start a validation round now (:meth:`ValidationSchedule.start`); True if so."""
        return self.validation.start(step)

    def training_left(self) -> int | None:
        """None while the dataset has training tasks to deal; once every epoch is dealt, the
        training groups that may still reach a batch (in flight, queued or in the buffer)."""
        if not self.ledger.source.exhausted:
            return None
        a = self.ledger.accounting()
        return int(a["accounting/train/in_flight"] + a["accounting/train/in_buffer"])

    def validation_progress(self) -> ValidationProgress:
        return self.validation.progress()

    def validation_generating(self) -> bool:
        """Whether the servers are generating a validation round: rows of it not dealt
        yet, or its tasks out at servers or queued to be dealt again."""
        val = self.ledger.tally["val"]
        return bool(self.ledger.source.val_queue) or val[OUT] + val[QUEUED] > 0

    def round_states(self, keys: list[str]) -> dict[str, dict[str, str]]:
        """For each validation round key: the state of each of its ids this ledger knows
        (``done``: scored; ``given_up``: failed past ``control.task_retries``)."""
        progress = self.validation.progress()
        out: dict[str, dict[str, str]] = {}
        for key in keys:
            ids = (f"{key}/{row}" for row in range(progress.groups_in(key)))
            out[key] = {t: e.state for t in ids if (e := self.ledger.entries.get(t)) is not None}
        return out

    def rescore(self, task_ids: list[str]) -> int:
        """Scored validation groups the learner never read (the buffer died first): dealt
        again (:func:`ledger_recovery.rescore`)."""
        n, gone = ledger_recovery.rescore(self.ledger, task_ids)
        if n:
            log.warning(
                "%d validation groups were scored by a buffer that died before the learner "
                "read them: dealt again",
                n,
            )
        if gone:
            log.warning(
                "%d validation groups (%s...) of a round over the validation set this run "
                "resumed from were lost with the buffer; this run's data.val_files holds "
                "other rows, so they cannot be scored again: the round is reported without "
                "them",
                len(gone),
                gone[0],
            )
        return n

    def begin_shutdown(self, reason: str) -> None:
        self.shutting_down = self.shutting_down or reason or "requested"

    def all_told(self) -> bool:
        """Every registered server has been told to shut down (or has left)."""
        return all(r.told_shutdown for r in self.servers.values())

    # ------------------------------------------------------------------ state, metrics
    def state_dict(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA,
            "ledger": save_ledger(self.ledger),
            "sync_counter": self.syncs.counter,
            "step": self.step,
            "last_val_step": self.validation.last_val_step,
            "val_started_at": {str(k): v for k, v in self.validation.started_at.items()},
            "servers": sorted(self.servers),
            "group_filter": self.group_filter.state_dict(),
            "counts": dict(self.counts),  # coordinator/<event> totals of the run
            "server_totals": self.server_totals.state_dict(),  # rollout/<counter> of the run
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("schema") not in (1, STATE_SCHEMA):
            raise ValueError(f"coordinator state schema {state.get('schema')} != {STATE_SCHEMA}")
        load_ledger(self.ledger, state["ledger"])
        self.syncs.counter = int(state["sync_counter"])
        self.step = int(state["step"])
        self.validation.last_val_step = int(state["last_val_step"])
        started = state.get("val_started_at", {})  # saved before it: rounds' steps unknown
        self.validation.started_at = {int(k): int(v) for k, v in started.items()}
        self.recovery.restored(list(state.get("servers", [])))
        if "group_filter" in state:  # saved before it: counts start again
            self.group_filter.load_state_dict(state["group_filter"])
        self.counts.update({k: int(v) for k, v in state.get("counts", {}).items()})
        # Saved before it: the totals start from the live servers' counts
        self.server_totals.load_state_dict(state.get("server_totals", {}))
        # Dealing had started in the saved session: min_servers_to_start is a start-up rule,
        # and after a scale-down it may never be met again.
        self.started = True

    def metrics(self) -> dict[str, float]:
        out = {f"coordinator/{k}": float(v) for k, v in sorted(self.counts.items())}
        out["coordinator/version"] = float(self.version)
        out["coordinator/servers"] = float(len(self.servers))
        out["coordinator/servers_catching_up"] = float(
            sum(self.versions.needs_catchup(r) for r in self.servers.values())
        )
        return out | self.ledger.metrics() | self.group_filter.metrics()
