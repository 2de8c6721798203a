"""How one step's batch is cut for this rank: mini-batches of whole groups, each split into
micro-batches across the ranks, with the global loss normalisers of each mini-batch.

:func:`plan_step` is the entry (the actor and the critic cut their batches with the same
rule, their own batch sizes) and :class:`StepPlan` what the trainer keeps of it; below them
the rules it applies: :func:`minibatches` (runs of whole groups), :func:`plan_minibatch`
(:func:`shard` across the ranks, then :func:`micro_batches` per rank) and
:func:`norm_counts` (the normalisers).

Pure (torch tensors, no model, no process group). The learner receives the *global* batch
on every rank; every rank computes the same plan and keeps its own share, so no extra
collective is needed and the same global batch gives the same result on 1 or N ranks (the
loss normalisers are global, see :class:`learner.reductions.AggNorm`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from asyncrl.config.logprob import LogProbPass
from asyncrl.config.policy import ActorConfig
from learner.reductions import AggNorm
from learner.rollouts import Rollout, episode_key, group_indices


def plan_step(
    rollouts: Sequence[Rollout],
    groups_per_minibatch: int,
    *,
    world_size: int,
    rank: int,
    padded: bool,
    max_seqs: int | None = None,
    max_tokens: int | None = None,
    shared: bool = False,
) -> tuple[list[list[list[int]]], list[AggNorm]]:
    """This rank's micro-batches (sequence indices) of every mini-batch of
    ``groups_per_minibatch`` groups, and each mini-batch's global normalisers.

    A micro-batch holds at most ``max_seqs`` sequences, or (dynamic batch size) at most
    ``max_tokens`` tokens; ``padded`` counts a padded micro-batch's tokens as its longest
    row times its rows; ``shared`` (the shared layout, padded too) keeps a group's samples
    together, so that its prompt is computed once."""
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in rollouts]
    budget = {"max_tokens": max_tokens} if max_tokens is not None else {"max_seqs": max_seqs}
    index = group_indices(rollouts)
    groups = index.tolist() if shared else None
    mbs, norms = [], []
    for idx in minibatches(index, groups_per_minibatch):
        plan = plan_minibatch(idx, lengths, world_size, padded=padded, groups=groups, **budget)
        mbs.append(plan[rank])
        tokens, seqs = norm_counts(rollouts, idx)
        norms.append(
            AggNorm(
                num_tokens=max(tokens, 1),
                num_seqs=max(seqs, 1),
                seq_tokens=episode_tokens(rollouts, idx),
                episodes=split_episodes(rollouts, idx),
            )
        )
    return mbs, norms


def plan_passes(
    rollouts: Sequence[Rollout],
    actor: ActorConfig,
    passes: dict[str, LogProbPass],
    *,
    world_size: int,
    rank: int,
    padded: bool,
    shared: bool = False,
) -> tuple[list[list[list[int]]], list[AggNorm], dict[str, list[list[int]]]]:
    """:func:`plan_step` under the actor's training budget (``actor.ppo_*``), and the
    micro-batches of each no-grad pass (``rollout.log_prob_*``, ``ref.log_prob_*``) whose
    own budget differs. A pass covers this rank's training shard: :func:`plan_step`'s shards
    do not depend on the budget."""
    seqs, tokens = actor.ppo_micro_batch_size_per_gpu, actor.ppo_max_token_len_per_gpu
    train = (None, tokens) if actor.use_dynamic_bsz else (seqs, None)

    def plan(budget: tuple[int | None, int | None]):
        return plan_step(
            rollouts,
            actor.ppo_mini_batch_size,
            world_size=world_size,
            rank=rank,
            padded=padded,
            max_seqs=budget[0],
            max_tokens=budget[1],
            shared=shared,
        )

    mbs, norms = plan(train)
    own = {}
    for which, lp in passes.items():
        budget = lp.budget(seqs, actor.use_dynamic_bsz, tokens)
        if budget != train:
            own[which] = [micro for mini in plan(budget)[0] for micro in mini]
    return mbs, norms, own


@dataclass
class StepPlan:
    """One step's work: the cleaned batch and, per mini-batch, this rank's micro-batches;
    the no-grad passes' own micro-batches where their budget differs from training's."""

    rollouts: list[Rollout]
    advantages: torch.Tensor  # [N]
    temperature: float  # for rollouts that do not say what they were sampled at
    minibatches: list[list[list[int]]]  # mini-batch -> micro-batch -> sequence indices
    norms: list[AggNorm]  # one per mini-batch (global counts)
    token_advantages: dict[int, torch.Tensor] | None = None  # GAE: [T_i] per sequence
    pass_micros: dict[str, list[list[int]]] | None = None  # "proximal"/"ref" -> micro-batches

    def micros_for(self, which: str) -> list[list[int]]:
        """The micro-batches of the no-grad pass ``which`` (the training ones by default)."""
        if self.pass_micros and which in self.pass_micros:
            return self.pass_micros[which]
        return [micro for mini in self.minibatches for micro in mini]


def minibatches(group_index: torch.Tensor, groups_per_minibatch: int) -> list[list[int]]:
    """Sequence indices of each mini-batch: consecutive runs of ``groups_per_minibatch``
    groups (``actor.ppo_mini_batch_size`` counts prompts, as in veRL). The last may be
    smaller when the batch lost groups."""
    if groups_per_minibatch <= 0:
        raise ValueError("groups_per_minibatch must be positive")
    n_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    out = []
    for start in range(0, n_groups, groups_per_minibatch):
        sel = (group_index >= start) & (group_index < start + groups_per_minibatch)
        out.append(torch.nonzero(sel).flatten().tolist())
    return out


def shard(indices: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split ``indices`` across ranks: counts differ by at most one, tokens balanced.

    Longest first, each to the least-loaded rank that still has room (a deterministic
    greedy, so every rank computes the same split). Returns one list per rank, in the
    original order of ``indices``.
    """
    cap = math.ceil(len(indices) / world_size) if indices else 0
    order = sorted(range(len(indices)), key=lambda k: (-lengths[k], k))
    loads = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for k in order:
        rank = min(
            (r for r in range(world_size) if len(owned[r]) < cap), key=lambda r: (loads[r], r)
        )
        owned[rank].append(k)
        loads[rank] += lengths[k]
    return [[indices[k] for k in sorted(ks)] for ks in owned]


def micro_batches(
    indices: Sequence[int],
    lengths: Sequence[int],
    *,
    max_tokens: int | None = None,
    max_seqs: int | None = None,
    padded: bool = False,
    groups: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group ``indices`` into micro-batches; ``lengths[k]`` belongs to ``indices[k]``.

    With ``max_tokens`` (dynamic batch size) the budget counts what the model is fed: for
    packed rows the real tokens (first-fit decreasing), for ``padded`` ones ``rows x
    longest row`` (longest first, so each micro-batch holds sequences of similar length and
    padding stays small). A sequence longer than the budget goes alone. Without it, runs of
    ``max_seqs`` sequences; ``padded`` sorts them by length first, for the same reason.
    ``groups`` (``groups[k]``: the group of ``indices[k]``; the shared layout) keeps each
    group's samples next to each other in that order (:func:`_longest_first`).
    """
    if max_tokens is None:
        if not max_seqs or max_seqs <= 0:
            raise ValueError("give max_tokens or a positive max_seqs")
        idx = list(indices)
        if padded:
            idx = [indices[k] for k in _longest_first(lengths, groups)]
        return [idx[i : i + max_seqs] for i in range(0, len(idx), max_seqs)]
    if padded:
        return _padded_bins(indices, lengths, max_tokens, groups)
    bins: list[list[int]] = []
    loads: list[int] = []
    for k in _longest_first(lengths):
        for b, load in enumerate(loads):
            if load + lengths[k] <= max_tokens:
                bins[b].append(indices[k])
                loads[b] += lengths[k]
                break
        else:
            bins.append([indices[k]])
            loads.append(lengths[k])
    return bins


def _longest_first(lengths: Sequence[int], groups: Sequence[int] | None = None) -> list[int]:
    """Positions longest first; with ``groups``, a group's samples together (groups by
    their longest sample, then each longest first). Sorted by length alone, the shared
    layout's micro-batches held a prompt's samples apart, each computing the prompt again:
    3.2x the tokens fed in a review's GRPO-shaped batch of long prompts."""
    if groups is None:
        return sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    longest: dict[int, int] = {}
    first: dict[int, int] = {}
    for k, g in enumerate(groups):
        longest[g] = max(longest.get(g, 0), lengths[k])
        first.setdefault(g, k)
    return sorted(
        range(len(lengths)),
        key=lambda k: (-longest[groups[k]], first[groups[k]], -lengths[k], k),
    )


def _padded_bins(
    indices: Sequence[int],
    lengths: Sequence[int],
    max_tokens: int,
    groups: Sequence[int] | None = None,
) -> list[list[int]]:
    """Consecutive runs of the sequences in :func:`_longest_first`'s order whose padded
    size (rows x the longest row) fits ``max_tokens``."""
    bins: list[list[int]] = []
    width = 0
    for k in _longest_first(lengths, groups):
        wider = max(width, lengths[k])  # by groups, a later row may be the longer one
        if bins and (len(bins[-1]) + 1) * wider <= max_tokens:
            bins[-1].append(indices[k])
            width = wider
        else:
            bins.append([indices[k]])
            width = lengths[k]
    return bins


def plan_minibatch(
    indices: Sequence[int],
    lengths: Sequence[int],
    world_size: int,
    *,
    max_tokens: int | None = None,
    max_seqs: int | None = None,
    padded: bool = False,
    groups: Sequence[int] | None = None,
) -> list[list[list[int]]]:
    """Per rank, the micro-batches of one mini-batch, every rank with the same count
    (``padded``: the micro-batches are padded rows, see :func:`micro_batches`; ``groups``,
    indexed as ``lengths``: each sequence's group, kept together).

    Ranks must run the same number of forward/backward passes (FSDP's collectives happen
    inside them), so shorter plans are padded with empty micro-batches, which the trainer
    runs as a zero-weight dummy. ``lengths`` is indexed by sequence index (global).
    """
    plans = []
    for part in shard(indices, [lengths[i] for i in indices], world_size):
        plans.append(
            micro_batches(
                part,
                [lengths[i] for i in part],
                max_tokens=max_tokens,
                max_seqs=max_seqs,
                padded=padded,
                groups=None if groups is None else [groups[i] for i in part],
            )
        )
    n = max(1, max(len(p) for p in plans))
    return [p + [[] for _ in range(n - len(p))] for p in plans]


def norm_counts(rollouts: Sequence[Rollout], indices: Sequence[int]) -> tuple[int, int]:
    """``(valid tokens, sequences with a valid token)`` of a mini-batch: the global loss
    normalisers. Valid = masked in, with a finite behaviour logprob (the rule of the loss).
    A sequence is an episode: the samples of a split one count once."""
    per_episode = _episode_counts(rollouts, indices)
    return sum(per_episode.values()), sum(n > 0 for n in per_episode.values())


def episode_tokens(rollouts: Sequence[Rollout], indices: Sequence[int]) -> dict[int, float] | None:
    """Each sequence's episode's valid tokens, by index, when ``indices`` (a mini-batch)
    holds a split episode (:attr:`AggNorm.seq_tokens`); None when it holds none."""
    samples = Counter(episode_key(rollouts[i]) for i in indices)
    if all(n == 1 for n in samples.values()):
        return None
    per_episode = _episode_counts(rollouts, indices)
    return {i: float(per_episode[episode_key(rollouts[i])]) for i in indices}


def split_episodes(rollouts: Sequence[Rollout], indices: Sequence[int]) -> dict[int, int] | None:
    """The samples of the split episodes in ``indices`` (a mini-batch), by sequence index,
    each with its episode's number, 0, 1, ... in order of first appearance
    (:attr:`AggNorm.episodes`); None when no episode in it is split. Every rank computes
    the same numbers from the global batch: its sums of an episode add up with the others'."""
    keys = [episode_key(rollouts[i]) for i in indices]
    samples = Counter(keys)
    split = [k for k in dict.fromkeys(keys) if samples[k] > 1]  # dict: first appearance
    if not split:
        return None
    number = {k: n for n, k in enumerate(split)}
    return {i: number[k] for i, k in zip(indices, keys, strict=True) if k in number}


def _episode_counts(rollouts: Sequence[Rollout], indices: Sequence[int]) -> dict[Hashable, int]:
    counts: dict[Hashable, int] = {}
    for i in indices:
        r = rollouts[i]
        mask = r.loss_mask if r.loss_mask is not None else [1] * len(r.behaviour_logprobs)
        n = sum(
            1 for x, m in zip(r.behaviour_logprobs, mask, strict=True) if m and math.isfinite(x)
        )
        key = episode_key(r)
        counts[key] = counts.get(key, 0) + n
    return counts
