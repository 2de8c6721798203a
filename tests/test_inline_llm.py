"""The inline engine's thread (``rollout_servers/inline_llm.py``) around a stand-in for
vLLM's ``LLMEngine``: requests finish in the order the engine finishes them, a pause stops
stepping, a cancelled request is aborted in the engine, and an engine that dies fails every
waiting request and command with one error instead of leaving them waiting. (The real
engine's generation, pushes and probe run in ``test_rollout_engine.py``.)"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from rollout_servers.inline_llm import EngineDeadError, InlineLLM


class StandInEngine:
    """An ``LLMEngine``-shaped engine: each request finishes after ``steps_needed`` steps;
    ``fail_at_step`` makes that step raise. Records the calls the thread makes."""

    def __init__(self, steps_needed: int = 3, fail_at_step: int | None = None) -> None:
        self.steps_needed, self.fail_at_step = steps_needed, fail_at_step
        self.running: dict[str, int] = {}  # request id -> steps taken
        self.steps = 0
        self.aborted: list[str] = []
        self.paused = False
        self.threads: set[str] = set()
        core = SimpleNamespace(
            pause_scheduler=lambda mode, clear_cache: setattr(self, "paused", True),
            resume_scheduler=lambda: setattr(self, "paused", False),
        )
        self.engine_core = SimpleNamespace(engine_core=core, shutdown=lambda: None)

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request=None) -> None:
        self.threads.add(threading.current_thread().name)
        self.running[request_id] = 0

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)
            self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[Any]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("engine core died")
        done = []
        for rid in list(self.running):
            self.running[rid] += 1
            if self.running[rid] >= self.steps_needed:
                del self.running[rid]
                done.append(SimpleNamespace(request_id=rid, finished=True, n=self.steps))
        return done

    def set_weight_version(self, version: str) -> None:
        self.version = version


async def _endless(llm: InlineLLM, rid: str) -> asyncio.Future:
    """A request that never finishes, once the engine has stepped it twice."""
    task = asyncio.ensure_future(_final(llm, rid))
    while llm.steps < 2:
        await asyncio.sleep(0.01)
    return task


async def _final(llm: InlineLLM, rid: str) -> Any:
    params: Any = None  # the stand-in engine reads no sampling parameters
    outs = [out async for out in llm.generate({"prompt_token_ids": [1]}, params, request_id=rid)]
    assert len(outs) == 1  # only the final output
    return outs[0]


def test_requests_finish_on_the_engine_thread_and_a_pause_stops_stepping():
    async def run() -> None:
        engine = StandInEngine(steps_needed=3)
        llm = InlineLLM(engine)
        outs = await asyncio.gather(*(_final(llm, f"r{i}") for i in range(4)))
        assert [o.request_id for o in outs] == ["r0", "r1", "r2", "r3"]
        assert engine.threads == {"inline-engine"}  # vLLM is only touched by its thread
        await llm.pause_generation(mode="keep", clear_cache=True)
        assert engine.paused
        task = asyncio.ensure_future(_final(llm, "during-pause"))
        await asyncio.sleep(0.1)
        steps = engine.steps
        await asyncio.sleep(0.1)
        assert engine.steps == steps and not task.done()  # admitted, not stepped
        await llm.update_weight_version("7")
        await llm.resume_generation()
        assert (await task).request_id == "during-pause" and engine.version == "7"
        with pytest.raises(ValueError, match="keep mode only"):
            await llm.pause_generation(mode="abort")
        llm.shutdown()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_cancelled_request_is_aborted_in_the_engine():
    async def run() -> None:
        engine = StandInEngine(steps_needed=10**9)
        llm = InlineLLM(engine)
        task = await _endless(llm, "gone")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["gone"] and llm.in_flight == 0
        llm.shutdown()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_an_engine_that_dies_fails_every_waiter_with_one_error():
    async def run() -> None:
        engine = StandInEngine(steps_needed=100, fail_at_step=5)
        llm = InlineLLM(engine)
        tasks = [asyncio.ensure_future(_final(llm, f"r{i}")) for i in range(3)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "engine core died" in str(results[0])
        assert llm.errored
        with pytest.raises(EngineDeadError):  # later commands fail at once, not hang
            await llm.update_weight_version("1")
        with pytest.raises(EngineDeadError):
            await _final(llm, "late")
        llm.shutdown()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_shutdown_ends_waiting_requests():
    async def run() -> None:
        llm = InlineLLM(StandInEngine(steps_needed=10**9))
        task = await _endless(llm, "long")
        llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await task
        assert not llm.errored  # a shutdown is not an error

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_command_its_caller_gave_up_on_is_skipped_not_the_engines_death():
    """Found by fault hunts: a command cancelled by its caller (a timeout, a shutdown)
    before the engine thread ran it made setting its result raise, which the thread read as
    the engine's death ("inline vLLM engine failed; the server exits 4")."""

    async def run() -> None:
        engine = StandInEngine(steps_needed=10**9)
        llm = InlineLLM(engine)
        ran: list[str] = []
        gate = threading.Event()
        # The engine thread is held in a first command while the second is cancelled.
        first = llm._submit(lambda: gate.wait(5) and ran.append("first"))
        second = llm._submit(lambda: ran.append("second"))
        await asyncio.sleep(0.1)
        second.cancel()
        await asyncio.sleep(0.05)  # the cancel reaches the command's future
        gate.set()
        await first
        await llm.update_weight_version("3")  # the thread goes on taking commands
        assert ran == ["first"] and engine.version == "3" and not llm.errored
        llm.shutdown()

    asyncio.run(asyncio.wait_for(run(), 30))
