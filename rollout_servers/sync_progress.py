"""How far each vLLM worker has got in a weight receive: what tells a slow push from a
worker stuck in it.

Every wait in a worker's receive is bounded by ``sync.timeout_s``, one per bucket, so a
bound on the whole call grows with the model: a 7B bf16 model in 32 MB buckets (142 of
them) at 120 s a wait had 4.9 hours, long after the learner had dropped the server, which
stayed paused meanwhile. Instead each worker records the buckets it has received in a
file of its own, in a folder the engine made and told it at start (the workers are
processes of this host, or threads of this process: a file reaches both); the engine
reads them every few seconds and counts a worker stuck once no worker's record has moved
for :data:`STALL_WAITS` waits (one wait, plus loading the bucket before). Where no
worker ever records (a worker on another host), the bound on the whole call stays as the
safety net. The folder carries its server's pid; a server killed with SIGKILL cannot remove
its own, so the next server to start on the host removes those of dead pids.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

#: Waits of ``sync.timeout_s`` without a new bucket after which a worker counts as stuck:
#: one for the bucket's broadcast, one for loading the bucket before.
STALL_WAITS = 2
#: The longest time between two looks at the workers' progress.
POLL_S = 2.0
#: The folders' name: the prefix, then the pid of the server that made it.
PREFIX = "asyncrl-wsync-progress-"

T = TypeVar("T")


class WorkerStuck(Exception):
    """A worker's call neither ended nor moved within its bounds (the message says which)."""


class WorkerProgress:
    """Worker side: records the buckets this worker has received, as a file named after
    its rank in the engine's folder. Never raises: a lost record only leaves the engine
    to its safety net."""

    def __init__(self, folder: str, rank: int) -> None:
        self.path = Path(folder) / str(rank)

    def __call__(self, buckets: int) -> None:
        # Written aside and renamed, so the engine never reads a half-written number.
        part = self.path.with_name(f".{self.path.name}.part")
        try:
            part.write_text(str(buckets))
            os.replace(part, self.path)
        except OSError as e:
            log.debug("recording weight receive progress in %s: %s", self.path, e)


class ProgressWatch:
    """Engine side: the folder its workers record their progress in, and the reading of it."""

    def __init__(self) -> None:
        remove_orphans()
        self.folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")

    def reset(self) -> None:
        """Forget the receive before: every worker records 0 as its next one starts. The
        folder is made again if it went (a cleaner of temporary files)."""
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        for path in folder.iterdir():
            path.unlink(missing_ok=True)

    def counts(self) -> dict[str, int]:
        """Buckets recorded so far by each worker (by rank); {} while none has, or when
        the folder cannot be read (the bound on the whole call then stands)."""
        counts: dict[str, int] = {}
        try:
            paths = [p for p in Path(self.folder).iterdir() if not p.name.startswith(".")]
        except OSError:
            return counts
        for path in paths:
            try:
                counts[path.name] = int(path.read_text())
            except (OSError, ValueError):  # removed or rewritten meanwhile
                continue
        return counts

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def remove_orphans(parent: str | None = None) -> list[str]:
    """Remove the progress folders left by servers that died without closing theirs (a
    SIGKILL); the names of those removed. A folder whose pid is alive is kept, whoever
    runs it now (a reused pid leaves a few bytes until that process exits)."""
    removed = []
    try:
        found = list(Path(parent or tempfile.gettempdir()).glob(f"{PREFIX}*-*"))
    except OSError as e:  # best effort: a server starts whatever is left here
        log.debug("looking for progress folders of dead servers: %s", e)
        return removed
    for path in found:
        pid = _PID.match(path.name[len(PREFIX) :])
        if pid is None or _alive(int(pid.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():  # another user's folder may not be ours to remove
            removed.append(path.name)
    if removed:
        log.info("removed %d weight receive progress folders of dead servers", len(removed))
    return removed


#: A folder's pid: ASCII digits, no more than a pid has (``str.isdigit`` took "²" too).
_PID = re.compile(r"([0-9]{1,10})-")


def _alive(pid: int) -> bool:
    """Whether ``pid`` may be a live process (unknown counts as alive: kept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or no such pid number
        return True
    return True


async def unless_stuck(
    call: Awaitable[T], timeout_s: float, bound_s: float, progress: ProgressWatch | None = None
) -> T:
    """Await the workers' ``call`` (each of its waits bounded by ``timeout_s``); raise
    :class:`WorkerStuck` (and cancel it) once a worker is stuck in it: with ``progress``
    recorded, when no worker's record has moved for :data:`STALL_WAITS` waits (those not
    stuck then wait for the stuck one, or have ended), however long the push as a whole;
    before any is recorded, past ``bound_s``.
    An error of the call itself (a worker's own timeout) is raised as it is."""
    task = asyncio.ensure_future(call)  # scheduled, so awaited (cancelled) whatever comes
    if progress is not None:
        try:
            progress.reset()
        except OSError as e:  # no records this time: the bound on the whole call stands
            log.warning("weight receive progress not readable (%s): %s", progress.folder, e)
            progress = None
    start = moved = time.monotonic()
    seen: dict[str, int] = {}
    stall_s = STALL_WAITS * timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=min(POLL_S, timeout_s / 2))
            if done:
                return task.result()
            now = time.monotonic()
            counts = progress.counts() if progress is not None else {}
            # Any worker's record changing is movement: the slowest's count may also drop
            # (a worker's first record landing after another's higher one).
            if counts and counts != seen:
                seen, moved = counts, now
            if seen and now - moved > stall_s:
                raise WorkerStuck(
                    f"received no bucket for {now - moved:.1f}s (the slowest worker after "
                    f"{min(seen.values())} buckets; sync.timeout_s {timeout_s:g}s per wait)"
                )
            if not seen and now - start > bound_s:
                raise WorkerStuck(f"did not end within {bound_s:.0f}s (sync.timeout_s per wait)")
    finally:
        task.cancel()  # a no-op once it ended
