"""The staleness study's figures: one run's from its metrics, a cell's over seeds, and the
table. Pure functions (apart from reading ``metrics.jsonl``), tested in
``tests/test_staleness_stats.py``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.metrics import read_metrics, val_step, validation_rounds

# Two-sided 95% quantiles of Student's t by degrees of freedom (scipy is not a dependency).
# Student's t, 95% two-sided, by degrees of freedom; between two entries the lower one's
# (the wider interval). Past the last, the normal's 1.96 (within 1% of t).
_T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
    16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074,
    23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045,
    30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip
_T95_LARGE = 1.96
LATE_ROUNDS = 3


def t95(df: int) -> float:
    """The 95% two-sided Student-t quantile for ``df`` degrees of freedom (>= 1)."""
    if df < 1:
        raise ValueError(f"a confidence interval needs at least 2 values (df >= 1), got df={df}")
    if df > max(_T95):
        return _T95_LARGE
    return _T95[max(k for k in _T95 if k <= df)]


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
    """Mean of ``values`` and the half-width of its 95% t-interval (None for one value)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    if len(xs) == 1:
        return {"mean": xs[0], "ci95": None, "n": 1}
    half = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": statistics.fmean(xs), "ci95": half, "n": len(xs)}


def _mean_of(records: list[dict], key: str) -> float | None:
    xs = [r[key] for r in records if key in r and math.isfinite(r[key])]
    return statistics.fmean(xs) if xs else None


def late_score(curve: Sequence[Sequence[float]]) -> float:
    """The mean score of a curve's last :data:`LATE_ROUNDS` rounds."""
    return statistics.fmean(c[3] for c in curve[-LATE_ROUNDS:])


def peak_drop(curve: Sequence[Sequence[float]]) -> float:
    """How far the last round lies below the best one (0 when it is the best)."""
    return max(c[3] for c in curve) - curve[-1][3]


def run_figures(run: Path, *, samples_per_step: int, threshold: float) -> dict[str, Any]:
    """One run's figures from its ``metrics.jsonl``.

    ``curve`` lists every validation round as ``[step, samples, seconds, score]``
    (samples trained so far, seconds since the validation before training). ``final`` is
    the last round's score (the study validates at the last step), with its binomial
    standard error over the sampled answers (``final_se``) and the one over prompts
    (``final_se_prompt``); ``late`` is the mean of the last :data:`LATE_ROUNDS` rounds
    (the policy itself moves by several standard errors from round to round, so this is
    the steadier figure of where a run ended). Samples/s is over the training steps' span.
    """
    records = read_metrics(run)
    steps = [r for r in records if "loss/pg" in r]
    vals = validation_rounds(records)  # by the weights measured, not the step recorded at
    if not steps or not vals:
        raise ValueError(f"{run}: no training steps or no validation rounds in its metrics")
    t0 = vals[0]["time"]
    curve = [
        [val_step(r), val_step(r) * samples_per_step, r["time"] - t0, r["val/score"]] for r in vals
    ]
    reached = next((c for c in curve if c[3] >= threshold), None)
    span = steps[-1]["time"] - steps[0]["time"]
    return {
        "steps": len(steps),
        "curve": curve,
        "start": vals[0]["val/score"],
        "final": vals[-1]["val/score"],
        "final_step": val_step(vals[-1]),
        "late": late_score(curve),
        "peak_drop": peak_drop(curve),
        "final_se": vals[-1].get("val/score_se"),
        "final_se_prompt": vals[-1].get("val/score_se_prompt"),
        "samples_to_threshold": reached[1] if reached else None,
        "seconds_to_threshold": reached[2] if reached else None,
        "samples_per_s": (len(steps) - 1) * samples_per_step / span if span > 0 else None,
        "wall_s": steps[-1]["time"] - t0,
        "lag_drops": max(r.get("accounting/train/dropped/lag", 0.0) for r in records),
        "mean_lag": _mean_of(steps, "lag/mean"),
        "mean_ess": _mean_of(steps, "importance/ess"),
        "mean_mismatch_kl": _mean_of(steps, "importance/mismatch_kl"),
        "mean_truncated_frac": _mean_of(steps, "importance/truncated_frac"),
        "mean_lag_limit": _mean_of(steps, "staleness/lag_limit"),
        # The counters run through the run: the last step's (the run's last record, its
        # closing accounting, carries none).
        "health_alarms": sum(v for k, v in steps[-1].items() if k.startswith("health/")),
    }


SUMMED = (
    "final",
    "late",
    "peak_drop",
    "samples_to_threshold",
    "seconds_to_threshold",
    "samples_per_s",
    "lag_drops",
    "mean_lag",
    "mean_ess",
    "mean_mismatch_kl",
    "mean_lag_limit",
)


def cell_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A cell's figures over its seeds: mean and 95% CI of each figure in :data:`SUMMED`;
    a run that never reached the threshold counts in ``reached`` and not in the means."""
    out: dict[str, Any] = {"seeds": len(runs)}
    for key in SUMMED:
        out[key] = mean_ci([r[key] for r in runs if r.get(key) is not None])
    out["reached"] = sum(r["samples_to_threshold"] is not None for r in runs)
    out["final_se_max"] = max((r["final_se"] or 0.0) for r in runs) if runs else None
    return out


def paired_difference(
    cell: Sequence[dict], base: Sequence[dict], key: str = "final"
) -> dict[str, Any]:
    """Mean and 95% CI of ``key(cell) - key(base)`` paired by seed (same prompt order
    and sampling seeds), which removes what the seeds share."""
    by_seed = {r["seed"]: r[key] for r in base}
    diffs = [r[key] - by_seed[r["seed"]] for r in cell if r["seed"] in by_seed]
    return mean_ci(diffs)


def mean_curve(runs: Sequence[dict[str, Any]], axis: int) -> tuple[list[float], list[float]]:
    """The cell's score curve averaged over seeds, on the x of ``axis`` (1: samples,
    2: seconds) averaged too; rounds are matched by index (every run validates alike)."""
    rounds = min(len(r["curve"]) for r in runs)
    xs = [statistics.fmean(r["curve"][i][axis] for r in runs) for i in range(rounds)]
    ys = [statistics.fmean(r["curve"][i][3] for r in runs) for i in range(rounds)]
    return xs, ys


def _fmt(stat: dict[str, Any], spec: str, scale: float = 1.0) -> str:
    if stat["mean"] is None:
        return "-"
    text = format(stat["mean"] * scale, spec)
    if stat["ci95"] is None:
        return text
    return f"{text} ± {format(stat['ci95'] * scale, spec.lstrip('+'))}"


def markdown_table(
    cells: dict[str, dict[str, Any]],
    diffs: dict[str, dict[str, Any]],
    late_diffs: dict[str, dict[str, Any]],
) -> str:
    """The README's table: one row per cell, means ± 95% CI half-widths over seeds."""
    head = (
        "| cell | final score | vs lag 0 (paired) | last 3 rounds | vs lag 0 (paired) "
        "| best − final | samples to threshold (reached) "
        "| seconds to threshold | samples/s | lag drops | ESS | mismatch KL | lag limit |"
    )
    lines = [head, "|" + "---|" * 13]
    for name, c in cells.items():
        d, dl = diffs.get(name), late_diffs.get(name)
        lines.append(
            f"| {name} | {_fmt(c['final'], '.3f')} | {_fmt(d, '+.3f') if d else '-'} "
            f"| {_fmt(c['late'], '.3f')} | {_fmt(dl, '+.3f') if dl else '-'} "
            f"| {_fmt(c['peak_drop'], '.3f')} "
            f"| {_fmt(c['samples_to_threshold'], '.0f')} ({c['reached']}/{c['seeds']}) "
            f"| {_fmt(c['seconds_to_threshold'], '.0f')} | {_fmt(c['samples_per_s'], '.0f')} "
            f"| {_fmt(c['lag_drops'], '.1f')} | {_fmt(c['mean_ess'], '.3f')} "
            f"| {_fmt(c['mean_mismatch_kl'], '.4f')} | {_fmt(c['mean_lag_limit'], '.2f')} |"
        )
    return "\n".join(lines)
