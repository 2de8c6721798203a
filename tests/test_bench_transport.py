"""The transport benchmark's quick mode runs and follows the benchmark conventions."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_quick_mode_prints_ratio_and_writes_results(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_transport.py", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"transport buffer/raw trajectories per s: "
        r"([\d.]+) \(min ([\d.]+), max ([\d.]+), (\d+) reps\)",
        last,
    )
    assert match, last
    median, low, high = (float(match.group(i)) for i in (1, 2, 3))
    assert low <= median <= high
    record = json.loads((tmp_path / "bench_transport.json").read_text())
    figures = record["figures"]
    reps = figures["ratio_stats"]
    # The repetitions behind the headline: an odd count of at least 3, one ratio each,
    # paired with the rounds of both paths.
    assert int(match.group(4)) == reps["reps"] == record["config"]["rounds"] >= 3
    assert reps["reps"] % 2 == 1
    for path, key in (("buffer", "real"), ("raw", "baseline")):
        rounds = [r["traj_per_s"] for r in figures["rounds"] if r["path"] == path]
        assert rounds == reps[key]
    for buffer, raw, ratio in zip(reps["real"], reps["baseline"], reps["ratios"], strict=True):
        assert ratio == buffer / raw
    assert median == round(statistics.median(reps["ratios"]), 2) == round(figures["ratio"], 2)
    assert (low, high) == (round(min(reps["ratios"]), 2), round(max(reps["ratios"]), 2))
    assert figures["buffer_traj_per_s"] > 0 and figures["raw_traj_per_s"] > 0
    assert record["hardware"]["cpu_count"] >= 1 and record["versions"]["pyzmq"]
    assert record["config"]["quick"] is True
    assert (tmp_path / "bench_transport.png").stat().st_size > 1000
