"""One supervised role and what a supervisor shows while it runs: :class:`Role` (its command,
its process and its supervision state), :class:`View` (the live view the supervisor updates
each poll) and :func:`tail` (the last lines of a role's log, quoted when it dies).
:mod:`asyncrl.launch.supervise` acts on them.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass
class Role:
    """One process of the run (with its tree) and its supervision state."""

    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cpus: list[int] | None = None
    restart_args: list[str] = field(default_factory=list)  # appended when restarted
    unset: tuple[str, ...] = ()  # prefixes of variables it must not inherit
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    attempt: int = 0  # how many times it was started
    started_wall: float = 0.0  # wall-clock time of its latest start (as start-up marks)
    restarts: list[float] = field(default_factory=list)  # monotonic times of its restarts
    waits: int = 0  # restarts after giving up on a learner still loading (not counted)
    restart_at: float | None = None  # a restart is due at this monotonic time
    done: bool = False  # exited 0: not restarted
    stopped: bool = False  # the launcher signalled this attempt to stop (its exit says so)
    # Exited 0 at this monotonic time, though only the learner's end lets it go (the
    # buffer, learner-k): restarted as after a crash unless the learner finishes soon.
    left_at: float | None = None
    known: dict[int, int] = field(default_factory=dict)  # descendants seen: pid -> start
    # The coordinator's id for it (a rollout server): told the coordinator when it dies.
    server_id: str | None = None
    last_pid: int = 0  # the pid of its process that exited last
    nice: int = 0  # its CPU priority (launch.nice)

    def command(self) -> list[str]:
        return self.cmd + (self.restart_args if self.attempt > 0 else [])


class View(Protocol):
    def update(self) -> None: ...
    def finish(self, ok: bool) -> None: ...


class QuietView:
    """A view that shows nothing (tests, or a launcher without a terminal)."""

    def update(self) -> None:
        pass

    def finish(self, ok: bool) -> None:
        pass


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
