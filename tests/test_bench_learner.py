"""The learner benchmark's quick mode runs and follows the benchmark conventions (the
ratio itself is a measurement, not a test: it is only printed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.bench
def test_quick_mode_prints_the_ratio_and_writes_results(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_learner.py", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    pattern = (
        r"learner trainer/bare step time, auto layout on both sides, worst case "
        r"\(goal <= 1.3\): "
        r"([\d.]+) \(min ([\d.]+), max ([\d.]+), 3 reps\)"
    )
    match = re.fullmatch(pattern, last)
    assert match, last
    record = json.loads((tmp_path / "bench_learner.json").read_text())
    rows = record["figures"]["rows"]
    assert {r["layout"] for r in rows} == {"padded", "packed", "shared"}
    assert all(r["trainer_s"] > 0 and r["bare_s"] > 0 for r in rows)
    auto = [r for r in rows if r["auto"]]
    assert [r["layout"] for r in auto] == ["shared"]  # SDPA on CPU
    # shared rows compute each prompt once: fewer token slots than the batch's tokens
    assert auto[0]["pad_ratio"] < 1.0
    assert [r["pad_ratio"] > 1.0 for r in rows if r["layout"] == "padded"] == [True]
    assert [r["pad_ratio"] for r in rows if r["layout"] == "packed"] == [1.0]
    assert float(match.group(1)) == round(auto[0]["stats"]["median"], 2)
    # Like with like: the bare loop runs each pair in the trainer's layout, shared rows
    # included (one row per prompt), so the ratio is the trainer's overhead alone.
    assert all(r["bare_layout"] == r["layout"] for r in rows)
    assert [r["bare_rows"] for r in auto] == [16]  # 16 prompts x 8 samples in 16 rows
    assert [r["bare_rows"] for r in rows if r["layout"] == "padded"] == [128]
    # The layout's gain is its own figure: the bare loop padded against shared.
    [gain] = record["figures"]["layout_gain"]
    assert (gain["model"], gain["cores"], gain["stats"]["reps"]) == ("tiny", 1, 3)
    assert all(x > 0 for x in gain["stats"]["ratios"])
    assert re.search(r"layout gain, bare padded/shared step time [\d.]+ \(min", proc.stdout)
    hardware = record["hardware"]
    # The cores at start are kept though the benchmark pinned itself to one.
    assert hardware["cpus_pinned"] == 1 and hardware["cpus_usable"] >= 1
    assert (tmp_path / "bench_learner.png").stat().st_size > 1000
