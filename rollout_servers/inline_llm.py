"""vLLM's engine inside the rollout server's own process (``rollout.inline_engine``).

``AsyncLLM`` runs vLLM's engine core in a child process: every engine step, the core
serialises its outputs (one sampled logprob per request among them) and sends them over a
socket, and the server's process decodes them. On one CPU core, where both processes take
turns, that hand-over is pure overhead: 128 requests of 128 tokens on the tiny model made
10.2k and 12.3k tokens/s stepped in-process against 9.2k and 8.0k through ``AsyncLLM``
(medians of seven rounds, two runs each, alternating, on one core).

:class:`InlineLLM` keeps the engine core in this process: vLLM's synchronous ``LLMEngine``
(in-process client), stepped by one thread of its own. It offers the part of ``AsyncLLM``'s
interface that :class:`~rollout_servers.engine.RolloutEngine` and
:mod:`rollout_servers.adapters` call, with the same meaning, so the rest of the server does
not know which one it drives. The limits: ``generate`` yields only a request's final
output (the server asks for no other), and a pause keeps requests in flight (``keep``);
``abort`` mode needs ``AsyncLLM`` (config validation says so). :meth:`InlineLLM.abort` ends
chosen requests as ``AsyncLLM``'s does (a move off a stale adapter uses it).

The engine thread's loop:
- consumes commands (add a request, abort, pause, load weights, ...), queued by the event
  loop; it runs them in order between engine steps, because ``LLMEngine`` is not
  thread-safe;
- produces finished ``RequestOutput`` objects, handed to the awaiting coroutine on the
  event loop;
- waits (on a condition) while there is neither a command nor an unpaused request; a new
  command or :meth:`shutdown` unblocks it.
If a step raises, the thread fails every waiting request and command with that error and
ends; :attr:`errored` turns true, as ``AsyncLLM.errored`` does when its engine dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The inline engine's thread has ended (an engine step raised, or it was shut down).
    Named as vLLM's own error for a dead engine core, which the server logs without a
    traceback (the engine thread has logged the cause)."""


class InlineLLM:
    """vLLM's ``LLMEngine`` stepped by a thread of this process; coroutines on the event
    loop that created it submit requests and commands to it."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine  # vllm.v1.engine.llm_engine.LLMEngine, in-process client
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[str, asyncio.Future[Any]] = {}  # request id -> its final output
        self._commands: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._wake = threading.Condition()
        self._paused = False  # touched by the engine thread only
        self._stopping = False
        self._error: BaseException | None = None
        self.steps = 0  # engine steps taken (the thread counts them)
        self._thread = threading.Thread(target=self._run, name="inline-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> InlineLLM:
        """Build the engine (vLLM's engine core in this process, whatever
        ``VLLM_ENABLE_V1_MULTIPROCESSING`` says) and start its thread. Call on the event
        loop that will use it."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        engine = LLMEngine(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=not args.disable_log_stats,
            multiprocess_mode=False,
        )
        return cls(engine)

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread (see the module docstring)."""
        try:
            while True:
                with self._wake:
                    while not (self._commands or self._stopping or self._has_work()):
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                for call, done in commands:
                    # A caller that gave up (cancelled: a timeout, a shutdown) is not run for:
                    # setting its result raised, and read as the engine's death (exit 4).
                    if not done.set_running_or_notify_cancel():
                        continue
                    try:
                        done.set_result(call())
                    except BaseException as exc:  # the caller re-raises it
                        done.set_exception(exc)
                if self._has_work():
                    self.steps += 1
                    for out in self._engine.step():
                        if out.finished:
                            self._to_loop(self._deliver, out.request_id, out)
        except BaseException as exc:  # the engine died: nothing here can go on
            log.exception(
                "inline vLLM engine failed; the server exits 4 for its supervisor to restart it"
            )
            self._error = exc
        finally:
            self._fail_all()

    def _has_work(self) -> bool:
        return not self._paused and self._engine.has_unfinished_requests()

    def _fail_all(self) -> None:
        error = EngineDeadError(f"inline vLLM engine stopped: {self._error or 'shut down'}")
        with self._wake:
            commands, self._commands = self._commands, []
            self._stopping = True
        for _, done in commands:
            if done.set_running_or_notify_cancel():  # else its caller gave up already
                done.set_exception(error)
        self._to_loop(self._fail_waiting, error)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        # RuntimeError: the event loop has closed, so nobody is waiting any more
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    # -- the event loop's side --------------------------------------------------------

    def _deliver(self, request_id: str, out: Any) -> None:
        waiter = self._waiting.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(out)

    def _fail_waiting(self, error: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(error)

    def _submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``call`` on the engine thread between steps; its result, awaitable."""
        done: Future[T] = Future()
        with self._wake:
            if self._stopping:
                done.set_exception(EngineDeadError(f"inline vLLM engine stopped: {self._error}"))
            else:
                self._commands.append((call, done))
                self._wake.notify()
        return asyncio.wrap_future(done)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._waiting)

    @property
    def errored(self) -> bool:
        """Whether the engine thread died of an error (no request can succeed here)."""
        return self._error is not None

    async def generate(
        self,
        prompt: dict[str, Any],
        params: SamplingParams,
        request_id: str,
        lora_request: Any = None,
    ) -> AsyncIterator[Any]:
        """Yield the request's final ``RequestOutput`` (only that one, whatever
        ``params.output_kind`` says). A cancelled caller aborts the request."""
        if request_id in self._waiting:
            raise ValueError(f"request id {request_id!r} is already running")
        waiter = self._loop.create_future()
        self._waiting[request_id] = waiter
        try:
            await self._submit(
                lambda: self._engine.add_request(
                    request_id, prompt, params, lora_request=lora_request
                )
            )
            out = await waiter
        except asyncio.CancelledError:
            # Nobody awaits the abort: read its outcome so that a dead engine's error is
            # not reported as never retrieved.
            abort = self._submit(lambda: self._engine.abort_request([request_id]))
            abort.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        finally:
            self._waiting.pop(request_id, None)
        yield out

    async def pause_generation(self, *, mode: str = "keep", clear_cache: bool = True) -> None:
        """Stop stepping; requests in flight stay frozen and, with ``clear_cache``, lose
        their KV cache (they recompute it under the weights loaded next)."""
        if mode != "keep":
            raise ValueError(f"the inline engine pauses in keep mode only, not {mode!r}")

        def pause() -> None:
            self._core().pause_scheduler(mode="keep", clear_cache=clear_cache)
            self._paused = True

        await self._submit(pause)

    async def resume_generation(self) -> None:
        def resume() -> None:
            self._core().resume_scheduler()
            self._paused = False

        await self._submit(resume)

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call ``method`` on every worker (the weight-sync extension's ``wsync_*``)."""
        return await self._submit(lambda: self._engine.collective_rpc(method, args=args))

    async def reset_prefix_cache(self) -> bool:
        return await self._submit(self._engine.reset_prefix_cache)

    async def update_weight_version(self, new_version: str) -> None:
        """Label the tokens generated from now on ``new_version``."""
        await self._submit(lambda: self._engine.set_weight_version(new_version))

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """End these requests now: each waiter gets the request's output so far, with
        ``finish_reason`` ``abort``, as ``AsyncLLM``'s abort gives it (a request moved off
        a stale adapter goes on from its tokens). ``LLMEngine.abort_request`` makes no
        output, so it is made here first. Requests already finished are left alone."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)

        def abort() -> None:
            from vllm.v1.engine import FinishReason

            processor = self._engine.output_processor
            outputs = []
            for rid in ids:
                for internal in list(processor.external_req_ids.get(rid, ())):
                    state = processor.request_states.get(internal)
                    if state is None:
                        continue
                    out = state.make_request_output([], None, FinishReason.ABORT, None)
                    if out is not None:
                        outputs.append((rid, out))
            self._engine.abort_request(ids)
            for rid, out in outputs:
                self._to_loop(self._deliver, rid, out)

        await self._submit(abort)

    async def add_lora(self, lora_request: Any) -> bool:
        return await self._submit(lambda: self._engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._submit(lambda: self._engine.remove_lora(lora_id))

    def shutdown(self) -> None:
        """Stop the thread (after the step it is in) and vLLM's engine core."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30.0)
            if self._thread.is_alive():
                log.warning("inline vLLM engine thread still busy after 30 s; shutting down")
        self._engine.engine_core.shutdown()

    def _core(self) -> Any:
        """vLLM's ``EngineCore`` (the in-process client's), for the scheduler's pause."""
        return self._engine.engine_core.engine_core
