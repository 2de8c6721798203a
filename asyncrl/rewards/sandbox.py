"""Run reward functions in worker processes that can be killed, so scoring never stalls.

Threads are not enough: a scorer stuck in C code (``pow(10, 10**8)``, a catastrophic
regex) holds the GIL and cannot be interrupted. :class:`RewardPool` runs scorers on the
generic killable pool (:mod:`asyncrl.sandbox.workers`): each worker is a ``spawn``-ed process that
loads the scorer once, then answers :class:`ScoreJob` s with ``("ok", (score, parts))``,
``("exception", message)`` or ``("bad_return", message)``. A job that overruns
``timeout_s`` gets its worker killed and replaced; the caller gets score 0.0 at once. Each
worker's memory is capped at ``max_memory_mb``: a scorer that runs out of memory under it
scores 0.0 as ``"out_of_memory"`` and its worker is replaced.
Scorers may be ``async def`` (run on the worker's own event loop), may start processes
(``multiprocessing`` included: they are killed with the worker) and may fork.

Code that creates a pool from a script needs the usual ``if __name__ == "__main__":`` guard,
because ``spawn`` imports the main module in each worker.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from asyncrl.rewards.registry import (
    POSITIONAL_MANAGER,
    ScoreFn,
    check_custom_path,
    check_reward_manager,
    default_compute_score,
    load_custom_scorer,
    normalize_score,
    verl_import_hint,
)
from asyncrl.sandbox.child import MAX_MESSAGE_CHARS, Handler
from asyncrl.sandbox.memory import MemoryCap
from asyncrl.sandbox.process import Worker
from asyncrl.sandbox.workers import WorkerPool, check_pool_args

logger = logging.getLogger(__name__)

#: Why a sample scored 0.0 without its scorer's say.
ERROR_KINDS = ("timeout", "exception", "bad_return", "worker_died", "out_of_memory")
#: The key that caps each scorer worker's memory, named by the errors that hit the cap.
MEMORY_KEY = "reward.max_memory_mb"

_EXPLANATIONS = {
    "timeout": "reward function timed out after {timeout}s; make it faster or raise "
    "reward.timeout_s",
    "exception": "reward function raised {detail}; fix the scorer (such samples score 0.0)",
    "bad_return": "reward function returned {detail}; return a finite float or a dict with "
    "a 'score' key",
    "worker_died": "reward worker process died while scoring (exit code {detail}); check the "
    f"scorer for crashes, os._exit or running out of memory ({MEMORY_KEY} caps each worker)",
    "out_of_memory": "reward function ran out of memory ({detail}); such samples score 0.0 "
    f"and its worker is replaced: make the scorer use less or raise {MEMORY_KEY} (0: no cap)",
}


@dataclass(frozen=True)
class ScoreResult:
    """One sample's reward.

    Attributes:
        score: The reward (0.0 when ``error`` is set).
        parts: Extra numeric entries of a dict-returning scorer.
        error: None, or one of :data:`ERROR_KINDS`.
        unshaped: The scorer's own score when the server shaped ``score`` (DAPO's overlong
            penalty added), else None. Kept as given: the shaped score minus the penalty
            is not always it again in floating point (-1.0 - 0.001 + 0.001 is not -1.0).
    """

    score: float
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    unshaped: float | None = None


class ScoreJob(NamedTuple):
    """One response to score, in the order of the scorer's arguments (a tuple, so plain
    ``(data_source, solution_str, ground_truth[, extra_info])`` tuples work too)."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict | None = None


# ------------------------------------------------------------------------ worker process


#: This worker's event loop for ``async def`` scorers, kept for the worker's life so that a
#: client a scorer caches (an HTTP session to a sandbox service) stays bound to a live loop.
_loop: asyncio.AbstractEventLoop | None = None


def _resolve(value: Any) -> Any:
    """``value``, or what it yields when awaited: veRL accepts ``async def compute_score``.

    It runs to completion on this worker's loop, within the job's time like any scorer (the
    pool kills a worker whose job overruns ``timeout_s``)."""
    global _loop
    if not inspect.isawaitable(value):
        return value
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(value)


def _run_job(scorer: ScoreFn, reward_manager: str, job: ScoreJob) -> tuple[str, Any]:
    """Score one job as ``reward_manager`` calls a scorer (by keyword, or by position under
    veRL's prime manager); a scorer that raises is reported by the pool as ``"exception"``."""
    data_source, solution_str, ground_truth, extra_info = job
    try:
        if reward_manager == POSITIONAL_MANAGER:
            value = scorer(data_source, solution_str, ground_truth, extra_info)
        else:
            value = scorer(
                data_source=data_source,
                solution_str=solution_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
            )
        value = _resolve(value)
    except ModuleNotFoundError as exc:
        # A scorer that imports veRL when called: name the fix, as loading one does.
        hint = verl_import_hint(exc)
        if hint is None:
            raise
        raise ModuleNotFoundError(f"the reward file {hint}") from None
    try:
        return "ok", normalize_score(value, reward_manager)
    except (TypeError, ValueError) as exc:
        return "bad_return", str(exc)[:MAX_MESSAGE_CHARS]


def _load_scorer(
    custom_path: str | None,
    custom_name: str,
    kwargs: dict[str, Any] | None = None,
    reward_manager: str = "naive",
) -> Handler:
    """Worker setup: load the scorer once (with ``kwargs`` bound, veRL's
    ``custom_reward_function.reward_kwargs``); the returned handler scores jobs with it, as
    ``reward_manager`` calls a scorer."""
    if not custom_path:  # veRL binds reward_kwargs to a custom scorer only
        return functools.partial(_run_job, default_compute_score, "naive")
    scorer = load_custom_scorer(custom_path, custom_name, kwargs, reward_manager)
    if kwargs:
        scorer = functools.partial(scorer, **kwargs)
    return functools.partial(_run_job, scorer, reward_manager)


def _slow_start(path: str | None) -> str:
    """What a scorer worker too slow to start adds to its error: the key and the fix (the
    usual cause is a scorer module that loads a model or data on import)."""
    if path is None:  # the built-in scorers load at once: a machine too busy to start them
        return " (reward.startup_timeout_s): raise reward.startup_timeout_s"
    return (
        f" (reward.startup_timeout_s) while importing {path}: move heavy loading out of the "
        "module's import, or raise reward.startup_timeout_s"
    )


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
        custom_kwargs: dict[str, Any] | None = None,
        startup_timeout_s: float = 60.0,
        max_memory_mb: int = 8192,
        reward_manager: str = "naive",
    ) -> None:
        """Start the workers and wait until each has loaded its scorer.

        Args:
            num_workers: Worker processes (samples scored at once).
            timeout_s: Longest a single score may take (``reward.timeout_s``).
            custom_path: A user scorer file (``reward.custom_reward_function.path``); when
                None the built-in scorers are used, chosen by data source.
            custom_name: The function to call in that file.
            custom_kwargs: More keyword arguments it gets on every call
                (``reward.custom_reward_function.reward_kwargs``).
            startup_timeout_s: Longest a worker may take to start and load the scorer
                (``reward.startup_timeout_s``).
            max_memory_mb: The memory each worker may take, in MiB (0: no cap;
                ``reward.max_memory_mb``).
            reward_manager: How the custom scorer is called and its return read, as veRL's
                ``reward_model.reward_manager`` of that name does: ``naive`` or ``dapo``
                (by keyword) or ``prime`` (by position; a tuple or list scores its first
                element).

        Raises:
            ValueError: Bad arguments, a missing custom file or function, a file that
                fails to import, or one that takes longer than ``startup_timeout_s`` to:
                raised here, before any sample is scored.
        """
        check_pool_args(num_workers, timeout_s, max_memory_mb)
        check_reward_manager(reward_manager)
        path = str(check_custom_path(custom_path)) if custom_path else None
        self._pool = WorkerPool(
            _load_scorer,
            (path, custom_name, dict(custom_kwargs or {}), reward_manager),
            name="RewardPool",
            role="reward",
            explanations=_EXPLANATIONS,
            num_workers=num_workers,
            timeout_s=timeout_s,
            startup_timeout_s=startup_timeout_s,
            slow_start=_slow_start(path),
            memory_cap=MemoryCap(max_memory_mb, MEMORY_KEY),
            log=logger,
        )
        self.num_workers = num_workers
        self.timeout_s = self._pool.timeout_s
        self.max_memory_mb = max_memory_mb
        self.reward_manager = reward_manager

    # ---------------------------------------------------------------- public API

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of failures so far, by kind (see :data:`ERROR_KINDS`)."""
        return self._pool.counters

    def score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict | None = None,
    ) -> ScoreResult:
        """Score one response; returns within ``timeout_s`` once a worker is free.

        Raises:
            RuntimeError: The pool is closed (or closed while scoring: the sample has no
                score, rather than 0.0), or can no longer start workers.
        """
        job = ScoreJob(data_source, solution_str, ground_truth, extra_info)
        status, payload = self._pool.run(job)
        if status == "ok":
            score, parts = payload
            return ScoreResult(score, parts)
        self._pool.record(status, payload)
        return ScoreResult(0.0, {}, status)

    def score_many(self, items: Sequence[tuple[Any, ...]]) -> list[ScoreResult]:
        """Score jobs (:class:`ScoreJob`, or plain ``(data_source, solution_str, ground_truth[,
        extra_info])`` tuples) concurrently.

        Results come back in the order of ``items``.
        """
        return self._pool.map(lambda item: self.score(*item), items)

    def close(self) -> None:
        """Stop all workers; idempotent. Calls waiting for a worker raise RuntimeError."""
        self._pool.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _workers(self) -> list[Worker]:
        """The live worker handles; tests look at their processes."""
        return self._pool.workers
