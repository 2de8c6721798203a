"""What a worker process may write to its caller's stdout and stderr: a bounded amount.

A worker used to inherit the caller's file descriptors 1 and 2, and the launcher writes a
role's output to its log file, so a tool (or a scorer) that printed 50 MiB put 50 MiB in
the rollout server's log, and a policy that makes a code-execution tool print could fill
the disk. Now each worker's fds 1 and 2 are pipes (:func:`redirect_output`, in the worker)
drained by one thread of the caller (:class:`OutputDrain`), which passes on at most
:data:`JOB_OUTPUT_BYTES` per job and :data:`WORKER_OUTPUT_BYTES` over the worker's life,
drops the rest, and logs one line saying how much it dropped and which limit did it.

Being at the fd level, the bound holds for ``print``, ``os.write(1, ...)``, C extensions
and subprocesses alike (they inherit fds 1 and 2). It does not hold for code that opens the
log file, a terminal or ``/proc/<pid>/fd/1`` by path: this bounds mistakes and a policy's
prints, it is not a wall against code written to get round it. The draining runs in the
caller, so a worker stuck in C while holding its GIL cannot stall it; bytes still in the
pipe when a job ends may count to the next job, which shifts a job's share, not the bound.
A replaced worker (after a timeout, a crash, out of memory) starts with a fresh budget.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import threading
from typing import Any

logger = logging.getLogger(__name__)

#: Bytes of stdout and stderr together that one job (or a worker's start-up) passes on.
JOB_OUTPUT_BYTES = 64 << 10
#: Bytes a worker passes on over its whole life; past it, the rest of its output is dropped.
WORKER_OUTPUT_BYTES = 16 << 20
_JOB_KEY = "asyncrl.sandbox.output.JOB_OUTPUT_BYTES"
_WORKER_KEY = "asyncrl.sandbox.output.WORKER_OUTPUT_BYTES"
_CHUNK = 1 << 16
_LAST_READS = 16
_QUIET_MS = 1000  # a job's drop is reported once its output has paused this long


def redirect_output(stdout: Any, stderr: Any) -> None:
    """In the worker: point fds 1 and 2 at the write ends of the caller's pipes
    (``multiprocessing`` connections, passed to the worker) and close the originals.

    ``sys.stdout`` and ``sys.stderr`` keep writing to fds 1 and 2, so they follow."""
    for stream in (sys.stdout, sys.stderr):  # what was written before goes where it was
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os.dup2(stdout.fileno(), 1)
    os.dup2(stderr.fileno(), 2)
    stdout.close()
    stderr.close()


def flush_std_streams() -> None:
    """In the worker, after each job: what the job printed reaches the pipe before its
    answer, so it counts to that job (block-buffered prints would count to a later one)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # user code may have replaced or closed them
            if stream is not None:
                stream.flush()


class OutputDrain:
    """The caller's end of one worker's stdout and stderr pipes: a daemon thread copies
    what arrives to the caller's own fds 1 and 2 within the limits, and ends once the
    worker has exited (:meth:`join`).

    Consumes bytes from both pipes; produces the same bytes on fds 1 and 2 up to the
    limits, and a log line per job that went past its limit (once its output pauses, at
    the next job or at the worker's end) and one when the worker's life limit is reached.
    Waits on the pipes and the worker's sentinel; unblocked by output or the worker's exit.
    """

    def __init__(
        self,
        reads: tuple[Any, Any],
        sentinel: int,
        label: str,
        job_bytes: int = JOB_OUTPUT_BYTES,
        worker_bytes: int = WORKER_OUTPUT_BYTES,
    ) -> None:
        self._fds = {reads[0].fileno(): 1, reads[1].fileno(): 2}  # pipe -> where it goes
        self._conns = reads  # kept open until the thread ends
        self._sentinel = sentinel
        self._label = label
        self._job_bytes, self._worker_bytes = job_bytes, worker_bytes
        self._lock = threading.Lock()
        self._job = 0  # bumped by next_job(); the thread's own count follows it
        self._seen_job = 0
        self._job_used = 0
        self._used = 0  # over the worker's life, log lines included
        self._dropped = 0  # this job's, not yet reported
        self._exhausted = False
        self._cut_line = {1: False, 2: False}
        self._thread = threading.Thread(target=self._loop, name=f"{label}-output", daemon=True)
        self._thread.start()

    def next_job(self) -> None:
        """A new job starts: it gets a fresh per-job budget (the worker's is not renewed)."""
        with self._lock:
            self._job += 1

    def join(self, timeout_s: float) -> None:
        """Wait for the thread to pass on what the dead worker left in its pipes."""
        self._thread.join(timeout_s)

    # ----------------------------------------------------------------- the thread

    def _loop(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        poller.register(self._sentinel, select.POLLIN)
        open_fds = set(self._fds)
        try:
            while open_fds:
                events = poller.poll(_QUIET_MS if self._dropped else None)
                if not events:
                    self._report_drop()
                    continue
                ready = {fd for fd, _ in events}
                if self._sentinel in ready:
                    break  # the worker is gone: empty its pipes below, then stop
                for fd in ready & open_fds:
                    data = _read(fd)
                    if data:
                        self._pass(fd, data)
                    else:  # end of file: the worker and all it started closed it
                        poller.unregister(fd)
                        open_fds.discard(fd)
            # What the worker wrote just before it died is still in the pipes; what a
            # process it left behind (one that escaped its group) writes later is not
            # waited for: a pipe holds at most _LAST_READS chunks (1 MiB on Linux at most).
            for fd in open_fds:
                os.set_blocking(fd, False)
                for _ in range(_LAST_READS):
                    data = _read(fd)
                    if not data:
                        break
                    self._pass(fd, data)
            self._report_drop()
        except Exception:  # never let a drain error pass silently, nor end the caller
            logger.exception("%s: passing on its output failed; the rest is dropped", self._label)
        finally:
            for conn in self._conns:
                conn.close()

    def _pass(self, fd: int, data: bytes) -> None:
        """Pass on what the limits leave of ``data``, count the rest as dropped."""
        with self._lock:
            job = self._job
        if job != self._seen_job:
            self._report_drop()
            self._seen_job, self._job_used = job, 0
        if self._exhausted:
            return
        room = min(self._job_bytes - self._job_used, self._worker_bytes - self._used)
        kept = data[: max(0, room)]
        self._job_used += len(kept)
        self._used += len(kept)
        out = self._fds[fd]
        if kept:
            _write(out, kept)
            self._cut_line[out] = not kept.endswith(b"\n")
        if len(kept) < len(data):
            self._dropped += len(data) - len(kept)
            if self._used >= self._worker_bytes:
                self._report_exhausted()

    def _end_lines(self) -> None:
        """End a line a cut left open, so the note does not run into the tool's text."""
        for out, cut in self._cut_line.items():
            if cut:
                _write(out, b"\n")
                self._cut_line[out] = False

    def _report_drop(self) -> None:
        """Log the drop of the job in progress, if any, while the worker has budget left."""
        if not self._dropped or self._exhausted:
            return
        message = (
            f"{self._label}: dropped {self._dropped} bytes of a job's stdout/stderr past "
            f"{self._job_bytes} bytes a job ({_JOB_KEY})"
        )
        self._dropped = 0
        self._used += len(message)  # the notes count too, so the bound holds
        self._end_lines()
        logger.warning("%s", message)
        if self._used >= self._worker_bytes:
            self._report_exhausted()

    def _report_exhausted(self) -> None:
        """Log, once, that the worker's life budget is spent; drop all it writes after."""
        if self._exhausted:
            return
        self._exhausted = True
        self._end_lines()
        logger.warning(
            "%s: its stdout/stderr reached %d bytes (%s): the rest of its output is dropped",
            self._label,
            self._worker_bytes,
            _WORKER_KEY,
        )


def _read(fd: int) -> bytes:
    """Up to one chunk from ``fd``; b"" at end of file or when a non-blocking read finds
    nothing."""
    try:
        return os.read(fd, _CHUNK)
    except BlockingIOError:
        return b""
    except OSError:  # closed under us
        return b""


def _write(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``; a closed stdout loses it, as it would the caller's."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue
        except OSError:
            return
