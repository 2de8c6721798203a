"""The simulated run of the fault simulation: configuration, clock, message delivery, buffer.

:class:`World` holds the parts (rollout servers, the buffer process, the learner process
with its coordinator), the virtual clock and the network (:mod:`benchmarks.fault_net`).
Delivering a message calls the receiving part's handler; its reply goes back on the network.
The buffer process (:class:`BufferProc`) wraps the real :class:`~buffer.core.ReplayBuffer`
as :mod:`buffer.service` does (held batch requests, hello, acks, reports, inventory); the
requests between the processes are the small records below, so that the simulation does not
depend on the wire format, only on the decision classes (:mod:`benchmarks.fault_api`).

Random choices the world makes for itself (generation times, which task fails) come from
hashes of the seed and the thing decided, not from a stream: removing an event from a
schedule (shrinking) does not change the dice of every later one.
"""

from __future__ import annotations

import logging
import random
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.wire import Batch, DroppedTask, Packed
from benchmarks import fault_api as api
from benchmarks.fault_net import Endpoint, Msg, Net

if TYPE_CHECKING:
    from benchmarks.fault_checks import Checker, Line
    from benchmarks.fault_learner import LearnerProc
    from benchmarks.fault_server import Server

log = logging.getLogger(__name__)

DEFER = object()  # a handler's answer: leave the message in flight (the buffer is full)


@dataclass(frozen=True)
class SimConfig:
    """One schedule's run configuration (varied per seed by :func:`config_for`)."""

    seed: int
    max_policy_lag: int = 1
    sync_every: int = 1
    batch: int = 2  # data.train_batch_size (groups per step)
    n: int = 2  # rollout.n
    save_freq: int = 1  # trainer.save_freq (<= 0: no checkpoint until the last step)
    engines: tuple[int, ...] = (1, 0)  # engine_world_size of each rollout server
    total_steps: int = 6
    test_freq: int = -1
    tasks_per_request: int = 2
    max_inflight: int = 3  # tasks a server works on at once
    slots: bool = False  # servers also open external slots
    filter_groups: bool = False  # algorithm.filter_groups: servers drop alike groups
    max_num_gen_batches: int = 0
    skip_uninformative: bool = False  # ... and pass over rows they keep dropping
    lag_retries: int = 1
    task_retries: int = 3
    task_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    dead_after_s: float = 2.0
    sync_timeout_s: float = 3.0
    catchup_backoff_s: float = 1.0
    catchup_backoff_max_s: float = 8.0
    group_timeout_s: float = 10.0
    capacity: int = 1000
    batch_wait_s: float = 1.0  # the learner's long-poll for a batch
    batch_timeout_s: float = 2.0  # ... and how much longer it waits for the reply
    control_timeout_s: float = 1.0
    poll_every_s: float = 0.5  # the coordinator's poll of the buffer's reports
    poll_timeout_s: float = 2.0
    train_s: float = 0.3
    train_rows: int = 24
    val_rows: int = 2


def config_for(seed: int) -> SimConfig:
    """The configuration of schedule ``seed`` (the ranges of the brief)."""
    r = random.Random(f"config/{seed}")
    servers = r.randint(1, 3)
    return SimConfig(
        seed=seed,
        max_policy_lag=r.randint(0, 3),
        sync_every=r.randint(1, 3),
        batch=r.randint(1, 3),
        n=r.randint(1, 3),
        save_freq=r.choice((-1, 1, 3)),
        engines=tuple(r.choice((0, 1, 1)) for _ in range(servers)),
        total_steps=r.randint(3, 7),
        test_freq=r.choice((-1, -1, 3)),
        tasks_per_request=r.randint(1, 3),
        max_inflight=r.randint(1, 4),
        slots=r.random() < 0.3,
        filter_groups=(filtering := r.random() < 0.3),
        max_num_gen_batches=r.choice((0, 1, 2)),
        # drawn last: the earlier draws (and so every schedule before it) are unchanged
        skip_uninformative=(skip := r.random() < 0.5),
        # With skipping, few rows: an epoch turns over within a run, so rows come back
        # with their streaks (24 rows outlast the 3-7 steps of a schedule).
        train_rows=r.choice((3, 4, 6)) if skip and filtering else 24,
    )


# ---------------------------------------------------------------------- buffer requests
@dataclass
class BatchReq:
    version: int
    consumer: str
    received: tuple[str, int | None] | None
    line: Line


@dataclass
class HelloReq:
    acked_through: int | None
    session: str
    consumer: str
    line: Line  # what the restored learner's weights contain
    resumed: bool  # from a checkpoint (a fresh start replays nothing)


@dataclass
class AckReq:
    batch_ids: list[int]
    line: Line


@dataclass
class ReportsReq:
    session: str  # the buffer session the cursor reads (another: from the start)
    cursor: tuple[int, int]


@dataclass
class InventoryReq:
    pass


@dataclass
class AuditReq:
    task_ids: list[str]


@dataclass
class AuditRep:
    unknown: list[str]
    paused: bool  # the buffer is full and not reading: a group may still be on its way


@dataclass
class BatchRep:
    batch: Batch | None
    session: str


@dataclass
class Welcome:
    redelivering: int
    session: str
    policy_version: int  # the highest version the buffer measured lag against


@dataclass
class ReportsRep:
    dropped: list[DroppedTask]
    validated: list[str]
    session: str
    cursor: tuple[int, int]


@dataclass
class InventoryRep:
    held: list[str]
    dropped: list[DroppedTask]
    validated: list[str]
    session: str


@dataclass
class Held:
    msg: Msg
    until: float


class BufferProc(Endpoint):
    """The buffer process: the real replay buffer behind the service's request rules."""

    def __init__(self, world: World):
        super().__init__("B", world.net)
        self.world = world
        self.sessions = 0
        self.session = ""
        self.buf = self._fresh()
        self.held: list[Held] = []

    def _fresh(self) -> Any:
        self.sessions += 1
        self.session = f"b{self.sessions}"
        return api.new_buffer(self.world.cfg, self.session)

    def restart(self) -> None:
        """A buffer crash and restart: a new session, empty; the messages already in its
        socket queue (about half of those in flight to it) die with it."""
        self.reborn()
        self.buf = self._fresh()
        self.held.clear()
        w = self.world
        w.net.drop_where(lambda m: m.dst == "B" and w.chance("queued", m.seq) < 0.5)

    def handle(self, msg: Msg) -> Any:
        body, now = msg.body, self.world.now
        if isinstance(body, Packed):
            if not self.buf.has_room():
                return DEFER
            self.buf.add_packed(body, now)
            return None
        if isinstance(body, BatchReq):
            self.held = [h for h in self.held if h.msg.body.consumer != body.consumer]
            self.held.append(Held(msg, now + self.world.cfg.batch_wait_s))
            self.serve(force=True)
            return None
        if isinstance(body, HelloReq):
            self.held = [h for h in self.held if h.msg.body.consumer != body.consumer]
            queued = self._forgetting(
                body.line,
                lambda: api.restart(
                    self.buf, body.acked_through, body.consumer, body.session, body.resumed
                ),
            )
            return Welcome(queued, self.session, api.buffer_version(self.buf))
        if isinstance(body, AckReq):
            self._forgetting(body.line, lambda: self.buf.ack(body.batch_ids))
            return "ok"
        if isinstance(body, ReportsReq):
            dropped, validated, cursor = api.reports(self.buf, body.session, body.cursor)
            return ReportsRep(dropped, validated, self.session, cursor)
        if isinstance(body, AuditReq):
            return AuditRep(api.unknown(self.buf, body.task_ids), not self.buf.has_room())
        if isinstance(body, InventoryReq):
            held, dropped, validated = self.buf.inventory()
            return InventoryRep(list(held), list(dropped), list(validated), self.session)
        raise TypeError(f"the buffer got {type(body).__name__}")

    def _forgetting(self, line: Line, op: Any) -> Any:
        """Run ``op`` (an ack or a hello) and show the checker every batch it forgot."""
        before = dict(api.unacked(self.buf))
        out = op()
        after = api.unacked(self.buf)
        gone = [b for bid, b in before.items() if bid not in after]
        if gone:  # groups taken back into the pool are not forgotten
            held = api.held_ids(self.buf)
            for batch in gone:
                self.world.checker.forgotten(self.session, batch, line, held)
        return out

    def serve(self, force: bool = False) -> None:
        """Answer held batch requests: a batch when one can be released, else NoBatch once
        the long-poll ends (the service's rule; ``force`` applies the lag filter now)."""
        now, keep = self.world.now, []
        for h in self.held:
            req: BatchReq = h.msg.body
            batch = None
            if force or self.buf.can_release():
                batch = api.release(self.buf, req.version, req.consumer, req.received)
            if batch is not None or h.until <= now:
                self.world.reply(h.msg, BatchRep(batch, self.session))
            else:
                keep.append(h)
        self.held = keep

    def expire(self) -> None:
        self.buf.expire(self.world.now)


@dataclass
class Checkpoint:
    """What a learner checkpoint holds (durable: it outlives every process)."""

    coordinator: dict[str, Any]
    step: int
    version: int
    last_batch_id: int | None
    last_batch_session: str
    line: Line
    family: int  # the id family of the coordinator that saved it


@dataclass
class World:
    """Every part of the simulated run, the clock and the network."""

    cfg: SimConfig
    checker: Checker
    now: float = 0.0
    net: Net = field(default_factory=Net)
    servers: dict[str, Server] = field(default_factory=dict)
    buffer: BufferProc = field(init=False)
    learner: LearnerProc = field(init=False)
    checkpoint: Checkpoint | None = None
    train_rows: list[dict[str, Any]] = field(default_factory=list)
    val_rows: list[dict[str, Any]] = field(default_factory=list)
    events: int = 0  # schedule events played, messages delivered, drain rounds
    dirty: bool = False  # the coordinator's state may have changed since the last check

    def chance(self, *parts: Any) -> float:
        """A uniform number fixed by the seed and ``parts`` (what is being decided)."""
        key = f"{self.cfg.seed}/" + "/".join(map(str, parts))
        return zlib.crc32(key.encode()) / 2**32

    def delay(self, kind: str, *parts: Any) -> float:
        """A virtual duration: a generation (0.1-3 s) or a weight load (0.05-0.5 s)."""
        u = self.chance(kind, *parts)
        return 0.1 + 2.9 * u * u if kind == "gen" else 0.05 + 0.45 * u

    def proc(self, name: str) -> Any:
        if name == "B":
            return self.buffer
        if name == "L":
            return self.learner
        return self.servers.get(name)

    def cut_off(self, name: str) -> bool:
        s = self.servers.get(name)
        return s is not None and s.muted

    def deliver(self, k: int) -> bool:
        """Deliver the ``k``-th deliverable message; False when none is."""
        msg = self.net.take(k, self.now)
        if msg is None:
            return False
        self.events += 1
        if self.cut_off(msg.src) or self.cut_off(msg.dst):
            if isinstance(msg.body, Packed):  # held in the sender's queue until it heals
                self.net.queue.append(msg)
            return True  # a request or reply across a partition: lost
        target = self.proc(msg.dst)
        if msg.reply:
            if target is not None:
                target.receive_reply(msg)
            return True
        if target is None or not target.alive:
            return True  # nobody listens: lost
        out = target.handle(msg)
        if out is DEFER:
            self.net.queue.append(msg)  # not read yet: it waits behind the others
        elif out is not None and msg.rid:
            self.reply(msg, out)
        return True

    def reply(self, req: Msg, body: Any) -> None:
        self.net.send(Msg(0, req.dst, req.src, body, req.rid, req.sock, req.inc, True))

    def tick(self, dt: float) -> None:
        """Time passes: callers whose deadline passed give up."""
        self.now += dt
        for p in (self.learner, *self.servers.values()):
            p.expire(self.now)
