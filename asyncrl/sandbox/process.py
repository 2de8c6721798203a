"""One worker process of a :class:`~asyncrl.sandbox.workers.WorkerPool`: the parent's handle
on it (:class:`Worker`: start, run a job within its time, kill). What runs inside it (setup
once, then one answer per job, dying with its parent) is :mod:`asyncrl.sandbox.child`.

Protocol (parent <-> its own child, plain picklable tuples):

- child -> parent at start: ``("ready", None)`` or ``("startup_error", message)``
- parent -> child: ``(seq, job)`` (anything picklable), or ``None`` to stop
- child -> parent: ``(seq, (status, payload))``, the handler's answer to job ``seq``;
  ``("exception", message)`` if the handler raised (``SystemExit`` included),
  ``("out_of_memory", detail)`` if it ran out of memory under the worker's cap
  (:class:`MemoryCap`). The parent drops an answer whose ``seq`` is not the job's, so no
  job can take another's answer.

Each worker is its own process group, so the pool's kill also ends what the user code
started, and a signal to the caller's group (the launcher's stop) leaves the workers to
the pool's own close. On Linux a worker dies with its parent (``PR_SET_PDEATHSIG``), and
an idle *reaper* in its group (not its child) kills the group when the worker ends, so
nothing the user code left running outlives a killed caller
(:func:`asyncrl.sandbox.child.start_reaper`).
Workers are not daemons: daemonic processes may not have children, and scorers that run
code in a ``multiprocessing.Process`` (veRL's ``prime_code``) need them.

A worker's stdout and stderr (fds 1 and 2) are pipes the parent drains within a per-job
and a per-worker limit (:mod:`asyncrl.sandbox.output`), so user code that prints cannot
fill the caller's log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from asyncrl.sandbox.child import Setup, worker_main
from asyncrl.sandbox.memory import NO_CAP, MemoryCap
from asyncrl.sandbox.output import OutputDrain
from asyncrl.sandbox.proc_table import descendants, scan

logger = logging.getLogger(__name__)

# How long workers may take to exit (all together, at a close) before they are killed.
STOP_GRACE_S = 1.0


# Linux sends PR_SET_PDEATHSIG when the *thread* that started the child ends, not the
# process: a worker started by a short-lived respawn thread would die with that thread.
# So every worker is started by one thread that lives as long as this process.
_spawner_lock = threading.Lock()
_spawner: tuple[int, queue.Queue[tuple[Any, Future[None]]]] | None = None


def _spawn_loop(jobs: queue.Queue[tuple[Any, Future[None]]]) -> None:
    """The spawner thread: consumes processes to start, forever; waits on its queue."""
    while True:
        process, done = jobs.get()
        try:
            process.start()
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)


def _start_process(process: Any) -> None:
    """Start ``process`` from the spawner thread (created once per process); raise what
    ``start`` raised."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # none yet, or we were forked
            jobs: queue.Queue[tuple[Any, Future[None]]] = queue.Queue()
            threading.Thread(
                target=_spawn_loop, args=(jobs,), name="asyncrl-worker-spawner", daemon=True
            ).start()
            _spawner = (os.getpid(), jobs)
        jobs = _spawner[1]
    done: Future[None] = Future()
    jobs.put((process, done))
    done.result()


def _kill_group(process: Any) -> None:
    """SIGKILL the worker's process group: the worker and whatever its user code started,
    its descendants in sessions of their own too (a tool that runs code starts its
    children with ``start_new_session`` to time them out itself), found while the worker
    still links them (killed first, it leaves them to init)."""
    if process.pid is None:
        return
    procs = scan()
    group = {p.pid for p in procs.values() if p.pgid == process.pid}
    if (me := procs.get(process.pid)) is not None and me.ppid == os.getpid():
        group.add(process.pid)  # not in its group yet (setpgrp); never a reaped one's pid
    escaped = descendants(procs, group) - group
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:  # no such group yet (not reached setpgrp) or no longer
        with contextlib.suppress(OSError):
            process.kill()
    for pid in escaped:  # each may have exited meanwhile: no error for it
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class Worker:
    """The parent's handle on one worker process (:attr:`process`) and its pipe."""

    def __init__(
        self,
        ctx: Any,
        setup: Setup,
        setup_args: tuple[Any, ...],
        role: str,
        cap: MemoryCap = NO_CAP,
    ) -> None:
        self.role = role
        self._send_lock = threading.Lock()  # a job and a close's stop never interleave
        self._kill_lock = threading.Lock()  # a close and a caller may kill it at once
        self._killed = False
        self._seq = 0
        self.conn, child_conn = ctx.Pipe(duplex=True)
        out_read, out_write = ctx.Pipe(duplex=False)
        err_read, err_write = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=worker_main,
            args=(child_conn, setup, setup_args, os.getpid(), cap, (out_write, err_write)),
            name=f"asyncrl-{role}-worker",
            daemon=False,  # see the module's docstring; the pool's finalizer stops it
        )
        try:
            _start_process(self.process)
        except BaseException:
            for end in (out_read, out_write, err_read, err_write):
                end.close()
            raise
        # Without closing our copy of the child's end, its death would never read as EOF.
        child_conn.close()
        out_write.close()
        err_write.close()
        self._output = OutputDrain(
            (out_read, err_read), self.process.sentinel, f"{role} worker {self.process.pid}"
        )

    def wait_ready(self, timeout_s: float, slow_start: str = "") -> None:
        """Block until the worker's setup has run; raise ValueError if it cannot
        (``slow_start``: what the message adds when the setup took too long, its fix)."""
        if not self.conn.poll(timeout_s):
            self.kill()
            raise ValueError(f"{self.role} worker did not start within {timeout_s}s{slow_start}")
        try:
            status, message = self.conn.recv()
        except (EOFError, OSError):
            # Its pipe closes a moment before it exits: wait for its own exit code, or our
            # kill would be what is reported (-9).
            self.process.join(STOP_GRACE_S)
            code = self.process.exitcode
            self.kill()
            raise ValueError(f"{self.role} worker exited during start (exit code {code})") from None
        if status != "ready":
            self.kill()
            raise ValueError(message)

    def run(self, job: Any, timeout_s: float) -> tuple[str, Any]:
        """Send one job and wait for its answer; ``("timeout"|"worker_died", detail)`` if none,
        ``("unsent", exit code)`` when the worker had died while idle (the job never ran)."""
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            self._output.next_job()
            try:
                self.conn.send((seq, job))
            except OSError:  # killed while idle (an OOM kill), or by a close
                self.process.join(STOP_GRACE_S)
                return "unsent", self.process.exitcode
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ready = wait([self.conn, self.process.sentinel], deadline - time.monotonic())
            except (OSError, ValueError):  # the pipe was closed under us: a close killed it
                break
            if not ready:
                return "timeout", None
            if self.conn not in ready:
                break
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, tuple) and len(message) == 2 and message[0] == seq:
                return message[1]
            logger.debug("%s worker: dropped an answer that is not job %d's", self.role, seq)
        self.process.join(STOP_GRACE_S)
        return "worker_died", self.process.exitcode

    def kill(self) -> None:
        """SIGKILL the worker's process group and close the pipe; idempotent, thread-safe."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
            _kill_group(self.process)
            self.process.join(STOP_GRACE_S)
            self.conn.close()
            # What it wrote last (a start-up traceback) reaches the log before the caller
            # goes on (a server that stops on a start-up error would lose it).
            self._output.join(STOP_GRACE_S)

    def request_stop(self) -> None:
        """Ask the worker to exit after its current job, without waiting."""
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # gone or closed
            self.conn.send(None)

    def stop(self) -> None:
        """Ask the worker to exit, and kill it (and its group) if it does not promptly."""
        self.request_stop()
        self.process.join(STOP_GRACE_S)
        self.kill()
