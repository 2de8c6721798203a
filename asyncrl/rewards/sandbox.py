"""Run reward functions in worker processes that can be killed, so scoring never stalls.

Threads are not enough: a scorer stuck in C code (``pow(10, 10**8)``, a catastrophic
regex) holds the GIL and cannot be interrupted. Each :class:`RewardPool` worker is a
``spawn``-ed process (safe while the caller runs threads or an event loop) that loads the
scorer once, then answers jobs sent over its own pipe. A job that overruns ``timeout_s``
gets its worker killed and replaced; the caller gets score 0.0 at once.

Protocol (parent <-> its own child, plain picklable tuples):

- child -> parent at start: ``("ready", None)`` or ``("startup_error", message)``
- parent -> child: a :class:`ScoreJob` (``data_source, solution_str, ground_truth,
  extra_info``), or ``None`` to stop
- child -> parent: ``("ok", (score, parts))``, ``("exception", message)`` or
  ``("bad_return", message)``

Code that creates a pool from a script needs the usual ``if __name__ == "__main__":`` guard,
because ``spawn`` imports the main module in each worker.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import queue
import signal
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from asyncrl.rewards.registry import (
    ScoreFn,
    check_custom_path,
    default_compute_score,
    load_custom_scorer,
    normalize_score,
)

logger = logging.getLogger(__name__)

#: Why a sample scored 0.0 without its scorer's say.
ERROR_KINDS = ("timeout", "exception", "bad_return", "worker_died")

_EXPLANATIONS = {
    "timeout": "reward function timed out after {timeout}s; make it faster or raise "
    "reward.timeout_s",
    "exception": "reward function raised {detail}; fix the scorer (such samples score 0.0)",
    "bad_return": "reward function returned {detail}; return a finite float or a dict with "
    "a 'score' key",
    "worker_died": "reward worker process died while scoring (exit code {detail}); check the "
    "scorer for crashes, os._exit or running out of memory",
}

_MAX_MESSAGE_CHARS = 300
_STOP_GRACE_S = 1.0  # how long a worker may take to exit before it is killed


@dataclass(frozen=True)
class ScoreResult:
    """One sample's reward.

    Attributes:
        score: The reward (0.0 when ``error`` is set).
        parts: Extra numeric entries of a dict-returning scorer.
        error: None, or one of :data:`ERROR_KINDS`.
    """

    score: float
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class ScoreJob(NamedTuple):
    """One response to score, in the order of the scorer's arguments (a tuple, so plain
    ``(data_source, solution_str, ground_truth[, extra_info])`` tuples work too)."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict | None = None


# ------------------------------------------------------------------------ worker process


def _run_job(scorer: ScoreFn, job: ScoreJob) -> tuple[str, Any]:
    data_source, solution_str, ground_truth, extra_info = job
    try:
        value = scorer(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
    except Exception as exc:
        return "exception", f"{type(exc).__name__}: {exc}"[:_MAX_MESSAGE_CHARS]
    try:
        return "ok", normalize_score(value)
    except (TypeError, ValueError) as exc:
        return "bad_return", str(exc)[:_MAX_MESSAGE_CHARS]


def _worker_main(conn: Connection, custom_path: str | None, custom_name: str) -> None:
    """Entry point of a worker process: load the scorer, then serve jobs until told to stop.

    Consumes :class:`ScoreJob` s from its pipe; produces one answer per job. Waits on the
    pipe for the next job; unblocked by a job, by ``None`` (stop) or by the parent going
    away (end of file). A job that hangs is not its business: the parent kills it."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        scorer = (
            load_custom_scorer(custom_path, custom_name) if custom_path else default_compute_score
        )
    except Exception as exc:
        conn.send(("startup_error", str(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone: do not outlive it
        if job is None:
            return
        conn.send(_run_job(scorer, job))


class _Worker:
    """The parent's handle on one worker process and its pipe."""

    def __init__(self, ctx: Any, custom_path: str | None, custom_name: str) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main,
            args=(child_conn, custom_path, custom_name),
            name="asyncrl-reward-worker",
            daemon=True,  # multiprocessing terminates daemon children when the parent exits
        )
        self.process.start()
        # Without closing our copy of the child's end, its death would never read as EOF.
        child_conn.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the worker has loaded its scorer; raise ValueError if it cannot."""
        if not self.conn.poll(timeout_s):
            self.kill()
            raise ValueError(f"reward worker did not start within {timeout_s}s")
        try:
            status, message = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise ValueError(
                f"reward worker exited during start (exit code {self.process.exitcode})"
            ) from None
        if status != "ready":
            self.kill()
            raise ValueError(message)

    def run(self, job: ScoreJob, timeout_s: float) -> tuple[str, Any]:
        """Send one job and wait for its answer; ``("timeout"|"worker_died", detail)`` if none."""
        self.conn.send(job)
        ready = wait([self.conn, self.process.sentinel], timeout_s)
        if not ready:
            return "timeout", None
        if self.conn in ready:
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                pass
        self.process.join(_STOP_GRACE_S)
        return "worker_died", self.process.exitcode

    def kill(self) -> None:
        """Terminate the process (SIGKILL if it lingers) and close the pipe."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(0.2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(_STOP_GRACE_S)
        self.conn.close()

    def stop(self) -> None:
        """Ask the worker to exit, and kill it if it does not do so promptly."""
        with contextlib.suppress(OSError, ValueError):  # already gone or closed
            self.conn.send(None)
        self.process.join(_STOP_GRACE_S)
        self.kill()


def _stop_all(workers: set[_Worker]) -> None:
    """Stop every worker; shared by close() and the exit-time finalizer."""
    for worker in list(workers):
        worker.stop()
    workers.clear()


# --------------------------------------------------------------------------------- pool


class RewardPool:
    """Score responses in killable worker processes; thread-safe.

    Each call waits for an idle worker, sends it the job and waits at most ``timeout_s``
    for the answer. Failures never raise: they score 0.0, set :attr:`ScoreResult.error`,
    are counted in :attr:`counters` and logged once per kind with the fix. A worker that
    times out or dies is replaced in the background, so the pool keeps its size.

    Example::

        with RewardPool(num_workers=2, timeout_s=5.0) as pool:
            result = pool.score("countdown", response, {"target": 24, "numbers": [...]})
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        custom_path: str | None = None,
        custom_name: str = "compute_score",
        *,
        startup_timeout_s: float = 60.0,
    ) -> None:
        """Start the workers and wait until each has loaded its scorer.

        Args:
            num_workers: Worker processes (samples scored at once).
            timeout_s: Longest a single score may take (``reward.timeout_s``).
            custom_path: A user scorer file (``reward.custom_reward_function.path``); when
                None the built-in scorers are used, chosen by data source.
            custom_name: The function to call in that file.
            startup_timeout_s: Longest a worker may take to start and load the scorer.

        Raises:
            ValueError: Bad arguments, a missing custom file or function, or a file that
                fails to import: raised here, before any sample is scored.
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._custom_path = str(check_custom_path(custom_path)) if custom_path else None
        self._custom_name = custom_name
        self._startup_timeout_s = startup_timeout_s
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._counters: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self._logged: set[str] = set()
        self._closed = False
        self._broken: str | None = None
        self._respawns: list[threading.Thread] = []
        # None in this queue means "the pool cannot serve": closed, or a respawn failed.
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._workers: set[_Worker] = set()
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        # Start all workers before waiting on any, so their start-up overlaps.
        started = [self._start_worker() for _ in range(num_workers)]
        try:
            for worker in started:
                worker.wait_ready(startup_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        for worker in started:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="reward-pool")

    # ---------------------------------------------------------------- public API

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of failures so far, by kind (see :data:`ERROR_KINDS`)."""
        with self._lock:
            return dict(self._counters)

    def score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict | None = None,
    ) -> ScoreResult:
        """Score one response; returns within ``timeout_s`` once a worker is free.

        Raises:
            RuntimeError: The pool is closed or can no longer start workers.
        """
        worker = self._acquire()
        job = ScoreJob(data_source, solution_str, ground_truth, extra_info)
        try:
            status, payload = worker.run(job, self.timeout_s)
        except BaseException:
            # E.g. an unpicklable argument, or KeyboardInterrupt mid-wait: the worker's
            # state is unknown, so replace it rather than reuse it.
            self._replace(worker)
            raise
        if status == "ok":
            self._idle.put(worker)
            score, parts = payload
            return ScoreResult(score, parts)
        if status in ("timeout", "worker_died"):
            self._replace(worker)
        else:
            self._idle.put(worker)
        return self._failure(status, payload)

    def score_many(self, items: Sequence[tuple[Any, ...]]) -> list[ScoreResult]:
        """Score jobs (:class:`ScoreJob`, or plain ``(data_source, solution_str, ground_truth[,
        extra_info])`` tuples) concurrently.

        Results come back in the order of ``items``.
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        return list(self._executor.map(lambda item: self.score(*item), items))

    def close(self) -> None:
        """Stop all workers; idempotent. Calls waiting for a worker raise RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            respawns = list(self._respawns)
        self._idle.put(None)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for thread in respawns:
            thread.join(self._startup_timeout_s)
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _start_worker(self) -> _Worker:
        worker = _Worker(self._ctx, self._custom_path, self._custom_name)
        with self._lock:
            self._workers.add(worker)
        return worker

    def _acquire(self) -> _Worker:
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        worker = self._idle.get()
        if worker is None:
            self._idle.put(None)  # wake the next waiter too
            raise RuntimeError(self._broken or "RewardPool is closed")
        return worker

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` now and start its successor in the background."""
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            if self._closed:
                return
            thread = threading.Thread(target=self._respawn, name="reward-respawn", daemon=True)
            # Started under the lock so close() never sees (and joins) an unstarted thread.
            thread.start()
            self._respawns = [t for t in self._respawns if t.is_alive()] + [thread]

    def _respawn(self) -> None:
        try:
            worker = self._start_worker()
            worker.wait_ready(self._startup_timeout_s)
        except Exception as exc:
            self._broken = f"RewardPool could not replace a worker: {exc}"
            logger.error(self._broken)
            self._idle.put(None)
            return
        with self._lock:
            closed = self._closed
        if closed:
            worker.stop()
        else:
            self._idle.put(worker)

    def _failure(self, kind: str, detail: Any) -> ScoreResult:
        with self._lock:
            self._counters[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            message = _EXPLANATIONS[kind].format(timeout=self.timeout_s, detail=detail)
            logger.warning(
                "%s (logged once; RewardPool.counters[%r] counts every case)", message, kind
            )
        return ScoreResult(0.0, {}, kind)
