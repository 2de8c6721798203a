"""The weight-sync benchmark's quick mode runs and follows the benchmark conventions."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys


def test_quick_mode_prints_ratio_and_writes_results(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_weight_sync.py", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"weight sync real/raw GB/s at bucket 32 MB \(goal >= 0.8\): "
        r"([\d.]+) \(min ([\d.]+), max ([\d.]+), (\d+) reps\)",
        last,
    )
    assert match, last
    median, low, high = (float(match.group(i)) for i in (1, 2, 3))
    assert low <= median <= high
    record = json.loads((tmp_path / "bench_weight_sync.json").read_text())
    assert record["hardware"]["cpu_count"] >= 1
    rows = record["figures"]["rows"]
    assert {r["bucket_mb"] for r in rows} >= {32}
    assert all(r["real_gb_s"] > 0 and r["raw_gb_s"] > 0 for r in rows)
    reps = next(r for r in rows if r["bucket_mb"] == 32)["reps"]
    # The repetitions behind the headline: an odd count of at least 3, one ratio each.
    assert int(match.group(4)) == reps["reps"] == record["config"]["reps"] >= 3
    assert reps["reps"] % 2 == 1
    assert len(reps["real"]) == len(reps["baseline"]) == len(reps["ratios"]) == reps["reps"]
    for real, raw, ratio in zip(reps["real"], reps["baseline"], reps["ratios"], strict=True):
        assert ratio == real / raw
    assert median == round(statistics.median(reps["ratios"]), 2)
    assert (low, high) == (round(min(reps["ratios"]), 2), round(max(reps["ratios"]), 2))
    assert (tmp_path / "bench_weight_sync.png").stat().st_size > 1000
