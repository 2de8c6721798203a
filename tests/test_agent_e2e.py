"""The agent demo's config end to end through ``asyncrl-launch`` (shortened): episodes with
tool calls on two real CPU vLLM servers, tools in worker processes, the learner training on
the masked samples; the run ends, every dealt task is accounted for, and the buffer's
rollout log shows the tool answers as masked spans."""

from __future__ import annotations

import subprocess

import pyarrow.parquet as pq
import pytest

from asyncrl.metrics import read_metrics
from tests.e2e_helpers import launch_cmd, role_logs, run_overrides, trained_steps

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.mark.timeout(600)
def test_agent_demo_config_runs_and_trains(tmp_path, agent_model):
    from asyncrl.tasks import prepare_task_data

    data = tmp_path / "data"
    prepare_task_data("calculator", data, n_train=400, n_val=8, seed=0)
    overrides = [
        *run_overrides(tmp_path, agent_model, data, STEPS),
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "buffer.log_rollouts=true",
    ]
    cmd = launch_cmd(overrides, config="configs/cpu_agent_demo.yaml")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    run = tmp_path / "asyncrl" / "cpu_agent_demo"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + role_logs(run)
    records = read_metrics(run)
    steps = trained_steps(records)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    acct = records[-1]
    assert acct["accounting/train/trained"] == STEPS * 16  # groups (of 8 episodes)
    for kind in ("train", "val"):  # every dealt task is somewhere, exactly once
        assert acct[f"accounting/{kind}/unaccounted"] == 0, acct
    assert all(r["batch/dropped_length_mismatch"] == 0 for r in steps)
    # The agents' counters reach the run's records (the README names them), growing.
    episodes = [r.get("rollout/agent/episodes", 0.0) for r in steps]
    assert episodes[-1] > 0 and steps[-1].get("rollout/agent/tool_calls", 0.0) > 0, steps[-1]
    assert steps[-1]["rollout/agent/turns"] >= episodes[-1]
    rows = pq.read_table(run / "rollouts").to_pylist()
    assert rows and all(r["data_source"] == "calculator" for r in rows)
    assert any(r["masked_spans"] for r in rows), "no episode called a tool"
