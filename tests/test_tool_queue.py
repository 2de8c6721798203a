"""How long tool calls wait for a free worker, with real worker processes.

Each tool worker runs one call at a time, async tools too: with
``rollout.multi_turn.tool_workers`` at its default of 2, eight episodes each awaiting a 1 s
remote call took 4 s or more, and the time queued counted nowhere (not in
``tool_timeout_s``, not in any metric, not in the log). The pool now totals it
(:attr:`ToolPool.queue_wait`) and says once, naming the key to raise, when a call waited long.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncrl.tools import ToolCall, ToolPool, ToolResult

NAP_TOOL = """
import asyncio

from asyncrl.tools import BaseTool


class NapTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(float(parameters["s"]))  # a remote call: waiting, not computing
        return "rested", None, {}
"""
NAP_S = 0.6  # each call's own time; the timeout (1 s) is past it, not past its wait
RESTED = ToolResult("rested", None, None)


@pytest.fixture
def one_worker(tmp_path: Path) -> Iterator[ToolPool]:
    (tmp_path / "nap.py").write_text(NAP_TOOL)
    schema = {"type": "function", "function": {"name": "nap", "parameters": {}}}
    tool = {"class_name": "nap.py:NapTool", "config": {}, "tool_schema": schema}
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [tool]}))
    with ToolPool(tmp_path / "tools.yaml", num_workers=1, timeout_s=1.0) as pool:
        yield pool


def test_turns_waiting_for_a_worker_are_measured_and_said_once(
    one_worker: ToolPool, caplog: pytest.LogCaptureFixture
) -> None:
    assert one_worker.queue_wait == {"total_s": 0.0, "max_s": 0.0}

    async def three_turns() -> list[list[ToolResult]]:
        call = [ToolCall("nap", {"s": NAP_S})]
        return await asyncio.gather(*(one_worker.call_many_async(call) for _ in range(3)))

    # The second turn waits for one nap, the third for two (past the 1 s timeout, which
    # counts only the call's own time: all three are answered).
    assert asyncio.run(three_turns()) == [[RESTED]] * 3
    waits = one_worker.queue_wait
    assert 3 * NAP_S - 0.1 <= waits["total_s"] < 3 * NAP_S + 1.0
    assert 2 * NAP_S - 0.05 <= waits["max_s"] < 2 * NAP_S + 0.6
    said = [r.getMessage() for r in caplog.records if "free tool worker" in r.getMessage()]
    assert len(said) == 1 and "raise rollout.multi_turn.tool_workers" in said[0]
    assert "the 1 workers" in said[0] and "tool_timeout_s" in said[0]
    # Cumulative, and said only once.
    assert asyncio.run(three_turns()) == [[RESTED]] * 3
    assert one_worker.queue_wait["total_s"] >= 2 * waits["total_s"] - 0.2
    assert sum("free tool worker" in r.getMessage() for r in caplog.records) == 1


MARK_TOOL = """
import asyncio
from pathlib import Path

from asyncrl.tools import BaseTool


class MarkTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        Path(parameters["mark"]).touch()  # it ran
        await asyncio.sleep(float(parameters["s"]))
        return "marked", None, {}
"""


def test_a_turn_given_up_while_it_waits_for_a_worker_runs_none_of_its_calls(
    tmp_path: Path,
) -> None:
    """Found by a review: an episode whose turn was cancelled (its deadline passed, a
    sibling failed the group) still had every call of the turn run through a worker, each
    up to tool_timeout_s, while live episodes waited for that worker."""
    (tmp_path / "mark.py").write_text(MARK_TOOL)
    schema = {"type": "function", "function": {"name": "mark", "parameters": {}}}
    tool = {"class_name": "mark.py:MarkTool", "config": {}, "tool_schema": schema}
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [tool]}))

    def call(name: str) -> ToolCall:
        return ToolCall("mark", {"s": NAP_S, "mark": str(tmp_path / name)})

    async def given_up(pool: ToolPool) -> None:
        # One worker: the turn's first call runs, the other two wait for it.
        turn = [call("first"), call("late-a"), call("late-b")]
        with pytest.raises(TimeoutError):  # given up while two calls still wait
            await pool.call_many_async(turn, wait_s=0.2)

    with ToolPool(tmp_path / "tools.yaml", num_workers=1, timeout_s=5.0) as pool:
        asyncio.run(given_up(pool))
        time.sleep(3 * NAP_S)  # the waiting calls would have run by now
        live = asyncio.run(pool.call_many_async([call("after")]))  # the worker is free
    assert live == [ToolResult("marked", None, None)]
    assert sorted(p.name for p in tmp_path.iterdir() if "." not in p.name) == ["after", "first"]


def test_calls_from_threads_are_measured_too(one_worker: ToolPool) -> None:
    # Callers of call() from their own threads queue for the worker as turns do.
    with ThreadPoolExecutor(3) as threads:
        results = list(threads.map(one_worker.call, [ToolCall("nap", {"s": NAP_S})] * 3))
    assert results == [RESTED] * 3
    waits = one_worker.queue_wait
    assert waits["total_s"] >= 3 * NAP_S - 0.1 and waits["max_s"] >= 2 * NAP_S - 0.05


def test_calls_refused_before_a_worker_wait_for_none(one_worker: ToolPool) -> None:
    assert one_worker.call(ToolCall("nope", {})).error == "unknown_tool"
    assert one_worker.call(ToolCall("nap", {"s": 0})) == RESTED
    assert one_worker.queue_wait["max_s"] < 0.5
