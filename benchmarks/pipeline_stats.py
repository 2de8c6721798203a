"""Figures of a pipeline run from its metrics, and the scheduler model's prediction of it
calibrated on the phases measured alone. Pure apart from reading ``metrics.jsonl``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.metrics import read_metrics
from benchmarks.sim_model import simulate
from benchmarks.sim_types import ResponseLengths, SimParams

WARMUP_STEPS = 3  # the first steps include the engines' start-up and first allocations


def run_stats(run: Path, *, target: float | None = None) -> dict[str, float]:
    """Steady-state figures of one run over its steps after :data:`WARMUP_STEPS`.

    Rates are per second of wall time between the end of the last warm-up step and the end
    of the last step. ``rollout_wait_frac`` is the servers' time waiting for tasks or paused
    for a sync over that window (from their cumulative totals), per server.
    """
    records = read_metrics(run)
    steps = [r for r in records if "loss/pg" in r]
    if len(steps) <= WARMUP_STEPS + 1:
        raise ValueError(f"{run}: {len(steps)} steps, need more than {WARMUP_STEPS + 1}")
    first, window = steps[WARMUP_STEPS - 1], steps[WARMUP_STEPS:]
    span = window[-1]["time"] - first["time"]
    samples = sum(r["batch/sequences"] for r in window)
    response = sum(r["batch/response_tokens"] for r in window)
    prompt = sum(r["prompt_length/mean"] * r["batch/sequences"] for r in window)
    out = {
        "steps": len(steps),
        "window_s": span,
        "step_s": span / len(window),
        "samples_per_s": samples / span,
        "trained_tokens_per_s": (prompt + response) / span,
        "trained_response_tokens_per_s": response / span,
        "learner_wait_frac": sum(r["timing/wait_batch_s"] for r in window) / span,
        # A push reports in the record of the step it ended in (pushes overlap the next
        # step), and only steps that push have one (staleness.sync_every).
        "sync_s_per_version": _mean(
            [r["timing/weight_sync_s"] for r in window if "timing/weight_sync_s" in r]
        ),
        "mean_lag": _mean([r["lag/mean"] for r in window]),
        "response_len_mean": response / samples,
        "lag_drops": max((r.get("buffer/drops/lag", 0.0) for r in records), default=0.0),
    }
    a, b = first, window[-1]
    if "rollout/tokens" in a and "rollout/tokens" in b:
        servers = max(1.0, b.get("rollout/servers_reporting", 1.0))
        waited = (
            b["rollout/task_wait_s"]
            + b["rollout/sync_pause_s"]
            - a["rollout/task_wait_s"]
            - a["rollout/sync_pause_s"]
        )
        out["generated_tokens_per_s"] = (b["rollout/tokens"] - a["rollout/tokens"]) / span
        out["rollout_wait_frac"] = waited / (servers * span)
    if target is not None:
        out["time_to_target_s"] = _time_to(records, target)
    return out


def _time_to(records: list[dict], target: float) -> float:
    """Seconds from the validation before training to the first score at or above
    ``target`` (NaN if never reached)."""
    vals = [r for r in records if "val/score" in r]
    if not vals:
        return math.nan
    for r in vals:
        if r["val/score"] >= target:
            return r["time"] - vals[0]["time"]
    return math.nan


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def decode_costs(gen: dict[str, Any]) -> tuple[float, float]:
    """``(fixed, per_sequence)`` seconds of one decode step, from generation alone at two
    concurrencies: at ``c`` sequences in flight a step makes ``c`` tokens, so
    ``t_step(c) = c / tokens_per_s(c)``; a line through the two points."""
    points = sorted((int(c), int(c) / f["tokens_per_s"]) for c, f in gen["concurrency"].items())
    (c1, t1), (c2, t2) = points[0], points[-1]
    per_seq = max(0.0, (t2 - t1) / (c2 - c1)) if c2 > c1 else t1 / c1
    return max(0.0, t1 - per_seq * c1), per_seq


def calibrate(cfg: Config, phases: dict[str, Any], *, servers_per_core: int) -> SimParams:
    """Scheduler-model parameters from the phases measured alone, for the run's layout:
    ``rollout.num_servers`` engines sharing ``num_servers / servers_per_core`` cores (each
    engine's step cost scales by ``servers_per_core``: they take turns on the core),
    the learner on one core, one sync as measured alone."""
    gen, train, sync = phases["generate@1"], phases["train@0"], phases["sync@1"]
    fixed, per_seq = decode_costs(gen)
    lengths = ResponseLengths(empirical=tuple(max(1, x) for x in gen["response_lengths"]))
    prompt_len = round(train["prompt_len_mean"])
    tokens = train["tokens_per_s"] * train["step_s"]  # prompt + response tokens of one step
    return SimParams(
        num_servers=cfg.rollout.num_servers,
        max_num_seqs=cfg.rollout.max_inflight,
        n=cfg.rollout.n,
        train_batch_size=cfg.data.train_batch_size,
        sync_every=cfg.staleness.sync_every,
        tasks_per_request=cfg.control.tasks_per_request,
        decode_fixed_s=fixed * servers_per_core,
        decode_per_seq_s=per_seq * servers_per_core,
        train_s_per_token=train["step_s"] / tokens,
        lengths=lengths,
        prompt_length=prompt_len,
        sync_fixed_s=sync["sync_s"],
    )


def predict(params: SimParams, lag: int, steps: int) -> dict[str, float]:
    """The model's figures for one mode of the sweep."""
    res = simulate(params, max_policy_lag=lag, steps=steps, seed=0)
    return {
        "samples_per_s": res.samples_per_s,
        "learner_wait_frac": res.learner_wait_frac,
        "rollout_wait_frac": res.rollout_wait_frac,
        "mean_lag": res.mean_lag,
    }
