"""Killable worker processes with a per-job timeout, so untrusted code never stalls its caller.

Threads are not enough: code stuck in C (``pow(10, 10**8)``, a catastrophic regex) holds
the GIL and cannot be interrupted. Each :class:`WorkerPool` worker is a ``spawn``-ed
process (safe while the caller runs threads or an event loop) that runs a *setup*
function once, then answers jobs sent over its own pipe with the handler that setup
returned. A job that overruns ``timeout_s`` gets its worker killed and replaced in the
background; the caller gets ``("timeout", None)`` at once. With a
:class:`~asyncrl.sandbox.memory.MemoryCap`, a job that runs out of memory under it gets
``("out_of_memory", detail)`` and its worker is replaced the same way.

The reward pool (scorers) and the tool pool (agent tools) are both thin layers on this one.

The worker processes themselves (their main loop, the protocol on their pipe, how they
die with their parent) are :mod:`asyncrl.sandbox.process`.

Code that creates a pool from a script needs the usual ``if __name__ == "__main__":`` guard,
because ``spawn`` imports the main module in each worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.util
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asyncrl.sandbox.child import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS
from asyncrl.sandbox.child import Handler as Handler  # the pools built on this one
from asyncrl.sandbox.child import Setup
from asyncrl.sandbox.memory import NO_CAP, MemoryCap
from asyncrl.sandbox.process import STOP_GRACE_S, Worker

logger = logging.getLogger(__name__)

T = TypeVar("T")


#: Statuses the pool itself produces, whatever the handler: the job overran its time,
#: the worker process died under it, the handler raised, or it ran out of memory under the
#: pool's ``memory_cap`` (only a pool with one).
POOL_STATUSES = ("timeout", "worker_died", "exception", "out_of_memory")

MAX_LOGGED = 20  # different failures of a kind logged in full; every one is counted
# How long a close waits for a replacement worker still starting: a stopping server must
# end within the launcher's grace (15 s); one that starts later is killed by its thread.
CLOSE_WAIT_S = 3.0


class PoolBroken(RuntimeError):
    """A pool that lost a worker it could not replace: every call fails from then on, so
    its owner should stop and be restarted rather than fail each job (the message names
    the start-up error)."""


def check_pool_args(num_workers: int, timeout_s: float, max_memory_mb: int = 0) -> None:
    """Raise ValueError for a pool size, timeout or memory cap that could never serve a job."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_memory_mb < 0:
        raise ValueError(f"max_memory_mb must be >= 0 (0: no cap), got {max_memory_mb}")


def _stop_all(workers: set[Worker], lock: threading.Lock, stopped: threading.Event) -> None:
    """Stop every worker within one shared grace, so a close takes about
    :data:`STOP_GRACE_S` however many are busy: ask all, wait on one deadline, kill the
    rest. Shared by close() and the finalizer (at exit, before multiprocessing joins its
    non-daemon children); after it, no new worker may join ``workers``."""
    with lock:
        stopped.set()
        stopping = list(workers)
        workers.clear()
    for worker in stopping:
        worker.request_stop()
    deadline = time.monotonic() + STOP_GRACE_S
    for worker in stopping:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in stopping:
        worker.kill()


# --------------------------------------------------------------------------------- pool


class WorkerPool:
    """A fixed number of killable worker processes serving jobs with a timeout; thread-safe.

    :meth:`run` waits for an idle worker, sends it the job and waits at most ``timeout_s``
    for the answer. A worker that times out or dies is killed and replaced in the
    background, so the pool keeps its size; a successor that fails to start breaks the
    pool (every later call raises :class:`PoolBroken`). :meth:`record` counts a failure by
    kind and logs it once with its fix, so the layers on top report failures the same way.
    """

    def __init__(
        self,
        setup: Setup,
        setup_args: tuple[Any, ...] = (),
        *,
        name: str,
        role: str,
        explanations: Mapping[str, str],
        num_workers: int = 2,
        timeout_s: float = 5.0,
        startup_timeout_s: float = 60.0,
        slow_start: str = "",
        memory_cap: MemoryCap = NO_CAP,
        log: logging.Logger = logger,
    ) -> None:
        """Start the workers and wait until each has run ``setup``.

        Args:
            setup: A module-level function (picklable by reference), called once in each
                worker with ``setup_args``; returns the worker's :data:`Handler`.
            setup_args: Picklable arguments for ``setup``.
            name: The owning class's name, used in errors and logs (``"RewardPool"``).
            role: A short word for process and thread names (``"reward"``).
            explanations: Failure kinds counted by :meth:`record`, in order, each with a
                message template (``{timeout}`` and ``{detail}`` are filled in).
            num_workers: Worker processes (jobs run at once).
            timeout_s: Longest a single job may take.
            startup_timeout_s: Longest a worker may take to start and run ``setup``.
            slow_start: Added to the error of a worker that took longer (at the pool's
                start or a replacement's): the key to raise and the fix, in the owner's words.
            memory_cap: The memory each worker may take (its ``mb``, 0: no cap) and the key
                that sets it. A job that runs out of memory under it answers
                ``("out_of_memory", detail)``, so ``explanations`` must then explain that kind.
            log: Where failures are reported: the owner's logger, so its users can filter.

        Raises:
            ValueError: Bad arguments, or ``setup`` failed in a worker (its message).
        """
        check_pool_args(num_workers, timeout_s, memory_cap.mb)
        if memory_cap.mb and "out_of_memory" not in explanations:
            raise ValueError("a pool with a memory cap needs an 'out_of_memory' explanation")
        self.name = name
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._setup = setup
        self._setup_args = setup_args
        self._role = role
        self._log = log
        self._explanations = dict(explanations)
        self._startup_timeout_s, self._slow_start = startup_timeout_s, slow_start
        self._memory_cap = memory_cap
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._counters: dict[str, int] = dict.fromkeys(self._explanations, 0)
        self._logged: set[tuple[str, str]] = set()  # (kind, first word of its detail)
        self._closed = False
        self._broken: str | None = None
        self._respawns: list[threading.Thread] = []
        # None in this queue means "the pool cannot serve": closed, or a respawn failed.
        self._idle: queue.Queue[Worker | None] = queue.Queue()
        self._workers: set[Worker] = set()
        self._stopped = threading.Event()  # set by _stop_all: start no more workers
        # multiprocessing's own finalizer (not weakref's): at exit it runs before
        # multiprocessing joins non-daemon children, which would wait on idle workers.
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_all, (self._workers, self._lock, self._stopped), exitpriority=10
        )
        # Start all workers before waiting on any, so their start-up overlaps.
        started = [self._start_worker() for _ in range(num_workers)]
        try:
            for worker in started:
                worker.wait_ready(startup_timeout_s, slow_start)
        except BaseException:
            self._finalizer()
            raise
        for worker in started:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix=f"{role}-pool")

    # ---------------------------------------------------------------- public API

    @property
    def workers(self) -> list[Worker]:
        """The live workers right now (busy or idle); for inspection, not for jobs."""
        with self._lock:
            return list(self._workers)

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of failures so far, by kind (the keys of ``explanations``)."""
        with self._lock:
            return dict(self._counters)

    def run(self, job: Any) -> tuple[str, Any]:
        """Run one job on an idle worker; returns within ``timeout_s`` once one is free.

        Returns:
            The handler's ``(status, payload)``, or one of :data:`POOL_STATUSES` with its
            detail (``None``, the exit code, or the exception's message).

        Raises:
            RuntimeError: The pool is closed, or closed while the job ran (a job still
                running after the close's grace is stopped; its caller should retry it
                elsewhere, e.g. deal the task again, not score it 0).
            PoolBroken: The pool can no longer start workers.
        """
        for _ in range(self.num_workers + 1):  # every worker may have died while idle
            worker = self._acquire()
            try:
                status, payload = worker.run(job, self.timeout_s)
            except BaseException:
                # E.g. an unpicklable job, or KeyboardInterrupt mid-wait: the worker's state
                # is unknown, so replace it rather than reuse it.
                self._replace(worker)
                raise
            if status == "out_of_memory":
                # The job answered, but its worker's heap may stay full (a scorer that leaks
                # into its module, a fragmented heap): a fresh worker takes its place.
                self._replace(worker)
                return status, payload
            if status in ("timeout", "worker_died", "unsent"):
                self._replace(worker)
                if self._closed:  # the close stopped it: not the user code's fault
                    raise RuntimeError(f"{self.name} is closed: the job was stopped with it")
            if status == "unsent":  # the job never started: another worker takes it
                self._log.warning(
                    "%s: a %s worker had died while idle (exit code %s): replaced, and its "
                    "job given to another",
                    self.name,
                    self._role,
                    payload,
                )
                continue
            if status not in ("timeout", "worker_died"):
                self._idle.put(worker)
            return status, payload
        return "worker_died", None

    def map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """``[fn(item) for item in items]``, run on up to ``num_workers`` threads, in order.

        ``fn`` is expected to call :meth:`run`; the threads keep every worker busy.
        """
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        return list(self._executor.map(fn, items))

    def record(self, kind: str, detail: Any) -> None:
        """Count a failure of ``kind``; log its explanation the first time that kind occurs
        with that first word of ``detail`` (an exception's or a returned value's type: a
        scorer that returns None and one that returns a dict without its score are two
        mistakes), for at most :data:`MAX_LOGGED` different ones of each kind: the first of
        a kind is always logged (a model's twenty made-up tool names must not hide the
        first timeout or crash)."""
        variant = (kind, str(detail).split(" ", 1)[0][:40] if detail else "")
        with self._lock:
            self._counters[kind] += 1
            of_kind = sum(k == kind for k, _ in self._logged)
            first = variant not in self._logged and of_kind < MAX_LOGGED
            if first:
                self._logged.add(variant)
        if first:
            message = self._explanations[kind].format(timeout=self.timeout_s, detail=detail)
            self._log.warning(
                "%s (logged once; %s.counters[%r] counts every case)", message, self.name, kind
            )

    def close(self) -> None:
        """Stop all workers; idempotent. Calls waiting for a worker raise RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            respawns = list(self._respawns)
        self._idle.put(None)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for thread in respawns:  # a worker they start after this dies with its parent
            thread.join(min(self._startup_timeout_s, CLOSE_WAIT_S))
        self._finalizer()

    # ----------------------------------------------------------------- internals

    def _start_worker(self) -> Worker:
        worker = Worker(self._ctx, self._setup, self._setup_args, self._role, self._memory_cap)
        with self._lock:
            if not self._stopped.is_set():
                self._workers.add(worker)
                return worker
        worker.kill()  # the pool stopped while it started: nobody would stop it
        raise RuntimeError(f"{self.name} is closed")

    def _acquire(self) -> Worker:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        # Broken, the pool fails every call at once, not only those that meet the None in
        # the queue: a caller that sees some jobs pass would never learn to give up.
        if self._broken is not None:
            raise PoolBroken(self._broken)
        worker = self._idle.get()
        if worker is None:
            self._idle.put(None)  # wake the next waiter too
            if self._broken is not None and not self._closed:
                raise PoolBroken(self._broken)
            raise RuntimeError(f"{self.name} is closed")
        return worker

    def _replace(self, worker: Worker) -> None:
        """Kill ``worker`` now and start its successor in the background."""
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            if self._closed:
                return
            thread = threading.Thread(
                target=self._respawn, name=f"{self._role}-respawn", daemon=True
            )
            # Started under the lock so close() never sees (and joins) an unstarted thread.
            thread.start()
            self._respawns = [t for t in self._respawns if t.is_alive()] + [thread]

    def _respawn(self) -> None:
        try:
            worker = self._start_worker()
            worker.wait_ready(self._startup_timeout_s, self._slow_start)
        except Exception as exc:
            if self._stopped.is_set():  # the close ended it: nothing is broken
                return
            self._broken = f"{self.name} could not replace a worker: {exc}"
            self._log.error(self._broken)
            self._idle.put(None)
            return
        with self._lock:
            closed = self._closed
        if closed:
            worker.stop()
        else:
            self._idle.put(worker)
