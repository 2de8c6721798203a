"""``make gpu-check`` (benchmarks/gpu_check.py) on a machine without a GPU: its table with
every GPU item skipped for its reason, exit 0; an item that ran and failed makes it exit 1;
and the learner-only part, run as its CPU twin (the same production code on gloo, float32,
two ranks), passes here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/gpu_check.py"
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")


def _run(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )
    out = Path(args[args.index("--out") + 1])
    report = json.loads((out / "gpu_check.json").read_text()) if proc.returncode in (0, 1) else {}
    return proc, report


@no_gpu_only
def test_without_a_gpu_every_item_is_skipped_and_it_exits_0(tmp_path):
    proc, report = _run("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = report["items"]
    assert [r["status"] for r in rows] == ["skipped"] * 9
    assert all(r["detail"] == "no CUDA GPU visible" for r in rows)
    assert report["gpus"] == [] and report["date"]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("item") and "status" in lines[1] and "detail" in lines[1]
    names = (
        "pytest -m gpu",
        "learner: FSDP2 steps (bf16 on cuda, group cpu:gloo,cuda:nccl)",
        "weight push",
        "checkpoint save and load",
        "CPU offload of actor and reference",
        "end to end: configs/gpu_smoke.yaml",
    )
    for name in names:
        assert any(name in ln and "skipped" in ln for ln in lines), name


def test_an_item_that_ran_and_failed_makes_it_exit_1(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_check

    failed = [gpu_check.item("learner: FSDP2 steps", "failed", "RuntimeError: boom")]
    monkeypatch.setattr(gpu_check, "learner_part", lambda *a: failed)
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert "failed   RuntimeError: boom" in capsys.readouterr().out


def test_the_gpu_smoke_config_loads():
    from asyncrl.config import load_config

    cfg = load_config(str(ROOT / "configs/gpu_smoke.yaml"), [])
    assert (cfg.trainer.device, cfg.model.dtype) == ("cuda", "bfloat16")


@no_gpu_only
def test_the_learner_part_runs_as_its_cpu_twin(tmp_path):
    """Trainer steps on two gloo ranks with the batch shared by rank 0, the group's
    collectives, checkpoint save and load, and a push to a stand-in receiver process."""
    model = tmp_path / "tiny"
    run_cli(
        "asyncrl-prepare", "model", "--name", "tiny", "--warm-start", "off", "--out", str(model)
    )
    proc, report = _run("--learner-device", "cpu", "--model", str(model), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    status = {r["item"]: r["status"] for r in report["items"]}
    learner = {k: v for k, v in status.items() if k.startswith("learner:")}
    assert list(learner.values()) == ["passed"] * 7, proc.stdout
    assert "learner: FSDP2 steps (float32 on cpu, group gloo)" in learner
    assert "2 rank(s)" in proc.stdout
    assert status["pytest -m gpu"] == "skipped"
