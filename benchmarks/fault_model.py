"""A deterministic fault simulation of the control plane: seeded schedules, runs, shrinking.

A *schedule* is a list of events, drawn from ``random.Random(seed)`` and nothing else:
deliveries (the oldest message, or any one: reordering), time passing, what a rollout
server does next (register, heartbeat, ask for tasks, open an external slot, finish a
generation, load a sync), a move of the learner loop, the buffer's serving and expiry, the
coordinator's poll and reaping; and faults: message loss, duplication (of what the real
clients may send twice), delay past the requester's timeout, kills and restarts of the
learner (from its checkpoint, or fresh when it has none), of the buffer (a new session) and
of servers (a crash loses what they held; a partition keeps it until they register again).

:func:`run` plays a schedule on a fresh :class:`~benchmarks.fault_world.World` (the real
decision classes behind simulated processes, :mod:`benchmarks.fault_learner`,
:mod:`benchmarks.fault_server`), checks the invariants of :mod:`benchmarks.fault_checks`
after every event, then stops the faults, drains the run to its last step (a fair
round-robin of everything, bounded) and lets it go quiet before the final checks.
:func:`shrink` removes events from a failing schedule while it still fails the same way, so
a failure replays from a handful of events.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.wire import Packed
from benchmarks import fault_api as api
from benchmarks.fault_checks import Checker, Violation
from benchmarks.fault_learner import LearnerProc
from benchmarks.fault_server import Server
from benchmarks.fault_world import BufferProc, SimConfig, World, config_for

log = logging.getLogger(__name__)

Event = tuple[Any, ...]
SERVER_OPS = ("register", "beat", "ask", "slot", "finish", "sync")
DRAIN_ROUNDS = 600  # liveness bound: rounds of 0.2 virtual seconds once faults stop
# Then 45 s without new work (past control.task_timeout_s), in rounds of 0.2 s: in rounds
# as long as a control timeout, no reply would come before its request gave up, and what
# the servers mend by asking again (a slot whose reply was lost) could not be mended.
QUIET_ROUNDS = 225
DUPABLE = ("TaskAck", "TaskNack", "SyncDone", "SlotRequest", "TaskRequest", "AckReq", "Packed")

# (weight, event maker) of the schedule's draws; faults are the rarer ones.
_PROGRESS: list[tuple[float, Any]] = [
    (45, lambda r: ("r", r.choice((100, 200, 300, 500)))),
    (30, lambda r: ("d", 0)),
    (8, lambda r: ("d", r.randrange(8))),
    (15, lambda r: ("t", r.choice((50, 100, 200, 400)))),
    (3, lambda r: ("t", r.choice((1000, 2000, 3500)))),
    (28, lambda r: ("s", r.randrange(3), r.choice(SERVER_OPS))),
    (8, lambda r: ("l",)),
    (2, lambda r: ("b", "serve")),
    (1, lambda r: ("b", "expire")),
    (3, lambda r: ("c", "poll")),
    (1, lambda r: ("c", "reap")),
]
_FAULTS: list[tuple[float, Any]] = [
    (3, lambda r: ("lose", r.randrange(8))),
    (2, lambda r: ("dup", r.randrange(8))),
    (3, lambda r: ("delay", r.randrange(8), r.choice((1500, 2500, 4000)))),
    (1, lambda r: ("kill_l",)),
    (1.5, lambda r: ("start_l",)),
    (0.6, lambda r: ("kill_b",)),
    (0.6, lambda r: ("crash_s", r.randrange(3))),
    (1, lambda r: ("start_s", r.randrange(3))),
    (0.6, lambda r: ("mute", r.randrange(3))),
    (1, lambda r: ("unmute", r.randrange(3))),
]
_FAULT_SHARE = 0.05


def schedule_for(seed: int) -> list[Event]:
    """The schedule of ``seed``: 100 to 400 events, about 5% of them faults."""
    r = random.Random(seed)
    pools = [_PROGRESS, _FAULTS]
    out: list[Event] = []
    for _ in range(r.randint(100, 400)):
        pool = pools[r.random() < _FAULT_SHARE]
        make = r.choices([f for _, f in pool], weights=[w for w, _ in pool])[0]
        out.append(make(r))
    return out


@dataclass
class Outcome:
    """What one schedule did: its events, virtual time and violations."""

    seed: int
    events: int
    virtual_s: float
    violations: list[Violation] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0  # prompts the last coordinator passed over (its restored count included)

    @property
    def failed(self) -> bool:
        return bool(self.violations)

    def invariants(self) -> set[str]:
        return {v.invariant for v in self.violations}


def build(cfg: SimConfig) -> World:
    """A fresh run: a buffer, the servers (not yet registered) and a fresh learner."""
    world = World(cfg, Checker(cfg.max_policy_lag))
    world.train_rows = api.rows(cfg.train_rows, "train")
    world.val_rows = api.rows(cfg.val_rows, "test")
    world.buffer = BufferProc(world)
    world.learner = LearnerProc(world)
    for i, engine in enumerate(cfg.engines):
        name = f"s{i}"
        world.servers[name] = Server(name, world, engine)
    world.learner.start()
    return world


def apply(world: World, ev: Event) -> None:
    """Play one schedule event (a no-op when it does not apply now)."""
    kind, args = ev[0], ev[1:]
    servers = list(world.servers.values())
    server = servers[args[0] % len(servers)] if kind in _SERVER_EVENTS else None
    if kind == "r":
        _round(world, args[0] / 1000)
    elif kind == "d":
        world.deliver(args[0])
    elif kind == "t":
        world.tick(args[0] / 1000)
    elif kind == "s":
        assert server is not None
        server.act(args[1])
    elif kind == "l":
        world.learner.advance()
    elif kind == "b":
        (world.buffer.serve if args[0] == "serve" else world.buffer.expire)()
    elif kind == "c":
        (world.learner.poll if args[0] == "poll" else world.learner.reap)()
    else:
        _fault(world, kind, args, server)


_SERVER_EVENTS = ("s", "crash_s", "start_s", "mute", "unmute")


def _fault(world: World, kind: str, args: tuple[Any, ...], server: Server | None) -> None:
    net = world.net
    if kind == "lose":  # a group pushed is never lost while both ends live (PUSH/PULL)
        net.lose(args[0], lambda m: not isinstance(m.body, Packed))
    elif kind == "dup":
        net.duplicate(args[0], lambda m: type(m.body).__name__ in DUPABLE and not m.reply)
    elif kind == "delay":
        net.delay(args[0], world.now + args[1] / 1000)
    elif kind == "kill_l" and world.learner.alive:
        world.learner.kill()
    elif kind == "start_l" and not world.learner.alive:
        world.learner.start()
    elif kind == "kill_b":
        world.buffer.restart()
    elif server is not None:
        if kind == "crash_s" and server.alive:
            server.crash()
        elif kind == "start_s" and not server.alive:
            server.restart()
        elif kind in ("mute", "unmute"):
            server.muted = kind == "mute"


def _round(world: World, dt: float) -> None:
    """One fair pass over everything (the drain's unit): deliveries, every server, the
    buffer, the coordinator, the learner, then ``dt`` seconds."""
    for _ in range(400):
        if not world.deliver(0):
            break
    for s in world.servers.values():
        for op in ("beat", "sync", "finish", "finish", "ask", "slot"):
            s.act(op)
    world.buffer.serve()
    world.buffer.expire()
    world.learner.poll()
    world.learner.reap()
    for _ in range(3):
        world.learner.advance()
    world.tick(dt)


def _heal(world: World) -> None:
    """Faults stop: every process runs again, partitions close."""
    if not world.learner.alive:
        world.learner.start()
    for s in world.servers.values():
        s.muted = False
        if not s.alive:
            s.restart()


def run(seed: int, keep: Sequence[int] | None = None, cfg: SimConfig | None = None) -> Outcome:
    """Play schedule ``seed`` (only the events at positions ``keep`` when given), drain,
    and check; deterministic."""
    cfg = cfg or config_for(seed)
    events = schedule_for(seed)
    chosen = range(len(events)) if keep is None else keep
    world = build(cfg)
    checker = world.checker
    for i in chosen:
        checker.event = i
        apply(world, events[i])
        world.events += 1
        checker.after_event(world)
    checker.event = -1
    _heal(world)
    finished = False
    for _ in range(DRAIN_ROUNDS):
        _round(world, 0.2)
        world.events += 1
        checker.after_event(world)
        if world.learner.phase == "done":
            finished = True
            break
    for s in world.servers.values():
        s.asking = False
    for _ in range(QUIET_ROUNDS):
        _round(world, 0.2)
        world.events += 1
        checker.after_event(world)
    checker.final(world, finished)
    out = Outcome(seed, world.events, world.now, checker.violations, world.learner.step)
    st = world.learner.state
    if st is not None and getattr(st.group_filter, "skip", None) is not None:
        out.skipped = st.group_filter.skip.skipped
    return out


def shrink(seed: int, invariant: str, budget: int = 400) -> list[int]:
    """A smaller set of event positions of schedule ``seed`` that still violates
    ``invariant`` (greedy: drop chunks, halving their size, then single events)."""
    keep = list(range(len(schedule_for(seed))))
    runs = 0
    chunk = max(1, len(keep) // 2)
    while chunk >= 1 and runs < budget:
        i, changed = 0, False
        while i < len(keep) and runs < budget:
            trial = keep[:i] + keep[i + chunk :]
            runs += 1
            if invariant in run(seed, trial).invariants():
                keep, changed = trial, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return keep
