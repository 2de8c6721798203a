"""Run agent tools in killable worker processes, so a stuck tool never stalls generation.

:class:`ToolPool` sits on the generic killable pool (:mod:`asyncrl.sandbox.workers`). Each worker
builds every tool of the config once at start; one job is one call: ``create`` an
instance (with the trajectory's ``create_kwargs``), ``execute`` it with the model's
arguments, ``release`` it. A call never raises for a tool's or the model's mistakes: it
returns a :class:`ToolResult` whose text tells the model what went wrong, and whose
``error`` says whose fault it was (:data:`ENVIRONMENT_ERRORS` are not the model's).

Worker protocol: job ``(name, arguments, create_kwargs)``; answer ``("ok", (text,
reward, note))`` (``note``: None, or why the step reward was unreadable and read as 0) or
``("bad_return", message)`` (plus the pool's own statuses). The worker cuts
``text`` to ``max_response_length`` and makes it valid UTF-8 before it answers, so a tool
that prints hundreds of megabytes costs the server only the cut. What runs inside a
worker is :mod:`asyncrl.tools.calls`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.sandbox.memory import MemoryCap
from asyncrl.sandbox.workers import MAX_MESSAGE_CHARS, WorkerPool
from asyncrl.tools.calls import TruncateSide, load_tools, truncate_response, valid_text
from asyncrl.tools.config import ToolSpec, load_tool_config, schemas
from asyncrl.tools.hermes import ToolCall

__all__ = [
    "BAD_REWARD",
    "ENVIRONMENT_ERRORS",
    "TOOL_ERROR_KINDS",
    "ToolCall",
    "ToolPool",
    "ToolResult",
]

logger = logging.getLogger(__name__)

#: Why a call's text is an error message rather than the tool's answer.
TOOL_ERROR_KINDS = (
    "timeout",
    "exception",
    "unknown_tool",
    "bad_arguments",
    "worker_died",
    "bad_return",
    "out_of_memory",
)
#: Failures that are not the model's fault (the tool's or the machine's), as the README and
#: the first log line of each say. Only a label: the model still reads the error text, and
#: its episode is scored and trained like any other (nothing masks or drops it).
ENVIRONMENT_ERRORS = ("timeout", "worker_died", "out_of_memory")
#: A call whose answer reached the model but whose step reward was not a finite number (NaN,
#: a string): counted in :attr:`ToolPool.counters` under this name, the reward read as 0.
#: Not a :data:`TOOL_ERROR_KINDS` member: a bad step reward costs the answer nothing.
BAD_REWARD = "bad_reward"
#: The result of a call of a turn given up before the call reached a worker (never run,
#: never read: its episode ended or timed out meanwhile). Not a :data:`TOOL_ERROR_KINDS`
#: member: no model reads it.
DROPPED = "dropped"
#: The key that caps each tool worker's memory, named by the calls that hit the cap.
MEMORY_KEY = "rollout.multi_turn.tool_max_memory_mb"
#: The most characters of an unknown tool's name (the model's) that its error line quotes.
MAX_NAME_CHARS = 64
#: The key that sizes the pool, named when calls wait long for a free worker.
WORKERS_KEY = "rollout.multi_turn.tool_workers"
#: A call that waited this long for a free worker is said in the log (once per pool): the
#: workers, not the tools, then bound how many calls run at once.
LONG_WAIT_S = 1.0

_EXPLANATIONS = {
    "timeout": "a tool call timed out after {timeout}s and its worker was replaced (an "
    "environment error, not the model's); make the tool faster or raise "
    "rollout.multi_turn.tool_timeout_s",
    "exception": "a tool raised {detail}; the model sees the error; fix the tool if the "
    "arguments were valid",
    "unknown_tool": "the model called an unknown tool ({detail}); expected early in training, "
    "but check the tool config and the prompt's tool list if it persists",
    "bad_arguments": "the model called a tool with bad arguments ({detail}); expected early "
    "in training, but check the schema's required list if it persists",
    "worker_died": "a tool worker process died during a call (exit code {detail}; an "
    "environment error, not the model's); check the tool for crashes, os._exit or running "
    "out of memory",
    "out_of_memory": "a tool call ran out of memory ({detail}) and its worker was replaced "
    "(an environment error, not the model's); make the tool use less or raise "
    f"{MEMORY_KEY} (0: no cap)",
    "bad_return": "a tool returned {detail}; execute must return (text, {{'text': ...}} or a "
    "ToolResponse, reward or None, metrics)",
    BAD_REWARD: "a tool returned {detail}; the model still gets the answer and the reward is "
    "read as 0 (the scorer's extra_info['tool_rewards']); return a finite number or None",
}


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call.

    Attributes:
        text: The tool message content for the model: an answer cut to
            ``max_response_length``; an error line whose head is never cut (see
            :meth:`ToolPool._error_text`).
        error: None, or one of :data:`TOOL_ERROR_KINDS`.
        reward: The tool's step reward: 0.0 on error or when it was no number, None when
            the tool gave none (veRL's tool agent then records none).
    """

    text: str
    error: str | None = None
    reward: float | None = 0.0


# --------------------------------------------------------------------------------- pool


class _QueueWaits:
    """How long calls waited for a free worker: the total and the longest, thread-safe;
    the first wait of :data:`LONG_WAIT_S` or more is logged with its fix."""

    def __init__(self, num_workers: int) -> None:
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._total_s = 0.0
        self._max_s = 0.0
        self._warned = False

    def add(self, seconds: float) -> None:
        """Count one call's wait."""
        with self._lock:
            self._total_s += seconds
            self._max_s = max(self._max_s, seconds)
            warn = seconds >= LONG_WAIT_S and not self._warned
            self._warned = self._warned or warn
        if warn:
            # Async tools are the usual case: each worker runs one call at a time, so an
            # I/O-bound call holds a worker while it waits on the network.
            logger.warning(
                "a tool call waited %.1fs for a free tool worker: the %d workers (%s) run one "
                "call each at a time, async tools too, so concurrent episodes queue for them; "
                "raise %s (time queued does not count toward "
                "rollout.multi_turn.tool_timeout_s) (logged once; ToolPool.queue_wait "
                "totals every wait)",
                seconds,
                self._num_workers,
                WORKERS_KEY,
                WORKERS_KEY,
            )

    def snapshot(self) -> dict[str, float]:
        """``{"total_s": ..., "max_s": ...}`` so far."""
        with self._lock:
            return {"total_s": self._total_s, "max_s": self._max_s}


class ToolPool:
    """Call tools from a veRL tool config in killable worker processes; thread-safe.

    Calls block until their answer (at most ``timeout_s`` once a worker is free); from an
    event loop, await :meth:`call_many_async`, which waits in the pool's own threads. Each
    worker runs one call at a time, async tools too: :attr:`queue_wait` says how long calls
    waited for one.

    Example::

        with ToolPool("configs/tools/calculator.yaml", timeout_s=5.0) as pool:
            result = pool.call(ToolCall("add", {"a": 2, "b": 3}))  # ToolResult("5")
    """

    def __init__(
        self,
        config_path: str | Path,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        max_response_length: int = 256,
        truncate_side: TruncateSide = "middle",
        startup_timeout_s: float = 60.0,
        max_memory_mb: int = 8192,
    ) -> None:
        """Read the config, start the workers and wait until each has built its tools.

        Args:
            config_path: The tool config (``rollout.multi_turn.tool_config_path``).
            num_workers: Worker processes (calls run at once).
            timeout_s: Longest one call may take (``rollout.multi_turn.tool_timeout_s``).
            max_response_length: Characters of a response the model sees
                (``rollout.multi_turn.max_tool_response_length``).
            truncate_side: Which part of a long response to cut (see
                :func:`truncate_response`).
            startup_timeout_s: Longest a worker may take to start and build the tools
                (``rollout.multi_turn.tool_startup_timeout_s``).
            max_memory_mb: The memory each worker may take, in MiB (0: no cap;
                ``rollout.multi_turn.tool_max_memory_mb``): a call past it is an
                ``out_of_memory`` error and its worker is replaced.

        Raises:
            ValueError: A bad config or argument, or a tool that fails to import or to
                construct, or not within ``startup_timeout_s``: raised here, before any call.
        """
        if max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
        if truncate_side not in ("left", "middle", "right"):
            raise ValueError(f"truncate_side must be left, middle or right, not {truncate_side!r}")
        specs = load_tool_config(config_path)
        self.names: list[str] = [spec.name for spec in specs]
        self.schemas: list[dict[str, Any]] = schemas(specs)
        self._required = {spec.name: _required(spec) for spec in specs}
        self.max_response_length = max_response_length
        self.truncate_side: TruncateSide = truncate_side
        # The usual cause of a slow start: a tool module that loads a model or an SDK on import
        slow_start = (
            f" (rollout.multi_turn.tool_startup_timeout_s) while importing the tools of "
            f"{config_path}: move heavy loading out of the tool module's import, or raise "
            "rollout.multi_turn.tool_startup_timeout_s"
        )
        self._pool = WorkerPool(
            load_tools,
            (tuple(specs), max_response_length, truncate_side),
            name="ToolPool",
            role="tool",
            explanations=_EXPLANATIONS,
            num_workers=num_workers,
            timeout_s=timeout_s,
            startup_timeout_s=startup_timeout_s,
            slow_start=slow_start,
            memory_cap=MemoryCap(max_memory_mb, MEMORY_KEY),
            log=logger,
        )
        self.timeout_s = self._pool.timeout_s
        # One thread per worker runs the turns of call_many_async: turns waiting for a
        # worker queue here, holding no thread of the event loop's default executor.
        self._turns = ThreadPoolExecutor(num_workers, thread_name_prefix="tool-turn")
        # As many calls as workers pass at once, so that a call passing it finds a free
        # worker: the time to pass is the time waited for one, whoever calls (the turns'
        # and map's threads hold calls back too; a call's wait starts at its submission).
        self._gate = threading.BoundedSemaphore(num_workers)
        self._waits = _QueueWaits(num_workers)

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of failed calls so far, by kind (see :data:`TOOL_ERROR_KINDS`), and of
        answers whose step reward was unreadable (:data:`BAD_REWARD`)."""
        return self._pool.counters

    @property
    def queue_wait(self) -> dict[str, float]:
        """Seconds calls have waited for a free worker so far: ``total_s`` over all calls,
        ``max_s`` the longest wait of one. A call waits from its submission (its turn's,
        for :meth:`call_many_async`) until it has a worker; the wait is not part of its
        ``timeout_s``. Waiting for a replaced worker to start is not counted."""
        return self._waits.snapshot()

    def call(self, call: ToolCall, create_kwargs: dict | None = None) -> ToolResult:
        """Run one call; returns within about ``timeout_s`` once a worker is free.

        Raises:
            RuntimeError: The pool is closed or can no longer start workers.
        """
        return self._call(call, create_kwargs, time.monotonic())

    def _call(
        self,
        call: ToolCall,
        create_kwargs: dict | None,
        since: float,
        dropped: threading.Event | None = None,
    ) -> ToolResult:
        """:meth:`call`, submitted at ``since`` (``time.monotonic()``); not run once
        ``dropped`` is set (nobody waits for its answer)."""
        refusal = self._check(call)
        if refusal is not None:
            return refusal
        job = (call.name, call.arguments, dict(create_kwargs or {}))
        with self._gate:
            if dropped is not None and dropped.is_set():  # its turn was given up meanwhile
                return ToolResult("", DROPPED, None)
            self._waits.add(time.monotonic() - since)
            status, payload = self._pool.run(job)
        if status == "ok":  # cut and made valid in the worker
            text, reward, note = payload
            if note is not None:
                self._pool.record(BAD_REWARD, note)
            return ToolResult(text, None, reward)
        self._pool.record(status, payload)
        return ToolResult(valid_text(self._error_text(call.name, status, payload)), status)

    def call_many(
        self, calls: Sequence[ToolCall], create_kwargs: dict[str, dict] | None = None
    ) -> list[ToolResult]:
        """Run calls concurrently; results in the order of ``calls``.

        Args:
            calls: The calls of one assistant turn.
            create_kwargs: Per tool name, the ``create_kwargs`` for its instances (veRL's
                ``extra_info.tools_kwargs[name]["create_kwargs"]``).
        """
        return self._call_many(calls, create_kwargs, time.monotonic())

    def _call_many(
        self,
        calls: Sequence[ToolCall],
        create_kwargs: dict[str, dict] | None,
        since: float,
        dropped: threading.Event | None = None,
    ) -> list[ToolResult]:
        """:meth:`call_many`, submitted at ``since`` (``time.monotonic()``); calls that
        have not reached a worker when ``dropped`` is set are not run."""
        by_name = create_kwargs or {}
        return self._pool.map(lambda c: self._call(c, by_name.get(c.name), since, dropped), calls)

    async def call_many_async(
        self,
        calls: Sequence[ToolCall],
        create_kwargs: dict[str, dict] | None = None,
        wait_s: float | None = None,
    ) -> list[ToolResult]:
        """:meth:`call_many` from an event loop, run in this pool's own threads (one per
        worker), so turns queued for a worker never hold the threads that the loop's other
        blocking calls need (a rollout server's sync reports and acknowledgements).

        Raises:
            TimeoutError: No answer within ``wait_s`` (None: no bound). The turn's calls
                still waiting for a worker are dropped, never run (they held workers that
                live episodes waited for); a call already running finishes in its worker
                (within ``timeout_s``) and its answer is discarded. Cancelling the await
                does the same: an episode whose deadline a weight sync moves on bounds
                the wait itself (:func:`rollout_servers.deadlines.within`).
        """
        dropped = threading.Event()
        turn = functools.partial(self._call_many, calls, create_kwargs, time.monotonic(), dropped)
        future = asyncio.get_running_loop().run_in_executor(self._turns, turn)
        try:
            return await asyncio.wait_for(future, wait_s)
        except BaseException:  # timed out or cancelled: nobody reads this turn's answers
            dropped.set()
            raise

    def close(self) -> None:
        """Stop all workers; idempotent. Calls waiting for a worker raise RuntimeError."""
        self._turns.shutdown(wait=False, cancel_futures=True)
        self._pool.close()

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internals

    def _check(self, call: ToolCall) -> ToolResult | None:
        """The model's own mistakes, caught before a worker is used: None if the call is fine."""
        if call.name not in self._required:
            shown = _shown_name(call.name)
            text = f"Error: unknown tool {shown}; available: {', '.join(self.names)}"
            return self._refuse("unknown_tool", shown, text)
        if not isinstance(call.arguments, dict):
            kind = type(call.arguments).__name__
            text = f"Error: the arguments of tool {call.name!r} must be a JSON object, not {kind}"
            return self._refuse("bad_arguments", f"{call.name}: arguments of type {kind}", text)
        missing = [key for key in self._required[call.name] if key not in call.arguments]
        if missing:
            listed = ", ".join(missing)
            text = f"Error: tool {call.name!r} is missing required argument(s): {listed}"
            return self._refuse("bad_arguments", f"{call.name}: missing {listed}", text)
        return None

    def _refuse(self, kind: str, detail: str, text: str) -> ToolResult:
        self._pool.record(kind, detail)
        return ToolResult(valid_text(text), kind)  # the pool's own words: never cut

    def _error_text(self, name: str, kind: str, detail: Any) -> str:
        """The line the model reads for a failed call. Its head, the pool's words saying
        what happened, is never cut (a short ``max_tool_response_length`` cut it mid-word,
        and the model could not tell a timeout from a crash); only what the tool itself
        said (a raise's message) is bounded, see :meth:`_bounded`."""
        if kind == "timeout":
            return f"Error: tool {name!r} timed out after {self.timeout_s:g}s"
        if kind == "worker_died":
            return f"Error: tool {name!r} crashed"
        if kind == "out_of_memory":
            return f"Error: tool {name!r} ran out of memory"
        if kind == "exception":
            return f"Error: tool {name!r} failed: {self._bounded(str(detail))}"
        return f"Error: tool {name!r} returned an invalid response"

    def _bounded(self, told: str) -> str:
        """Text a tool gave inside an error line: at most :data:`MAX_MESSAGE_CHARS` (the
        worker sends no more of a raise, so a 30 MB message costs nothing), then cut to
        ``max_tool_response_length`` on its side, as the tool's answers are."""
        cut = told[:MAX_MESSAGE_CHARS]
        return truncate_response(cut, self.max_response_length, self.truncate_side)


def _shown_name(name: str) -> str:
    """A name the model called, quoted for an error line, at most :data:`MAX_NAME_CHARS`
    of it: the line is never cut, and a model may write a name of any length."""
    return repr(truncate_response(name, MAX_NAME_CHARS, "left"))


def _required(spec: ToolSpec) -> list[str]:
    """The argument names the schema requires."""
    return list(spec.schema["function"].get("parameters", {}).get("required", []))
