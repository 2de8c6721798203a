"""A rollout server's tool metrics, as its heartbeat carries them: a real server loop, its
agent's episodes calling tools in real worker processes (stand-in engine, scorer, pusher
and coordinator client).

A tool whose step reward was not a finite number (NaN, a string) was counted by the tool
pool and said once in the server's log, but never reached the run's metrics: a tool that
returned NaN on every call looked as sound as any other on the dashboard. It is the
cumulative ``rollout/agent/tool_bad_rewards`` now, next to ``rollout/agent/tool_errors/...``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.tools import ENVIRONMENT_ERRORS, ToolCall, ToolPool
from rollout_servers import agent as agent_module
from rollout_servers.server import RolloutServer
from tests.helpers import wait_until_async
from tests.standins.chat import CharTokenizer
from tests.standins.server_parts import (
    N,
    StandInPusher,
    StandInScorer,
    SyncingClient,
    ToolCallingEngine,
    agent_runner,
)

BAD_REWARD_TOOL = """
from asyncrl.tools import BaseTool


class NapTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        # NaN, then a string: neither is a step reward; the answer reaches the model.
        return "rested", float("nan") if self.calls % 2 else "high", {}
"""
TASKS = 2  # groups of N episodes, one tool call each


@pytest.fixture
def bad_reward_tools(tmp_path: Path) -> Iterator[ToolPool]:
    """One tool worker whose ``nap`` tool (what :class:`ToolCallingEngine` calls) answers
    with an unreadable step reward."""
    (tmp_path / "nap.py").write_text(BAD_REWARD_TOOL)
    schema = {"type": "function", "function": {"name": "nap", "parameters": {}}}
    tool = {"class_name": "nap.py:NapTool", "config": {}, "tool_schema": schema}
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [tool]}))
    with ToolPool(tmp_path / "tools.yaml", num_workers=1, timeout_s=10.0) as pool:
        yield pool


def test_tool_step_rewards_that_are_not_numbers_reach_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch, bad_reward_tools: ToolPool
) -> None:
    monkeypatch.setattr(agent_module, "turn_params", lambda *args: None)
    calls = TASKS * N

    async def scenario() -> dict[str, float]:
        client, engine = SyncingClient(tasks=TASKS), ToolCallingEngine()
        cfg = load_config(None, [f"rollout.n={N}"])
        parts = (engine, CharTokenizer(), StandInScorer(), StandInPusher(), client)
        agent = agent_runner(engine, bad_reward_tools)
        srv = RolloutServer(cfg, "s", *parts, agent=agent)
        run = asyncio.create_task(srv.run())
        await wait_until_async(lambda: len(client.acked) == TASKS, "every group", 20)
        # What the next heartbeat sends: the task loop's report, every REPORT_EVERY_S.
        reported = lambda: client.metrics.get("rollout/agent/tool_calls") == calls  # noqa: E731
        await wait_until_async(reported, "a report after the last group", 5)
        srv.stop()
        assert await asyncio.wait_for(run, 5.0) == 0
        return client.metrics

    metrics = asyncio.run(scenario())
    assert metrics["rollout/agent/tool_bad_rewards"] == calls
    # The answers were kept: no call failed.
    errors = {k: v for k, v in metrics.items() if k.startswith("rollout/agent/tool_errors/")}
    assert not any(errors.values()), errors


HUNGRY_TOOL = """
from asyncrl.tools import BaseTool


class HungryTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        size = int(parameters["mb"]) << 20
        block = bytearray(size)
        block[:: 1 << 12] = b"x" * len(block[:: 1 << 12])  # touched: really resident
        return f"held {len(block) >> 20} MB", None, {}
"""


def test_a_tool_past_its_memory_cap_is_an_environment_error_and_the_next_call_runs(
    tmp_path: Path,
) -> None:
    """The tool workers had no memory cap where the scorers have reward.max_memory_mb: a
    tool that ran away grew without bound. A call past
    rollout.multi_turn.tool_max_memory_mb now answers the model with an error, counted as
    out_of_memory (an environment error), and a fresh worker takes the next call."""
    (tmp_path / "hungry.py").write_text(HUNGRY_TOOL)
    schema = {"type": "function", "function": {"name": "eat", "parameters": {}}}
    tool = {"class_name": "hungry.py:HungryTool", "config": {}, "tool_schema": schema}
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [tool]}))
    with ToolPool(
        tmp_path / "tools.yaml", num_workers=1, timeout_s=30.0, max_memory_mb=300
    ) as pool:
        first = {w.process.pid for w in pool._pool._workers}
        over = pool.call(ToolCall("eat", {"mb": 1024}))
        assert over.error == "out_of_memory" and over.text == "Error: tool 'eat' ran out of memory"
        assert "out_of_memory" in ENVIRONMENT_ERRORS
        under = pool.call(ToolCall("eat", {"mb": 100}))
        assert (under.text, under.error) == ("held 100 MB", None)
        assert not first & {w.process.pid for w in pool._pool._workers}  # replaced
        assert pool.counters["out_of_memory"] == 1
    cfg = load_config(None, [])
    assert cfg.rollout.multi_turn.tool_max_memory_mb == 8192
