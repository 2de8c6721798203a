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
