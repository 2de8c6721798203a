"""The launcher's restart rules (docs/DESIGN.md section 10, one set for every launcher): when a
role that ended is started again, when it fails the run, and how its exit reads.

- A role that dies (any exit code but 0) is restarted after ``launch.restart_backoff_s``,
  doubled for each of its restarts in a row; the learner gets ``trainer.resume_mode=auto``
  so it continues from its last checkpoint. Restarts are in a row while none of them ran
  ``launch.restart_window_s`` before dying again: a role that dies once more after
  ``launch.max_restarts`` such restarts fails the run, with its last log lines, and the
  launcher exits with its code (128 + N for signal N). A role that runs the window through
  has its count start over.
- A role that exits 2 (a bad config or a missing file, found before it started working)
  fails the run at once: a restart would fail the same way; so does a learner that exits 5
  (stopped by its health alarms, ``trainer.health.action: stop``).
- A rollout server that exits 0 on its own left for good (scaled down with SIGTERM) and is
  not restarted; the learner exiting 0 means the run is done. Any other role (the buffer,
  learner-k) exiting 0 is let go only if the learner finishes soon after (it stops the
  buffer as it ends); else it was stopped from outside and is restarted as after a crash.

:class:`asyncrl.launch.supervise.Supervisor` applies them.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_ERROR = 2  # what a role exits with for a bad config or a missing file (never restarted)
HEALTH_STOP = 5  # the learner stopped by its health alarms (trainer.health.action=stop)
#: Exits that fail the run at once (a restart would end the same way), and why.
FINAL_EXITS = {
    CONFIG_ERROR: "a bad config, a missing file, or a conflict its log names (a port taken, "
    "another learner on this run): a restart would fail the same way",
    HEALTH_STOP: "stopped by its health alarms (trainer.health.action=stop), with a "
    "checkpoint: see its log for the alarm and the fix",
}


#: Where the learner writes its final exit code: under ``torchrun`` (``trainer.nproc > 1``,
#: or several learner nodes) the launcher sees torchrun's code, 1 for any failed rank.
FINAL_EXIT_FILE = "learner_final_exit"


def mark_final_exit(run_dir: str | Path, code: int) -> None:
    """Record a learner's final exit (one of :data:`FINAL_EXITS`) for the launcher."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / FINAL_EXIT_FILE).write_text(f"{code}\n")


def take_final_exit(run_dir: str | Path) -> int | None:
    """The final exit the learner recorded (then forgotten), or None."""
    path = Path(run_dir) / FINAL_EXIT_FILE
    try:
        code = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return code if code in FINAL_EXITS else None


def clear_final_exit(run_dir: str | Path) -> None:
    """Forget a recorded final exit (a learner starts: an earlier one's is not its own)."""
    (Path(run_dir) / FINAL_EXIT_FILE).unlink(missing_ok=True)


@dataclass(frozen=True)
class RestartPolicy:
    """``launch.max_restarts`` restarts in a row per role (none ran ``launch.restart_window_s``
    before it died again), the first after ``launch.restart_backoff_s``, doubling per
    restart in the row."""

    max_restarts: int = 3
    window_s: float = 600.0
    backoff_s: float = 2.0

    @classmethod
    def from_config(cls, launch: Any) -> RestartPolicy:
        return cls(launch.max_restarts, launch.restart_window_s, launch.restart_backoff_s)


def recent_restarts(policy: RestartPolicy, restarts: Sequence[float], now: float) -> int:
    """How many of a role's restarts (the times its restarted processes started) came in a
    row before its death at ``now``: the latest ones, none of which ran ``window_s``. Counted
    in a window of time instead, a role that lived 200 s before each crash (a model that
    loads for minutes, then fails the same way) was restarted for ever."""
    row, died = 0, now
    for started in reversed(restarts):
        if died - started >= policy.window_s:  # it ran the window through: a new row
            break
        row, died = row + 1, started
    return row


def restart_delay(policy: RestartPolicy, restarts: Sequence[float], now: float) -> float | None:
    """Seconds to wait before restarting a role that died at ``now``, given the start times
    of its earlier restarts; None when it has used up its restarts in a row. The wait is at
    most half the window, so the waits alone never make a row look like a new one."""
    recent = recent_restarts(policy, restarts, now)
    if recent >= policy.max_restarts:
        return None
    return min(policy.backoff_s * 2**recent, policy.window_s / 2)


def exit_status(returncode: int) -> int:
    """A role's exit code as a shell reports it: 128 + N for a role killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
