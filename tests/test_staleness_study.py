"""The staleness study: its figures from a run's metrics (pure), and its quick mode end to
end (real launches of the study's task at lags 0 and 4)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.staleness_stats import (
    cell_summary,
    markdown_table,
    mean_ci,
    paired_difference,
    run_figures,
)


def _write_run(path: Path, scores: list[float], *, lag_drops: float = 0.0) -> Path:
    """A run's metrics: validation every 10 steps (``scores``), one record per step."""
    path.mkdir(parents=True)
    lines = []
    for step in range(0, 10 * (len(scores) - 1) + 1):
        rec = {"step": step, "time": 100.0 + 2.0 * step}
        if step:
            rec.update({"loss/pg": 0.1, "lag/mean": 1.0, "importance/ess": 0.9})
            rec["importance/mismatch_kl"] = 0.01
            rec["accounting/train/dropped/lag"] = lag_drops * step / 100
            rec["health/min_ess"] = 1.0 if step >= 5 else 0.0  # counted so far, as the learner
        lines.append(json.dumps(rec))
        if step % 10 == 0:
            val = {"step": step, "time": 100.0 + 2.0 * step + 1.0}
            val.update({"val/score": scores[step // 10], "val/score_se": 0.008})
            lines.append(json.dumps(val))
    last = 10 * (len(scores) - 1)  # the run's closing record: its accounting, no step metrics
    lines.append(
        json.dumps({"step": last, "time": 100.0 + 2.0 * last + 2.0, "accounting/dealt": 1})
    )
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_run_figures_read_the_curve_threshold_and_rates(tmp_path):
    run = _write_run(tmp_path / "r", [0.2, 0.35, 0.45, 0.5], lag_drops=10)
    f = run_figures(run, samples_per_step=128, threshold=0.4)
    assert f["start"] == 0.2 and f["final"] == 0.5 and f["final_step"] == 30
    assert f["late"] == pytest.approx((0.35 + 0.45 + 0.5) / 3) and f["peak_drop"] == 0.0
    assert [c[0] for c in f["curve"]] == [0, 10, 20, 30]
    # first at or above 0.4: the round at step 20 (2,560 samples, 40 s after the first round)
    assert f["samples_to_threshold"] == 20 * 128
    assert f["seconds_to_threshold"] == pytest.approx(40.0)
    # 30 steps, 2 s apart: 29 steps' samples over 58 s
    assert f["samples_per_s"] == pytest.approx(29 * 128 / 58)
    assert f["lag_drops"] == pytest.approx(3.0) and f["mean_ess"] == pytest.approx(0.9)
    # The last step's counters (a review: the closing record's, which carries none, read 0).
    assert f["health_alarms"] == 1.0
    never = run_figures(run, samples_per_step=128, threshold=0.9)
    assert never["samples_to_threshold"] is None and never["seconds_to_threshold"] is None


def test_a_run_without_validation_is_refused(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss/pg": 0.1}) + "\n")
    with pytest.raises(ValueError, match="no training steps or no validation"):
        run_figures(run, samples_per_step=1, threshold=0.5)


def test_mean_ci_is_the_t_interval():
    got = mean_ci([0.5, 0.6, 0.7])
    # sd 0.1, n 3: 4.303 * 0.1 / sqrt(3)
    assert got["mean"] == pytest.approx(0.6) and got["ci95"] == pytest.approx(0.24844, rel=1e-4)
    assert mean_ci([0.4]) == {"mean": 0.4, "ci95": None, "n": 1}
    assert mean_ci([]) == {"mean": None, "ci95": None, "n": 0}
    assert mean_ci([0.1, math.nan, 0.3])["n"] == 2
    # A review: from 12 values the interval took the normal's 1.96, 6-11% too narrow.
    from benchmarks.staleness_stats import t95

    assert [t95(df) for df in (10, 11, 15, 20, 30)] == [2.228, 2.201, 2.131, 2.086, 2.042]
    assert t95(45) == 2.021 and t95(119) == 2.000 and t95(500) == 1.96


def test_paired_difference_matches_seeds_and_the_table_shows_it():
    base = [{"seed": s, "final": f} for s, f in ((1, 0.5), (2, 0.6), (3, 0.4))]
    cell = [{"seed": s, "final": f} for s, f in ((3, 0.42), (1, 0.52), (2, 0.62))]
    d = paired_difference(cell, base)
    assert d["mean"] == pytest.approx(0.02) and d["ci95"] == pytest.approx(0.0, abs=1e-12)
    runs = [
        {
            "final": f,
            "late": f - 0.1,
            "peak_drop": 0.05,
            "samples_to_threshold": None,
            "seconds_to_threshold": None,
            "final_se": 0.01,
        }
        for f in (0.42, 0.52, 0.62)
    ]
    summary = cell_summary(runs)
    assert summary["reached"] == 0 and summary["final"]["mean"] == pytest.approx(0.52)
    table = markdown_table({"lag4_tis": summary}, {"lag4_tis": d}, {})
    assert (
        "| lag4_tis | 0.520 ± 0.248 | +0.020 ± 0.000 | 0.420 ± 0.248 | - | 0.050 ± 0.000 | - (0/3) |"
        in table
    )


@pytest.mark.slow
@pytest.mark.bench
def test_quick_study_learns_at_both_lags_and_writes_its_table(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "benchmarks/staleness_study.py", "--quick",
            "--out", str(out), "--artifacts", str(tmp_path / "artifacts"),
        ],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("staleness lag4_tis/lag0 final score")
    record = json.loads((out / "staleness_study.json").read_text())
    runs = record["figures"]["runs"]
    assert set(runs) == {"lag0_tis", "lag4_tis"}
    for name, (run,) in runs.items():
        # 20 steps lift the held-out score well past its sampling error (~0.009)
        assert run["final"] > run["start"] + 0.05, (name, run["curve"])
        assert run["final_se"] < 0.01, run
    assert runs["lag0_tis"][0]["mean_lag"] == 0.0 and runs["lag4_tis"][0]["mean_lag"] > 1.0
    assert (out / "table.md").read_text().startswith("| cell | final score")
    assert (out / "staleness_study.png").stat().st_size > 0


def test_the_plot_gives_each_lag_its_own_colour():
    """The quick study's two curves (lag 0 and lag 4, one mode each) were drawn in the
    same colour and style: the colour came from the curve's position, two modes a lag."""
    from matplotlib.figure import Figure

    from benchmarks import staleness_study

    run = {"curve": [[0, 10.0, 1.0, 0.2], [1, 20.0, 2.0, 0.4]]}
    fig = Figure()
    staleness_study._plot({"lag0_tis": [run], "lag4_tis": [run]}, 0.5)(fig)
    lines = {
        ln.get_label(): ln.get_color()
        for ln in fig.axes[0].get_lines()
        if ln.get_label().startswith("lag")
    }
    assert lines["lag0_tis"] != lines["lag4_tis"]
