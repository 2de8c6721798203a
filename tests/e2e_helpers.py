"""What the end-to-end tests share: a run's command line, its overrides, and checks on it.

Every run uses the demo config with fresh ports, the run directory under the test's
``tmp_path``, and the demo's flattened tiny model (the one that learns in a few dozen
steps); the tests override what they exercise.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from tests.helpers import endpoint_overrides, log_tails

RUN = Path("asyncrl") / "cpu_demo"  # <default_local_dir>/<project>/<experiment>


def run_overrides(tmp_path: Path, model: Path, data_dir: Path, steps: int) -> list[str]:
    """Overrides that put a demo run on fresh ports, in ``tmp_path``, for ``steps`` steps."""
    return [
        f"model.path={model}",
        f"data.train_files={data_dir}/train.parquet",
        f"data.val_files={data_dir}/val.parquet",
        f"trainer.default_local_dir={tmp_path}",
        f"trainer.total_training_steps={steps}",
        "launch.start_timeout_s=240",
        *endpoint_overrides(),
    ]


def wait_for_step(proc: subprocess.Popen, run: Path, log: Path, n: int, timeout_s: float) -> None:
    """Wait until the launched run has trained step ``n``; fail at once, with the
    launcher's output and the roles' logs, if the launcher ended before."""
    from asyncrl.metrics import read_metrics
    from tests.helpers import wait_until

    def reached() -> bool:
        if proc.poll() is not None:
            raise AssertionError(log.read_text()[-3000:] + role_logs(run))
        return run.exists() and any(r["step"] >= n for r in trained_steps(read_metrics(run)))

    wait_until(reached, f"step {n}", timeout_s, every_s=0.5)


def launch_cmd(overrides: list[str], config: str = "configs/cpu_demo.yaml") -> list[str]:
    return [sys.executable, "-m", "asyncrl.launch", config, *overrides]


def role_logs(run: Path) -> str:
    """The last lines of every role's log, for assertion messages."""
    return log_tails(run / "logs")


def trained_steps(records: list[dict]) -> list[dict]:
    """The learner's per-step records (the ones with a policy-gradient loss)."""
    return [r for r in records if "loss/pg" in r]


def rollout_wait_fraction(records: list[dict], skip: int = 1) -> float:
    """Share of the servers' time spent idle waiting for tasks or paused for a sync, between
    the end of step ``skip`` and the last step (from their cumulative totals; the engines'
    start-up is outside the window)."""
    steps = trained_steps(records)
    a, b = steps[skip - 1], steps[-1]
    waited = sum(b[k] - a[k] for k in ("rollout/task_wait_s", "rollout/sync_pause_s"))
    return waited / (b["rollout/servers_reporting"] * (b["time"] - a["time"]))


def validation(records: list[dict]) -> list[tuple[int, float, float]]:
    """``(step, score, standard error)`` of every validation round, in order."""
    return [
        (r["step"], r["val/score"], r.get("val/score_se", math.nan))
        for r in records
        if "val/score" in r
    ]


def assert_learned(records: list[dict]) -> None:
    """The last validation score beats the first by more than 2 standard errors of the
    difference (validation prompts are disjoint from training ones)."""
    vals = validation(records)
    assert len(vals) >= 2, vals
    (_, first, se0), (_, last, se1) = vals[0], vals[-1]
    se = math.hypot(se0, se1)
    assert se > 0 and last - first > 2 * se, f"validation {first:.3f} -> {last:.3f}, SE {se:.3f}"


def assert_vllm_loads(path: Path) -> None:
    """vLLM (CPU) loads the exported HF checkpoint and generates from it."""
    code = (
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={str(path)!r}, dtype='float32', enforce_eager=True, max_model_len=64)\n"
        "out = llm.generate(['1+2='], SamplingParams(max_tokens=2, temperature=0))\n"
        "print('generated', len(out[0].outputs[0].token_ids))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "generated" in proc.stdout, proc.stderr[-2000:]
