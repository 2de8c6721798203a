"""Shared fixtures: locally built models and data (built once per session with the real
CLI), a one-rank process group; and running the console scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# vLLM on CPU claims most of RAM for its KV cache unless told otherwise.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BIN = Path(sys.executable).parent


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a console script of this project; fail the test with its output on error."""
    proc = subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The warm-started tiny model, built by ``asyncrl-prepare model --name tiny``."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    run_cli("asyncrl-prepare", "model", "--name", "tiny", "--out", str(out))
    return out


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The demo's tiny model (trained, then flattened: it learns in a few dozen RL steps),
    built by ``asyncrl-prepare model --name tiny --flatten`` as ``make demo`` does."""
    out = tmp_path_factory.mktemp("models") / "tiny-demo"
    run_cli("asyncrl-prepare", "model", "--name", "tiny", "--flatten", "--out", str(out))
    return out


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory) -> Path:
    """The tiny model with a short warm start on calculator episodes (it writes tool
    calls, not always right ones), built by ``asyncrl-prepare model --task calculator``."""
    out = tmp_path_factory.mktemp("models") / "tiny-agent"
    run_cli(
        "asyncrl-prepare", "model", "--name", "tiny", "--task", "calculator",
        "--sft-steps", "150", "--out", str(out),
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> Path:
    """The demo's prompt files (train and validation prompts disjoint)."""
    from asyncrl.tasks import prepare_task_data

    out = tmp_path_factory.mktemp("data")
    prepare_task_data("arithmetic", out, seed=0)
    return out


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """The ~24M-parameter model (random weights), built by ``asyncrl-prepare model``."""
    out = tmp_path_factory.mktemp("models") / "small"
    run_cli("asyncrl-prepare", "model", "--name", "small", "--out", str(out))
    return out


@pytest.fixture(scope="module")
def single_rank():
    """A one-rank default process group in this process (removed after the module)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def prepare_report(model_dir: Path) -> dict:
    return json.loads((model_dir / "prepare_report.json").read_text())
