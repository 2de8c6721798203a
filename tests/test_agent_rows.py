"""Which agent a data row runs under. veRL's multi-turn datasets (its gsm8k with tools,
for one) name no ``agent_name``: its multi-turn rollout ran every row with the tools. So
with ``rollout.multi_turn.enable`` on, a row without the column is a ``tool_agent``
episode; a row that names its agent keeps it, and with multi-turn off the default stays
``single_turn``."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from asyncrl.config import load_config
from asyncrl.control.setup import task_source_from_config


def _row(i: int, agent: str | None = None) -> dict[str, Any]:
    row = {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"{i} + 1 ="}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }
    return row | ({"agent_name": agent} if agent else {})


@pytest.mark.parametrize(("multi_turn", "default"), [(True, "tool_agent"), (False, "single_turn")])
def test_rows_without_an_agent_run_the_tools_when_multi_turn_is_on(multi_turn, default):
    cfg = load_config(
        None,
        [
            f"rollout.multi_turn.enable={str(multi_turn).lower()}",
            "rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml",
            "data.shuffle=false",
            "trainer.test_freq=2",
        ],
    )
    rows = [_row(0), _row(1, "single_turn"), _row(2, "tool_agent")]
    source = task_source_from_config(cfg, rows, [_row(3)])
    trained = [source.next_train() for _ in rows]
    assert [t.agent_name for t in trained if t is not None] == [
        default,
        "single_turn",
        "tool_agent",
    ]
    source.start_validation()
    val = source.next_val()
    assert val is not None and val.agent_name == default


def test_tool_agent_rows_with_multi_turn_off_are_said_to_run_single_turn(caplog):
    cfg = load_config(None, ["data.shuffle=false"])
    rows = [_row(0, "tool_agent"), _row(1), _row(2, "tool_agent")]
    with caplog.at_level(logging.WARNING, logger="asyncrl.control.setup"):
        task_source_from_config(cfg, rows, [])
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("2 of 3 training rows name agent_name tool_agent"), line
    assert "rollout.multi_turn.enable=true" in line
    caplog.clear()
    on = load_config(None, ["rollout.multi_turn.enable=true", "data.shuffle=false"])
    with caplog.at_level(logging.WARNING, logger="asyncrl.control.setup"):
        task_source_from_config(on, rows, [])
    assert caplog.records == []
