"""The learner's service loop as a real process (``python -m learner.main``) with the buffer
service and stand-in rollout servers that receive its weights: it trains, pushes a version
per step, checkpoints, and ends the run. Killed after a checkpoint and started again with
``trainer.resume_mode=auto``, it continues at the checkpointed step + 1, its first push
carries a version above any the servers hold, versions keep counting up, and every
validation round is reported whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl.metrics import METRICS_FILE, read_metrics
from asyncrl.tasks import prepare_task_data
from tests.helpers import wait_until
from tests.standins import rollout
from tests.standins.learner import loopback_config, spawn_buffer
from tests.standins.rollout import read_journal

pytestmark = pytest.mark.slow

TOTAL = 6


def _learner(config: Path, log: Path) -> subprocess.Popen:
    out = open(log, "a")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "learner.main", str(config)], stdout=out, stderr=subprocess.STDOUT
    )


def _config(tmp_path: Path, tiny_model: Path, *overrides: str) -> tuple[Any, Path]:
    """A loopback run of the tiny model on arithmetic data in ``tmp_path`` (4 groups of 2
    per step, 4-token responses, no validation), with ``overrides`` on top."""
    prepare_task_data("arithmetic", tmp_path / "data", seed=0)
    return loopback_config(
        tmp_path,
        [
            f"model.path={tiny_model}",
            f"data.train_files={tmp_path}/data/train.parquet",
            f"data.val_files={tmp_path}/data/val.parquet",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=2",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            "control.heartbeat_s=0.3",
            "launch.start_timeout_s=120",
            "sync.timeout_s=30",
            *overrides,
        ],
    )


def _syncs(journal: Path) -> list[dict]:
    return [e for e in read_journal(str(journal)) if e["event"] == "sync" and e["ok"]]


@pytest.mark.timeout(600)
def test_learner_trains_checkpoints_resumes_and_ends_the_run(tmp_path, tiny_model):
    cfg, config = _config(
        tmp_path,
        tiny_model,
        f"trainer.total_training_steps={TOTAL}",
        "trainer.save_freq=2",
        "trainer.test_freq=2",  # a round due at each checkpoint: the resume must deal it
        "control.dead_after_s=3",
    )
    from asyncrl.config import run_dir

    run = run_dir(cfg)
    procs = {"buffer": spawn_buffer(config, tmp_path / "buffer.log")}
    journals = {}
    for sid in ("s0", "s1"):
        journals[sid] = tmp_path / f"{sid}.jsonl"
        procs[sid] = rollout.spawn(
            config, sid, journal=journals[sid], weights=True, log_path=tmp_path / f"{sid}.log"
        )
    learner = _learner(config, tmp_path / "learner.log")
    try:
        # Stop the learner hard once a checkpoint exists and it has trained past it.
        wait_until(lambda: (run / "checkpoints" / "step_2").is_dir(), "the step-2 checkpoint", 240)
        wait_until(
            lambda: max((r["step"] for r in read_metrics(run)), default=0) >= 3, "step 3", 240
        )
        learner.kill()
        learner.wait(30)
        before = {sid: max(e["version"] for e in _syncs(j)) for sid, j in journals.items()}
        seen = {sid: len(_syncs(j)) for sid, j in journals.items()}

        learner = _learner(config, tmp_path / "learner.log")
        assert learner.wait(300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        codes = {name: p.wait(30) for name, p in procs.items()}
        assert codes == {"buffer": 0, "s0": 0, "s1": 0}
    finally:
        for p in [learner, *procs.values()]:
            if p.poll() is None:
                p.kill()

    # The file keeps both lives; the killed learner's steps past its checkpoint show again.
    raw = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    steps = [r["step"] for r in raw if "loss/pg" in r]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart] == 3, steps  # the checkpoint held step 2: training resumes at 3
    assert steps[-1] == TOTAL
    # The readers show each step once: the resume's record supersedes the lost ones.
    (resumed,) = [r for r in raw if "learner/resumed_from_step" in r]
    assert resumed["learner/resumed_from_step"] == 2 and resumed["learner/steps_reached"] >= 3
    shown = [r["step"] for r in read_metrics(run) if "loss/pg" in r]
    assert shown == list(range(1, TOTAL + 1)), shown
    for sid, journal in journals.items():
        after = [e["version"] for e in _syncs(journal)[seen[sid] :]]
        assert after and after[0] > before[sid], (sid, before[sid], after)
        assert after == sorted(after)  # versions keep counting up
    assert (run / "final" / "model.safetensors").is_file()
    # Validation across the restart: each round (steps 2, 4, 6) reported whole, never two
    # rounds' sums mixed, and the run's end waited for none that could not complete. A
    # round the killed learner reported after its checkpoint is reported again.
    import pyarrow.parquet as pq

    round_size = pq.read_metadata(tmp_path / "data" / "val.parquet").num_rows
    vals = [r for r in read_metrics(run) if "val/score" in r]
    assert vals and all(r["val/responses"] == round_size for r in vals), vals
    assert {r["step"] for r in vals} >= {4, TOTAL}, vals
    assert "incomplete after" not in (tmp_path / "learner.log").read_text()
    # The run's last push is collected by the run's end: its results are in the final record
    assert "timing/weight_sync_s" in raw[-1] and "accounting/train/dealt" in raw[-1], raw[-1]
    # Each round says the step whose weights it measured (it is logged a step or two later)
    assert all(r["val/step"] <= r["step"] for r in vals), vals


@pytest.mark.timeout(600)
def test_without_intermediate_checkpoints_a_small_buffer_runs_to_the_end(tmp_path, tiny_model):
    """Reproduces defect 1 of the dependable-runs issue: with ``trainer.save_freq=-1`` (veRL's
    default) the learner acknowledged batches only at checkpoints, so the released batches
    filled ``buffer.capacity_groups``, the buffer stopped reading and the run hung. Here the
    buffer holds half of the groups the run trains on: the run must reach its last step."""
    total, batch = 6, 4
    cfg, config = _config(
        tmp_path,
        tiny_model,
        f"data.train_batch_size={batch}",
        f"actor.ppo_mini_batch_size={batch}",
        "staleness.max_policy_lag=1",
        f"buffer.capacity_groups={3 * batch}",
        f"trainer.total_training_steps={total}",
        "trainer.save_freq=-1",
        "control.dead_after_s=3",
    )
    assert cfg.buffer.capacity_groups < total * batch
    from asyncrl.config import run_dir

    procs = {
        "buffer": spawn_buffer(config, tmp_path / "buffer.log"),
        "s0": rollout.spawn(config, "s0", weights=True, log_path=tmp_path / "s0.log"),
    }
    learner = _learner(config, tmp_path / "learner.log")
    try:
        try:
            code = learner.wait(180)
        except subprocess.TimeoutExpired:
            steps = [r["step"] for r in read_metrics(run_dir(cfg)) if "loss/pg" in r]
            pytest.fail(f"the learner hung after steps {steps} (want {total})")
        assert code == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert {name: p.wait(30) for name, p in procs.items()} == {"buffer": 0, "s0": 0}
    finally:
        for p in [learner, *procs.values()]:
            if p.poll() is None:
                p.kill()

    rows = [r for r in read_metrics(run_dir(cfg)) if "loss/pg" in r]
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    # Each batch was acknowledged right after training on it: when the learner asked for
    # the batch of step k, the k - 1 batches before it were acknowledged already.
    assert [r["buffer/batches_acked"] for r in rows] == list(range(total))
    # With no intermediate checkpoint the only one is the final one.
    assert [p.name for p in (run_dir(cfg) / "checkpoints").iterdir()] == [f"step_{total}"]


@pytest.mark.timeout(600)
def test_a_health_alarm_with_action_stop_ends_the_run_with_a_checkpoint(tmp_path, tiny_model):
    """A threshold every step crosses (the mean importance weight, about 1, required in
    [5, 10]): the first step alarms, the learner saves, ends the run (the servers and the
    buffer exit 0) and exits 5, which the launcher does not restart."""
    cfg, config = _config(
        tmp_path,
        tiny_model,
        f"trainer.total_training_steps={TOTAL}",
        "trainer.save_freq=-1",
        "trainer.test_freq=5",
        "trainer.health.action=stop",
        "trainer.health.patience=1",
        "trainer.health.w_mean_range=[5,10]",
    )
    from asyncrl.config import run_dir

    run = run_dir(cfg)
    procs = {"buffer": spawn_buffer(config, tmp_path / "buffer.log")}
    procs["s0"] = rollout.spawn(config, "s0", weights=True, log_path=tmp_path / "s0.log")
    learner = _learner(config, tmp_path / "learner.log")
    try:
        log = tmp_path / "learner.log"
        assert learner.wait(300) == 5, log.read_text()[-3000:]
        assert {name: p.wait(30) for name, p in procs.items()} == {"buffer": 0, "s0": 0}
    finally:
        for p in [learner, *procs.values()]:
            if p.poll() is None:
                p.kill()
    text = log.read_text()
    assert "health: step 1: importance/w_mean=" in text and "outside [5, 10]" in text, text
    assert "the run stopped at step 1 on importance/w_mean" in text
    steps = [r for r in read_metrics(run) if "loss/pg" in r]
    assert [r["step"] for r in steps] == [1] and steps[0]["health/w_mean"] == 1
    assert (run / "checkpoints" / "step_1").is_dir()
    # The weights that alarmed are not exported: no final/ a user would take as the result.
    assert not (run / "final").exists()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "waits_for_the_send"])
def test_the_post_sync_probe_names_a_server_whose_weights_arrived_corrupted(
    tmp_path, tiny_model, overlap
):
    """Two stand-in servers score the post-sync probe with the weights they received; from
    version 2 on, s1 flips a received tensor (as a corrupt bucket would). s0's probe agrees
    with the learner's; s1's is caught at version 2's push, named, within one step. A
    learner that waits for each push (``sync.overlap_push=false``) waits for the send only:
    the servers' reports, with their probes, reach it at the next push all the same."""
    cfg, config = _config(
        tmp_path,
        tiny_model,
        "trainer.total_training_steps=4",
        "trainer.save_freq=-1",
        f"sync.overlap_push={str(overlap).lower()}",
    )
    from asyncrl.config import run_dir

    procs = {"buffer": spawn_buffer(config, tmp_path / "buffer.log")}
    for sid, corrupt in (("s0", None), ("s1", 2)):
        procs[sid] = rollout.spawn(
            config, sid, weights=True, probe=True, corrupt_from=corrupt,
            log_path=tmp_path / f"{sid}.log",
        )  # fmt: skip
    log = tmp_path / "learner.log"
    learner = _learner(config, log)
    try:
        assert learner.wait(300) == 0, log.read_text()[-3000:]
    finally:
        for p in [learner, *procs.values()]:
            if p.poll() is None:
                p.kill()
    text = log.read_text()
    named = [line for line in text.splitlines() if " scores it " in line]
    assert named and all(": s1 scores it" in n for n in named), named  # never s0
    assert "probe after version 2: s1" in named[0], named
    steps = [r for r in read_metrics(run_dir(cfg)) if "loss/pg" in r]
    probed = [
        (r["step"], r["sync/probe_mean_abs_diff"]) for r in steps if "sync/probe_servers" in r
    ]
    assert probed[0][0] == 2 and probed[0][1] < 0.05, probed  # version 1: both agree
    assert probed[1][0] == 3 and probed[1][1] > 0.1, probed  # version 2's, the next step
    assert steps[-1]["health/max_probe_diff"] >= 1
    assert "trainer.health.max_probe_diff" in text
