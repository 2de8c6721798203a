"""``benchmarks/vs_trl.py --quick`` runs both sides of both shapes and follows the benchmark
conventions. The ratio is a measurement, not a test: it is only printed. TRL comes with
``make install`` (the ``bench`` extra)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quick_mode_runs_both_sides_of_both_shapes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/vs_trl.py", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"asyncrl / TRL samples/s, worst shape \(goal >= 1.0\): ([\d.]+)", last)
    assert match, last
    shapes = json.loads((tmp_path / "vs_trl.json").read_text())["figures"]["shapes"]
    assert set(shapes) == {"demo", "long"}
    for name, steps, new_tokens in (("demo", 20, 4), ("long", 4, 128)):
        shape = shapes[name]
        assert (shape["steps"], shape["max_new_tokens"]) == (steps, new_tokens)
        [run] = shape["runs"]
        for side in ("trl", "asyncrl"):
            got = run[side]
            assert got["steps"] == steps, (name, side)
            assert len(got["rewards"]) == steps and all(map(math.isfinite, got["rewards"]))
            assert got["samples_per_s"] > 0 and got["to_step1_s"] > 0
            assert 0 <= got["late_mean"] <= 1 and 0 <= got["score"] <= 1, (name, side)
            assert 0 < tokens_per_sample(got) <= new_tokens, (name, side)
        # The demo shape trains on-policy up to one step (lag 0 in pushes); the long shape
        # keeps the config's lag 1.
        assert run["asyncrl"]["lag_max"] <= (0 if name == "demo" else 1), name
        assert run["asyncrl"]["samples_per_s"] / run["trl"]["samples_per_s"] == pytest.approx(
            shape["samples_per_s_ratio"]["median"]
        )
    assert float(match.group(1)) == pytest.approx(
        min(s["samples_per_s_ratio"]["median"] for s in shapes.values()), abs=5e-4
    )
    # Long answers on both sides (the untrained model rarely stops early): many more
    # tokens per sample than the demo's.
    long_run, demo_run = shapes["long"]["runs"][0], shapes["demo"]["runs"][0]
    for side in ("trl", "asyncrl"):
        assert tokens_per_sample(long_run[side]) > 8 * tokens_per_sample(demo_run[side]), side
    assert (tmp_path / "vs_trl.png").stat().st_size > 1000


def tokens_per_sample(figures: dict) -> float:
    """Mean response tokens per sample over the timed steps of one side's run."""
    return figures["response_tokens_per_s"] / figures["samples_per_s"]
