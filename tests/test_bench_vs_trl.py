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

from benchmarks import vs_trl
from benchmarks.vs_trl import Shape, end_to_end, summarise


@pytest.mark.slow
@pytest.mark.bench
def test_quick_mode_runs_both_sides_of_both_shapes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/vs_trl.py", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    last = lines[-1]
    # One repetition in quick mode (the documented exception): the headline says so.
    match = re.fullmatch(
        r"asyncrl / TRL samples/s, worst shape \(goal >= 1.0\): ([\d.]+) "
        r"\(min [\d.]+, max [\d.]+, 1 rep \(quick: not a measurement\)\)",
        last,
    )
    assert match, last
    for name in ("demo", "long"):  # the end-to-end ratio, before the headline
        assert any(line.startswith(f"{name}: asyncrl / TRL samples/s end to end") for line in lines)
    shapes = json.loads((tmp_path / "vs_trl.json").read_text())["figures"]["shapes"]
    assert set(shapes) == {"demo", "long"}
    for name, steps, new_tokens in (("demo", 20, 4), ("long", 4, 128)):
        shape = shapes[name]
        assert (shape["steps"], shape["max_new_tokens"]) == (steps, new_tokens)
        [run] = shape["runs"]
        assert run["seed"] == 1
        for side in ("trl", "asyncrl"):
            got = run[side]
            assert got["steps"] == steps, (name, side)
            assert len(got["rewards"]) == steps and all(map(math.isfinite, got["rewards"]))
            assert got["samples_per_s"] > 0 and got["to_step1_s"] > 0
            # from this script's launch of the side's process: start-up and the timed span
            assert got["launch_to_end_s"] >= got["to_step1_s"] + got["step1_to_end_s"] - 0.01
            assert 0 <= got["late_mean"] <= 1 and 0 <= got["score"] <= 1, (name, side)
            assert 0 < tokens_per_sample(got) <= new_tokens, (name, side)
        # The demo shape trains on-policy up to one step (lag 0 in pushes); the long shape
        # keeps the config's lag 1.
        assert run["asyncrl"]["lag_max"] <= (0 if name == "demo" else 1), name
        assert run["asyncrl"]["samples_per_s"] / run["trl"]["samples_per_s"] == pytest.approx(
            shape["samples_per_s_ratio"]["median"]
        )
    assert float(match.group(1)) == pytest.approx(
        min(s["samples_per_s_ratio"]["median"] for s in shapes.values()), abs=5e-3
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


def _side(samples_per_s: float, end_to_end_samples_per_s: float) -> dict:
    return {
        "samples_per_s": samples_per_s,
        "end_to_end_samples_per_s": end_to_end_samples_per_s,
        "score": 0.5,
        "late_mean": 0.5,
        "to_step1_s": 10.0,
        "launch_to_end_s": 40.0,
    }


def test_end_to_end_counts_every_step_from_launch():
    got = end_to_end(launched=100.0, last_end=164.0, steps=20)
    assert got == {"launch_to_end_s": 64.0, "end_to_end_samples_per_s": 20 * 16 * 8 / 64.0}


def test_a_shape_pairs_both_ratios_by_repetition_and_keeps_each_seed():
    runs = [
        {"seed": 1, "trl": _side(100.0, 50.0), "asyncrl": _side(120.0, 40.0)},
        {"seed": 2, "trl": _side(100.0, 50.0), "asyncrl": _side(90.0, 60.0)},
        {"seed": 3, "trl": _side(80.0, 40.0), "asyncrl": _side(100.0, 30.0)},
    ]
    got = summarise(Shape("demo", "m", 20, 4), runs)
    assert [r["seed"] for r in got["runs"]] == [1, 2, 3]
    assert got["samples_per_s_ratio"]["ratios"] == pytest.approx([1.2, 0.9, 1.25])
    assert got["samples_per_s_ratio"]["median"] == pytest.approx(1.2)
    # The end-to-end ratio is its own figure: start-up counted on both sides.
    e2e = got["end_to_end_samples_per_s_ratio"]
    assert e2e["ratios"] == pytest.approx([0.8, 1.2, 0.75])
    assert (e2e["median"], e2e["min"], e2e["max"], e2e["reps"]) == pytest.approx(
        (0.8, 0.75, 1.2, 3)
    )
    assert got["launch_to_end_s"] == {"trl": 40.0, "asyncrl": 40.0}


def test_quick_main_prints_end_to_end_then_a_headline_marked_not_a_measurement(
    monkeypatch, tmp_path, capsys
):
    """``main`` with both sides faked: the run record keeps the seed, the end-to-end line
    comes before the headline, and one quick repetition says it is not a measurement."""

    def fake(rate: float, e2e: float):
        def run(shape: Shape, *_args, seed: int) -> dict:
            side = _side(rate, e2e)
            side["rewards"] = [0.5] * shape.steps
            side["seed_seen"] = seed
            return side

        return run

    monkeypatch.setattr(vs_trl, "build_artifacts", lambda: None)
    monkeypatch.setattr(vs_trl, "run_trl", fake(100.0, 50.0))
    monkeypatch.setattr(vs_trl, "run_asyncrl", fake(110.0, 40.0))
    monkeypatch.setattr(
        sys, "argv", ["vs_trl.py", "--quick", "--shapes", "demo", "--out", str(tmp_path)]
    )
    vs_trl.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith(
        "demo: asyncrl / TRL samples/s end to end (launch to last step): "
        "0.80 (min 0.80, max 0.80, 1 rep (quick: not a measurement))"
    )
    assert lines[-1] == (
        "asyncrl / TRL samples/s, worst shape (goal >= 1.0): "
        "1.10 (min 1.10, max 1.10, 1 rep (quick: not a measurement))"
    )
    [run] = json.loads((tmp_path / "vs_trl.json").read_text())["figures"]["shapes"]["demo"]["runs"]
    assert run["seed"] == run["trl"]["seed_seen"] == run["asyncrl"]["seed_seen"] == 1


def test_both_sides_run_on_the_same_two_cores(monkeypatch, tmp_path):
    """Found by a review: TRL took every core of the machine (torch threads = cores, not
    pinned) while asyncrl was pinned to cores 0 and 1, so on a larger machine the ratio
    compared unequal hardware; on one whose affinity left out core 0 or 1 the pinning
    failed. Both sides now run on the first two cores this process may use."""
    from types import SimpleNamespace

    monkeypatch.setattr(vs_trl.os, "sched_getaffinity", lambda _pid: {9, 3, 5, 12})
    monkeypatch.setattr(vs_trl.os, "cpu_count", lambda: 16)  # a larger machine
    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_subprocess_run(cmd, **kwargs):
        seen["threads"] = cmd[cmd.index("--threads") + 1]
        seen["preexec"] = kwargs["preexec_fn"]
        raise Stop

    def fake_launch(_config, overrides, *_args):
        seen["cpus"] = next(o for o in overrides if o.startswith("launch.cpus="))
        raise Stop

    monkeypatch.setattr(vs_trl.subprocess, "run", fake_subprocess_run)
    monkeypatch.setattr(vs_trl, "launch_run", fake_launch)
    shape = SimpleNamespace(
        model="m", steps=3, max_new_tokens=4, reward_file=None, rollout_nice=0,
        overlap_push=False, enforce_eager=True, max_policy_lag=None,
    )  # fmt: skip
    with pytest.raises(Stop):
        vs_trl.run_trl(shape, tmp_path / "t.json", seed=1)  # type: ignore[arg-type]
    with pytest.raises(Stop):
        vs_trl.run_asyncrl(shape, tmp_path, "x", seed=1)  # type: ignore[arg-type]
    assert seen["threads"] == "2"
    assert seen["cpus"] == "launch.cpus={learner: [3], rollout: [[3], [5]], buffer: [3]}"
    pinned: list = []
    monkeypatch.setattr(vs_trl.os, "sched_setaffinity", lambda pid, cores: pinned.append(cores))
    seen["preexec"]()
    assert pinned == [[3, 5]]
