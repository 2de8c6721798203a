"""A run's start-up timeline: when each role reached each phase, from launch to first step.

Every role marks its phases (:func:`mark`) by appending one JSON line ``{"role", "event",
"t"}`` (wall-clock seconds) to ``<run dir>/startup.jsonl``; one small ``O_APPEND`` write per
line, so lines from several processes never interleave. ``asyncrl-launch`` starts the file
with a ``launch`` line and prints :func:`startup_table` at the top of the run's summary. A
role restarted later marks its phases again; the table keeps each phase's first time.

The phases, in the order a run reaches them:

- every role: ``started`` (its config parsed, before the heavy imports);
- buffer: ``ready`` (sockets bound);
- rollout server: ``engine_ready`` (vLLM built: imports, engine processes, model load, KV
  cache), ``registered`` (with the coordinator);
- learner: ``model_ready`` (model loaded and sharded, optimizer built), ``coordinator_up``,
  ``first_batch`` (the buffer's first batch received), ``first_step`` (trained on it).

A role set up runs its loop inside :func:`startup_heap_frozen`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

STARTUP_FILE = "startup.jsonl"


def begin(run_dir: Path) -> float:
    """Start a new timeline (the launcher, before any role starts); returns its zero."""
    t0 = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STARTUP_FILE).write_text(
        json.dumps({"role": "launch", "event": "launch", "t": t0}) + "\n"
    )
    return t0


def mark(run_dir: Path, role: str, event: str) -> None:
    """Record that ``role`` reached ``event`` now. Never raises: a timeline is not worth a
    role's life (an unwritable run directory is logged once per call)."""
    line = json.dumps({"role": role, "event": event, "t": time.time()}) + "\n"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / STARTUP_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("start-up timeline not written (%s): %s", run_dir / STARTUP_FILE, e)


def read(run_dir: Path) -> list[dict]:
    """The timeline's events, in file order (unreadable lines skipped)."""
    path = run_dir / STARTUP_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(e, dict) and {"role", "event", "t"} <= e.keys():
            events.append(e)
    return events


def marked_since(run_dir: Path, role: str, event: str, since: float) -> bool:
    """Whether ``role`` marked ``event`` at or after ``since`` (wall-clock seconds)."""
    return any(e["role"] == role and e["event"] == event and e["t"] >= since for e in read(run_dir))


def first_times(events: list[dict]) -> dict[tuple[str, str], float]:
    """``(role, event) -> seconds since launch`` of each phase's first time (since the
    first event when there is no ``launch`` line: roles started by hand)."""
    if not events:
        return {}
    launch = [e["t"] for e in events if e["event"] == "launch"]
    t0 = launch[0] if launch else min(e["t"] for e in events)
    out: dict[tuple[str, str], float] = {}
    for e in events:
        out.setdefault((e["role"], e["event"]), float(e["t"]) - t0)
    return out


def startup_table(events: list[dict]) -> str:
    """One line per role with its phases (seconds since launch), then launch to first
    step; empty when there is no timeline."""
    times = first_times(events)
    roles: dict[str, list[str]] = {}
    for (role, event), t in sorted(times.items(), key=lambda kv: kv[1]):
        if role != "launch":
            roles.setdefault(role, []).append(f"{event.replace('_', ' ')} {t:.1f}")
    if not roles:
        return ""
    width = max(len(r) for r in roles)
    lines = ["start-up, seconds since launch:"]
    lines += [
        f"  {role.ljust(width)}  {', '.join(phases)}" for role, phases in sorted(roles.items())
    ]
    first = times.get(("learner", "first_step"))
    if first is not None:
        lines.append(f"  launch to first learner step: {first:.1f}s")
    return "\n".join(lines)


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """While inside, everything alive on entry (imports, the model, the engine's front end)
    is out of the cyclic garbage collector's scans: a role's loop runs inside, once the role
    is set up.

    Python runs a full collection whenever a quarter as many objects as the last full one
    left have survived since, and each scans every tracked object: torch, transformers and
    vLLM leave a role with hundreds of thousands. In a demo run each rollout server's own
    process paused 0.4-0.5 s for such a collection every 15-20 s (1.3-1.5 s of CPU per
    server over the 37 s of training), and the learner 0.3 s once. With the start-up heap
    frozen those collections took 1-8 ms and the servers' collector time fell to 0.4-0.5 s.
    On ``benchmarks/vs_trl.py``'s long shape (128-token answers, three interleaved pairs)
    step 1 to end went from 53.2, 51.9 and 48.5 s to 47.5, 46.3 and 45.1 s; the demo's
    35-39 s did not move. vLLM's engine core freezes its own heap the same way.

    Frozen objects are still freed when their last reference goes; reference cycles among
    them wait for the exit, which gives them back to the collector (for a loop run inside a
    longer program, such as a test).
    """
    _collector_clock.install()
    gc.collect()
    gc.freeze()
    # Counted once: gc.get_freeze_count() walks the whole frozen list (milliseconds).
    _collector_clock.frozen = gc.get_freeze_count()
    try:
        yield
    finally:
        gc.unfreeze()
        _collector_clock.frozen = 0


class _CollectorClock:
    """Sums the seconds this process spends in the cyclic garbage collector (a
    ``gc.callbacks`` hook: two calls of about a microsecond per collection)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.frozen = 0  # objects frozen on entry to startup_heap_frozen
        self._started: float | None = None

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None


_collector_clock = _CollectorClock()


def collector_metrics(prefix: str) -> dict[str, float]:
    """``<prefix>/gc_s``: seconds this process spent collecting garbage since its loop
    entered :func:`startup_heap_frozen`, the full collection on entry included (0.3 s in
    the demo's learner, 0.6 s in each server; then a few ms a minute);
    ``<prefix>/gc_frozen_objects``: the objects it froze on entry (0: the loop does not run
    inside it, and every collection scans the whole start-up heap again). Cheap enough for
    every heartbeat."""
    return {
        f"{prefix}/gc_s": _collector_clock.seconds,
        f"{prefix}/gc_frozen_objects": float(_collector_clock.frozen),
    }
