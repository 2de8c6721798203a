"""Sequence-level terms of split episodes: GSPO's ratio ``s = exp(mean_t(l - p))`` and the
sequence-level importance weight ``exp(mean_t(p - b))`` (:mod:`learner.losses`) are means
over a whole *episode*. A multi-turn episode that reached the learner as several samples
(:attr:`learner.rollouts.Rollout.episode`) must get one ratio and one weight, taken over the
response tokens of all its samples, on every token of each of them: then it trains exactly
as the same episode sent as one sample.

Its samples may sit in different micro-batches, even on different ranks, so the loss of one
micro-batch cannot see the others. The means are taken before the mini-batch's first
backward instead (why this is exact, and why the samples are not forced into one
micro-batch: see :func:`episode_sums`):

- :func:`episode_sums`: one rank's share of each split episode's sums ``[E, 3]``;
- summed over the ranks (the trainer's all-reduce), :func:`episode_means` ``[E, 2]``;
- :func:`row_means`: what one micro-batch's rows get (:class:`EpisodeMeans`), which
  :func:`learner.losses.policy_loss` puts in place of each pooled row's own mean.

Pure torch; a mini-batch without a split episode never comes here (its ``AggNorm.episodes``
is None), so unsplit batches keep the per-row code path bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # the loss imports this module: it stays pure torch at run time
    from learner.rollouts import Rollout


class EpisodeMeans(NamedTuple):
    """Per row of a micro-batch, ``[B]`` each (:func:`row_means`)."""

    pooled: torch.Tensor  # bool: the row is a sample of a split episode
    log_ratio: torch.Tensor  # its episode's mean of l - p (GSPO's log s); 0 where not pooled
    log_w: torch.Tensor  # its episode's mean of p - b (log of the sequence weight); likewise


def episode_sums(
    rollouts: Sequence[Rollout],
    episodes: Mapping[int, int],
    seq_ids: Iterable[int],
    proximal: Mapping[int, torch.Tensor],
    current: Mapping[int, torch.Tensor],
) -> torch.Tensor:
    """``[E, 3]`` float64, one row per split episode of the mini-batch (E = its episode
    count): the sums of ``l - p`` and of ``p - b`` over the valid tokens (masked in, finite
    behaviour logprob: the loss's rule) of the samples ``seq_ids`` this rank holds, and
    their count. Summed over the ranks they are the episodes' sums.

    ``episodes`` maps each split sample (sequence index) to its episode's number
    (:attr:`learner.reductions.AggNorm.episodes`); other ``seq_ids`` are skipped.
    ``proximal`` and ``current`` map a sequence index to ``[T_i]`` logprobs ``p`` and
    ``l``. The current policy's are taken, without gradient, at the weights the mini-batch
    trains at: every micro-batch of one optimizer step runs at the same weights, so they
    equal the logprobs its training forward computes, and since GSPO's ratio enters the
    loss detached (``exp(l - sg(l) + sg(log s))``) its gradient needs no more than that
    value. Forcing an episode's samples into one micro-batch would have needed no extra
    forward, but a split episode is long by construction (its history outgrew the
    context), and several context-long samples in one micro-batch can exceed the memory
    ``actor.ppo_max_token_len_per_gpu`` was sized for.
    """
    n_episodes = max(episodes.values(), default=-1) + 1
    sums = torch.zeros(n_episodes, 3, dtype=torch.float64)
    for s in seq_ids:
        if s not in episodes:
            continue
        r = rollouts[s]
        b = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
        valid = torch.isfinite(b)
        if r.loss_mask is not None:
            valid &= torch.tensor(r.loss_mask) != 0
        # The differences in float32, as the loss takes them; their sums in float64.
        p, lp = proximal[s].float()[valid], current[s].float()[valid]
        row = sums[episodes[s]]
        row[0] += (lp - p).double().sum()
        row[1] += (p - b[valid]).double().sum()
        row[2] += float(valid.sum())
    return sums


def episode_means(sums: torch.Tensor) -> torch.Tensor:
    """``[E, 2]`` float32 from all ranks' :func:`episode_sums` ``[E, 3]``: each episode's
    mean ``l - p`` and mean ``p - b`` (an episode without a valid token: 0, as the loss's
    own rows divide by their count clamped at 1)."""
    return (sums[:, :2] / sums[:, 2:].clamp(min=1)).float()


def row_means(
    means: torch.Tensor, episodes: Mapping[int, int], seq_ids: Sequence[int]
) -> EpisodeMeans | None:
    """What the rows ``seq_ids`` of one micro-batch take from :func:`episode_means`
    ``[E, 2]`` (on its device): None when none of them is a split sample (nothing to pool)."""
    numbers = [episodes.get(s, -1) for s in seq_ids]
    if all(k < 0 for k in numbers):
        return None
    k = torch.tensor(numbers, dtype=torch.long, device=means.device)
    pooled = k >= 0
    picked = torch.where(pooled[:, None], means[k.clamp(min=0)], means.new_zeros(len(k), 2))
    return EpisodeMeans(pooled, picked[:, 0], picked[:, 1])
