"""A rollout server as the fault simulation sees it: its control-plane behaviour only.

It mirrors :class:`asyncrl.control.client.CoordinatorClient` and the server's task loop
(:mod:`rollout_servers.server`) where they decide something the coordinator sees:

- it registers with the task ids it holds and the version it holds, and registers again
  when a heartbeat or a grant says it is unknown (a coordinator restart, or it was declared
  dead while silent);
- it asks for tasks with a request id that moves on only after a reply, so a retry of a
  request whose reply was lost gets the same grant; it opens external slots the same way;
- a task is generated after a virtual delay, its whole group pushed to the buffer (one
  message, sometimes two halves), then acknowledged (retried on timeouts); a failed task is
  negatively acknowledged instead;
- it joins the syncs and catch-ups it is told about, and reports each one.

Only the server's own choices live here; when it acts is the schedule's business.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.control import messages as m
from asyncrl.wire import Packed, Trajectory
from benchmarks.fault_net import Endpoint

if TYPE_CHECKING:
    from benchmarks.fault_world import World

log = logging.getLogger(__name__)

ACK_ATTEMPTS = 3  # as the real client retries an ack
# The endpoint's reaper period (rollout_servers.endpoint_groups) in heartbeats: at most
# 5 s, 2.5 of the default 2 s heartbeats; the simulation's clock runs faster.
SLOT_GIVE_BACK_BEATS = 2.5


@dataclass
class HeldTask:
    task: m.Task
    due: float  # when its generation ends (virtual seconds)
    version: int  # the weights it started under: the oldest version of its tokens
    pushed: bool = False  # its group left; the task is held until the ack's call ends


class Server(Endpoint):
    """One rollout server process; ``reborn`` is a restart from the initial weights."""

    def __init__(self, name: str, world: World, engine: int):
        super().__init__(name, world.net)
        self.world = world
        self.engine = engine  # engine_world_size: 0 adopts announced versions, 1 syncs
        self.version = 0
        self.session = ""
        self.registered = False
        self.announced = 0
        self.seen_sync = 0
        self.held: dict[str, HeldTask] = {}
        self.request_id = 1
        self.slot_request_id = 1
        self.slot_unanswered: float | None = None  # when a slot request went unanswered
        self.outbox: list[tuple[Any, int]] = []  # control messages to send, attempts left
        self.sync: m.SyncStart | None = None
        self.sync_due = 0.0
        self.muted = False  # cut off from everyone (a partition)
        self.asking = True  # the drain's quiet phase stops new work
        # When it last died and the version it held then: the coordinator cannot know of a
        # death before control.dead_after_s of silence (the adoption check allows for it).
        self.died: tuple[float, int] = (float("-inf"), 0)

    # ------------------------------------------------------------------ lifecycle
    def crash(self) -> None:
        """The process dies: what it generated and held is gone."""
        if self.alive:
            self.died = (self.world.now, self.version)
        self.die()
        self.held.clear()
        self.outbox.clear()
        self.sync = None

    def restart(self) -> None:
        """A new process: initial weights (version 0), nothing held, not registered."""
        self.crash()
        self.reborn()
        self.version, self.session, self.registered = 0, "", False
        self.announced, self.seen_sync = 0, 0

    # ------------------------------------------------------------------ actions
    def act(self, op: str) -> None:
        """One thing this server may do now (a no-op when it cannot)."""
        if not self.alive:
            return
        now = self.world.now
        if op == "register" or not self.registered:
            self._register(now)
        elif op == "beat":
            self._beat(now)
            self._give_back_slot(now)
        elif op == "ask" and self.asking:
            self._ask(now)
        elif op == "slot" and self.asking and self.world.cfg.slots:
            self._slot(now)
        elif op == "finish":
            self._finish(now)
        elif op == "sync":
            self._load(now)
        self._send_outbox(now)

    def _register(self, now: float) -> None:
        msg = m.Register(
            server_id=self.name,
            engine_world_size=self.engine,
            policy_version=self.version,
            pid=self.inc,
            task_ids=sorted(self.held),
        )
        self.request(
            "control", "L", msg, now=now, timeout=self.world.cfg.control_timeout_s,
            on_reply=self._registered,
        )  # fmt: skip

    def _registered(self, reply: Any) -> None:
        if not isinstance(reply, m.Registered):
            return
        self.registered, self.session, self.seen_sync = True, reply.session, 0
        self.announced = max(self.announced, reply.policy_version)
        if self.engine == 0:
            self.version = self.announced

    def _beat(self, now: float) -> None:
        msg = m.Heartbeat(
            server_id=self.name,
            session=self.session,
            policy_version=self.version,
            seen_version=self.announced,
            seen_sync=self.seen_sync,
        )
        self.request(
            "watch", "L", msg, now=now, timeout=self.world.cfg.control_timeout_s,
            on_reply=self._announced,
        )  # fmt: skip

    def _announced(self, ann: Any) -> None:
        if not isinstance(ann, m.Announcement):
            return
        if not ann.registered:
            self.registered = False
            return
        if ann.policy_version > self.announced:
            self.announced = ann.policy_version
            if self.engine == 0:
                self.version = self.announced
        if ann.sync is not None and ann.sync.sync_id > self.seen_sync and self.engine:
            self.seen_sync = ann.sync.sync_id
            self.sync = ann.sync
            self.sync_due = self.world.now + self.world.delay("load", self.name, ann.sync.sync_id)

    def _ask(self, now: float) -> None:
        room = self.world.cfg.max_inflight - len(self.held)
        if room <= 0:
            return
        msg = m.TaskRequest(
            server_id=self.name,
            max_tasks=min(room, self.world.cfg.tasks_per_request),
            request_id=self.request_id,
        )
        self.request(
            "tasks", "L", msg, now=now, timeout=self.world.cfg.control_timeout_s,
            on_reply=self._granted,
        )  # fmt: skip

    def _granted(self, grant: Any) -> None:
        if not isinstance(grant, m.TaskGrant):
            return
        self.request_id += 1  # a retry after a timeout keeps the id: the grant comes again
        if grant.reason == "unregistered":
            self.registered = False
        for task in grant.tasks:
            self._start(task)

    def _slot(self, now: float) -> None:
        if self.world.chance("slot", self.name, self.slot_request_id, int(now * 10)) > 0.2:
            return  # agents open groups now and then
        msg = m.SlotRequest(server_id=self.name, request_id=self.slot_request_id)
        self.request(
            "control", "L", msg, now=now, timeout=self.world.cfg.control_timeout_s,
            on_reply=self._slotted, on_timeout=self._slot_lost,
        )  # fmt: skip

    def _slotted(self, grant: Any) -> None:
        if isinstance(grant, m.TaskGrant):
            self.slot_request_id += 1
            self.slot_unanswered = None
            for task in grant.tasks:
                self._start(task)

    def _slot_lost(self) -> None:
        if self.slot_unanswered is None:
            self.slot_unanswered = self.world.now

    def _give_back_slot(self, now: float) -> None:
        """As the endpoint's reaper (``give_back_unanswered_slots``): a slot request left
        unanswered and not repeated for a while is asked once more under its id, and the
        slot it gets is given back."""
        since = self.slot_unanswered
        if since is None or now - since < SLOT_GIVE_BACK_BEATS * self.world.cfg.heartbeat_s:
            return
        msg = m.SlotRequest(server_id=self.name, request_id=self.slot_request_id)
        self.request(
            "control", "L", msg, now=now, timeout=self.world.cfg.control_timeout_s,
            on_reply=self._slot_given_back, on_timeout=lambda: None,
        )  # fmt: skip

    def _slot_given_back(self, grant: Any) -> None:
        if not isinstance(grant, m.TaskGrant):
            return
        self.slot_request_id += 1
        self.slot_unanswered = None
        if ids := [t.task_id for t in grant.tasks if t.task_id not in self.held]:
            self.outbox.append((m.TaskNack(server_id=self.name, task_ids=ids), ACK_ATTEMPTS))

    def _start(self, task: m.Task) -> None:
        if task.task_id in self.held:
            return  # the same task again (a resent grant): one generation
        due = self.world.now + self.world.delay("gen", task.task_id, task.attempt, self.name)
        self.held[task.task_id] = HeldTask(task, due, self.version)

    def _finish(self, now: float) -> None:
        """The oldest generation that is done: push its group and acknowledge it (or fail
        it: a negative ack, dealt again elsewhere)."""
        done = [h for h in self.held.values() if h.due <= now and not h.pushed]
        if not done:
            return
        h = min(done, key=lambda x: x.due)
        tid = h.task.task_id
        if self.world.chance("fail", tid, h.task.attempt, self.name) < 0.04:
            del self.held[tid]
            # Naming its deal, as a server does: a resend cannot fail a later deal of it.
            deal = {"attempts": [h.task.attempt], "session": h.task.dealt_session}
            nack = m.TaskNack(server_id=self.name, task_ids=[tid], **deal)
            self.outbox.append((nack, ACK_ATTEMPTS))
            return
        h.pushed = True
        if h.task.filter and self.world.chance("alike", tid, h.task.attempt, self.name) < (
            self._alike_chance(h.task)
        ):
            # every member scored alike: never pushed, reported filtered
            deal = {"attempts": [h.task.attempt], "session": h.task.dealt_session}
            msg = m.TaskAck(server_id=self.name, task_ids=[tid], filtered=True, **deal)
            self.outbox.append((msg, ACK_ATTEMPTS))
            return
        for part in _group(h, self.world.chance("split", tid, self.name) < 0.15, self.name):
            self.push("B", part)
        self.outbox.append((m.TaskAck(server_id=self.name, task_ids=[tid]), ACK_ATTEMPTS))

    def _alike_chance(self, task: m.Task) -> float:
        """The chance a group of ``task`` scores alike (is filtered). With prompt skipping,
        half the prompts are "learned" (alike 85% of the time) and the rest 25%, so
        streaks build and rows get passed over; otherwise 40% for every group."""
        if not self.world.cfg.skip_uninformative:
            return 0.4
        return 0.85 if self.world.chance("learned", task.ground_truth) < 0.5 else 0.25

    def _load(self, now: float) -> None:
        """Finish loading the sync in progress: ok when the learner incarnation that
        started it is still sending it."""
        s = self.sync
        if s is None or now < self.sync_due:
            return
        self.sync = None
        ok = self.world.learner.sending(s.sync_id)
        if ok:
            self.version = max(self.version, s.version)
        msg = m.SyncDone(server_id=self.name, sync_id=s.sync_id, version=s.version, ok=ok)
        self.outbox.append((msg, ACK_ATTEMPTS))

    def _send_outbox(self, now: float) -> None:
        if not self.outbox or self.busy("control"):
            return
        body, attempts = self.outbox[0]

        def answered(_reply: Any) -> None:
            self.outbox.pop(0)
            self._answered(body)

        def timed_out() -> None:
            if attempts <= 1:  # never answered: the real client logs and moves on
                self.outbox.pop(0)
                self._answered(body)
            else:
                self.outbox[0] = (body, attempts - 1)

        self.request(
            "control", "L", body, now=now, timeout=self.world.cfg.control_timeout_s,
            on_reply=answered, on_timeout=timed_out,
        )  # fmt: skip

    def _answered(self, body: Any) -> None:
        """An ack's call ended: the task is no longer this server's (its slot is free)."""
        if isinstance(body, m.TaskAck):
            for tid in body.task_ids:
                self.held.pop(tid, None)


def _group(h: HeldTask, split: bool, server: str) -> list[Packed]:
    """The group of ``h`` as the messages a server pushes (whole, or two halves)."""
    t = h.task
    size = t.n
    trajs = [
        Trajectory.build(
            task_id=t.task_id,
            prompt_ids=[1],
            response_ids=[2],
            logprobs=[-1.0],
            version_spans=[(h.version, 1)],
            reward=float(i),
            group_index=i,
            group_size=size,
            validation=t.validation,
            server_id=server,
        )
        for i in range(size)
    ]
    if split and size > 1:
        return [Packed.pack(trajs[: size // 2]), Packed.pack(trajs[size // 2 :])]
    return [Packed.pack(trajs)]
