"""Batch-level metrics computed from the rollouts themselves (pure), the exact reduction of
loss stats over micro-batches and ranks, and a step's summary of the rollout servers'
heartbeat metrics.

Names use slash namespaces; ``learner/METRICS.md`` maps them to veRL's.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

import torch

from asyncrl.control.server_totals import COUNTER_PREFIXES, COUNTERS, is_counter
from learner.losses import STAT_MAXES, STAT_SUMS
from learner.rollouts import Rollout, drop_reason

# Lags at or above this share the last histogram bin (``lag/hist_ge8``).
LAG_BINS = 8


def reward_part_metrics(
    parts: Sequence[Mapping[str, float]],
    rollouts: Sequence[Rollout] | None = None,
    max_len: int | None = None,
) -> dict[str, float]:
    """``reward/parts/<name>/mean``: the mean of each value the scorer returned beside the
    score (a dict's other keys, the overlong penalty), over the trajectories carrying it.
    With ``rollouts`` (one per part), over those the trainer keeps
    (:func:`~learner.rollouts.clean_rollouts` with ``max_len``), as ``reward/mean`` is."""
    if rollouts is not None:
        pairs = zip(parts, rollouts, strict=True)
        parts = [p for p, r in pairs if drop_reason(r, max_len) is None]
    sums: dict[str, list[float]] = {}
    for trajectory in parts:
        for name, value in trajectory.items():
            sums.setdefault(name, []).append(float(value))
    return {f"reward/parts/{name}/mean": statistics.fmean(v) for name, v in sorted(sums.items())}


def rollout_metrics(rollouts: Sequence[Rollout], current_version: int) -> dict[str, float]:
    """Reward, lengths and policy lag of the rollouts a step trains on.

    Lag = ``current_version`` - the oldest version among a rollout's tokens (docs/DESIGN.md
    section 4); rollouts without version spans are left out of the lag metrics.
    """
    if not rollouts:
        return {}
    rewards = [float(r.reward) for r in rollouts]
    resp = [len(r.response_ids) for r in rollouts]
    prompt = [len(r.prompt_ids) for r in rollouts]
    out = {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "response_length/mean": statistics.fmean(resp),
        "response_length/max": float(max(resp)),
        "response_length/min": float(min(resp)),
        "prompt_length/mean": statistics.fmean(prompt),
        "batch/sequences": float(len(rollouts)),
        "batch/groups": float(len({r.group_id for r in rollouts})),
        "batch/response_tokens": float(sum(resp)),
    }
    lags = [current_version - r.oldest_version for r in rollouts if r.oldest_version is not None]
    if lags:
        out["lag/mean"] = statistics.fmean(lags)
        out["lag/max"] = float(max(lags))
        for b in range(LAG_BINS):
            out[f"lag/hist_{b}"] = float(sum(1 for x in lags if x == b))
        out[f"lag/hist_ge{LAG_BINS}"] = float(sum(1 for x in lags if x >= LAG_BINS))
    return out


def zero_variance_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> int:
    """Groups (of two or more) whose rewards are all equal: their GRPO advantage is 0."""
    n = 0
    for g in torch.unique(group_index).tolist():
        r = rewards[group_index == g]
        n += int(r.numel() > 1 and bool((r == r[0]).all()))
    return n


class StatSum:
    """Accumulates :func:`learner.losses.policy_loss` stats: sums and maxima."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(STAT_SUMS, 0.0)
        self.maxes = dict.fromkeys(STAT_MAXES, 0.0)

    def add(self, stats: dict[str, torch.Tensor], real: bool = True) -> None:
        """Add one micro-batch's stats; a dummy micro-batch (``real=False``) is ignored."""
        if not real:
            return
        for k in STAT_SUMS:
            self.sums[k] += float(stats[k])
        for k in STAT_MAXES:
            self.maxes[k] = max(self.maxes[k], float(stats[k]))

    def all_reduce(self, group=None, device: torch.device | str = "cpu") -> dict[str, float]:
        """Combine across the ranks of ``group`` (sums summed, maxima maxed); returns one
        flat dict. Without an initialised process group, the local values. ``device`` must
        suit the backend (CUDA for NCCL)."""
        import torch.distributed as dist

        sums = torch.tensor([self.sums[k] for k in STAT_SUMS], dtype=torch.float64, device=device)
        maxes = torch.tensor(
            [self.maxes[k] for k in STAT_MAXES], dtype=torch.float64, device=device
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        out = dict(zip(STAT_SUMS, sums.tolist(), strict=True))
        out.update(zip(STAT_MAXES, maxes.tolist(), strict=True))
        return out


def mean_of(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.fmean(vals) if vals else 0.0


def rollout_summary(
    servers: Mapping[str, Mapping[str, float]], totals: Mapping[str, float] | None = None
) -> dict[str, float]:
    """``rollout/...`` of a step's record from the rollout servers' heartbeat metrics
    (server id -> metrics): the counters (:data:`~asyncrl.control.server_totals.COUNTERS`,
    the agents' and the endpoint's) from ``totals``, the coordinator's run totals over
    every server process (summed over the live servers without it: they fall when one
    restarts); rates and ``inflight`` summed, fractions averaged, over the live servers."""
    reports = [m for m in servers.values() if m]
    out: dict[str, float] = {}
    if totals is not None:  # cumulative: rates and waits over any window are differences
        out.update({k: v for k, v in totals.items() if is_counter(k)})
    if not reports:  # no server reports now (all restarting, or the learner just started)
        return out | ({"rollout/servers_reporting": 0.0} if totals is not None else {})
    out["rollout/tokens_per_s"] = sum(m.get("rollout/tokens_per_s", 0.0) for m in reports)
    out["rollout/inflight"] = sum(m.get("rollout/inflight", 0.0) for m in reports)  # now
    if totals is None:
        for key in COUNTERS:
            out[key] = sum(m.get(key, 0.0) for m in reports)
        for m in reports:
            for key, value in m.items():
                if key.startswith(COUNTER_PREFIXES):
                    out[key] = out.get(key, 0.0) + value
    out["rollout/servers_reporting"] = len(reports)
    # 0 when any server's loop does not run with its start-up heap frozen.
    out["rollout/gc_frozen_objects_min"] = min(
        m.get("rollout/gc_frozen_objects", 0.0) for m in reports
    )
    means = ("wait_fraction", "score_wait_fraction", "reward_mean", "response_length_mean")
    for key in (f"rollout/{k}" for k in means):
        values = [m[key] for m in reports if key in m]
        if values:
            out[key] = sum(values) / len(values)
    return out
