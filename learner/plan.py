"""How one step's batch is cut for this rank: mini-batches of whole groups, each split into
micro-batches across the ranks, with the global loss normalisers of each mini-batch. Pure:
the actor and the critic cut their batches with the same rule (their own batch sizes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from learner.batching import Rollout, group_indices, minibatches, norm_counts, plan_minibatch
from learner.losses import AggNorm


def plan_step(
    rollouts: Sequence[Rollout],
    groups_per_minibatch: int,
    *,
    world_size: int,
    rank: int,
    padded: bool,
    max_seqs: int | None = None,
    max_tokens: int | None = None,
) -> tuple[list[list[list[int]]], list[AggNorm]]:
    """This rank's micro-batches (sequence indices) of every mini-batch of
    ``groups_per_minibatch`` groups, and each mini-batch's global normalisers.

    A micro-batch holds at most ``max_seqs`` sequences, or (dynamic batch size) at most
    ``max_tokens`` tokens; ``padded`` counts a padded micro-batch's tokens as its longest
    row times its rows."""
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    budget = {"max_tokens": max_tokens} if max_tokens is not None else {"max_seqs": max_seqs}
    mbs, norms = [], []
    for idx in minibatches(group_indices(rollouts), groups_per_minibatch):
        plan = plan_minibatch(idx, lengths, world_size, padded=padded, **budget)
        mbs.append(plan[rank])
        tokens, seqs = norm_counts(rollouts, idx)
        norms.append(AggNorm(num_tokens=max(tokens, 1), num_seqs=max(seqs, 1)))
    return mbs, norms


@dataclass
class StepPlan:
    """One step's work: the cleaned batch and, per mini-batch, this rank's micro-batches."""

    rollouts: list[Rollout]
    advantages: torch.Tensor  # [N]
    temperature: float  # for rollouts that do not say what they were sampled at
    minibatches: list[list[list[int]]]  # mini-batch -> micro-batch -> sequence indices
    norms: list[AggNorm]  # one per mini-batch (global counts)
    token_advantages: dict[int, torch.Tensor] | None = None  # GAE: [T_i] per sequence
