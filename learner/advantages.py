"""Advantage estimators: pure functions of scores (and values), no model, no I/O.

Outcome estimators (GRPO, Dr.GRPO, RLOO) give one advantage per response, shape ``[N]``,
which the loss broadcasts over the response's tokens. Group membership comes as a dense
index ``group_index[i] in [0, G)`` (see :func:`learner.rollouts.group_indices`).

Conventions follow veRL (docs/DESIGN.md section 9) so that numbers match what its users know:

- GRPO: ``(score - mean) / (std + eps)`` with the unbiased (n - 1) std of the group, or
  ``score - mean`` without std normalisation; a group of one has mean 0 and std 1.
- Dr.GRPO: ``score - mean`` (no std); its length-unbiased aggregation is the loss's
  ``seq-mean-token-sum-norm`` mode, chosen by :func:`loss_agg_mode_for`.
- RLOO: ``score - mean of the other members`` = ``(score - mean) * n / (n - 1)``; a group of
  one keeps its score (no baseline exists).
- GAE (for the critic path): ``delta_t = r_t + gamma * V_{t+1} - V_t``, accumulated
  backwards with ``gamma * lam``; returns = advantages + values; advantages whitened.

Token-level estimators without a critic (REINFORCE++, Hu 2025) give ``[B, T]`` advantages
whitened over every response token of the batch:

- ``reinforce_plus_plus``: the return from each token to the response's end, discounted
  by ``gamma`` over the trained tokens (the outcome sits on the last one). A masked token
  inside a response (a multi-turn episode's tool output) is passed over, so earlier turns
  see the outcome too; veRL's loop restarts the sum there, which gives every turn but the
  last a return of 0 (equal to it on responses without holes);
- ``reinforce_plus_plus_baseline``: ``score - group mean`` on every token of the response.

Split episodes: a multi-turn episode can reach the learner as several samples (see
:attr:`learner.rollouts.Rollout.episode`). GAE and REINFORCE++ take the rows of each
episode (``episodes``: row indices, in the episode's order) and run over them laid end to
end (:func:`join_index`), as over one response whose tool answers are masked out: an
earlier sample's last token bootstraps from the next sample's first value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard

import torch

from asyncrl.config.recipes import DR_GRPO_AGG

GRPO_EPS = 1e-6

OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
TOKEN_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _group_stats(
    scores: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-member group mean, unbiased std and size, each ``[N]`` (float64 internally).

    Groups of one get mean 0 and std 1 (veRL's convention).
    """
    s = scores.to(torch.float64)
    n_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(s)
    )
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, s)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, group_index, (s - mean[group_index]) ** 2
    )
    # Unbiased variance; a lone member has none, and veRL then uses mean 0, std 1.
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[group_index], std[group_index], count[group_index]


def grpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """GRPO: ``[N]`` scores, ``[N]`` long group index -> ``[N]`` advantages (scores' dtype).

    A zero-variance group gets advantage 0 for every member (nothing to learn from it).
    """
    mean, std, _ = _group_stats(scores, group_index)
    adv = scores.to(torch.float64) - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.to(scores.dtype)


def dr_grpo_advantages(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: ``score - group mean``, ``[N]`` -> ``[N]``; no std normalisation, which is
    what removes GRPO's question-difficulty bias."""
    return grpo_advantages(scores, group_index, norm_by_std=False)


def rloo_advantages(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO: ``[N]`` -> ``[N]``, each score minus the mean of the *other* group members."""
    mean, _, count = _group_stats(scores, group_index)
    s = scores.to(torch.float64)
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
    return ((s - mean) * factor).to(scores.dtype)


def outcome_advantages(
    estimator: str,
    scores: torch.Tensor,
    group_index: torch.Tensor,
    *,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Dispatch on ``algorithm.adv_estimator`` (``grpo``, ``dr_grpo``, ``rloo``): ``[N]``."""
    if estimator == "grpo":
        return grpo_advantages(scores, group_index, norm_by_std=norm_by_std)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(scores, group_index)
    if estimator == "rloo":
        return rloo_advantages(scores, group_index)
    raise ValueError(f"{estimator!r} is not an outcome estimator; choose {OUTCOME_ESTIMATORS}")


def loss_agg_mode_for(estimator: str, configured: str) -> str:
    """The loss aggregation an estimator needs: Dr.GRPO is defined with a constant
    normaliser (``seq-mean-token-sum-norm``); the others use ``actor.loss_agg_mode``."""
    return DR_GRPO_AGG if estimator == "dr_grpo" else configured


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``mask`` (unbiased var); ``[B, T]`` -> ``[B, T]``,
    zero outside the mask."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    episodes: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens.

    Args:
        token_rewards: ``[B, T]`` reward per response token (outcome rewards sit on the
            last token, see :func:`outcome_token_rewards`).
        values: ``[B, T]`` critic values ``V(s_t)``.
        mask: ``[B, T]`` bool, True on response tokens. Masked positions are skipped: the
            value after the last real token is 0 (episode end).
        episodes: the rows of each episode, in order, when some episode spans several
            rows (a split episode); the rows of one run as one (module docstring).
    Returns:
        ``(advantages, returns)``, each ``[B, T]`` and zero outside the mask;
        returns are not whitened (they are the critic's targets).
    """
    if any_split(episodes):
        index = join_index(mask, episodes)
        joined = [join_rows(x, index) for x in (token_rewards, values, mask)]
        adv, ret = gae_advantages(*joined, gamma=gamma, lam=lam, whiten=whiten)
        return split_rows(adv, index, mask.shape), split_rows(ret, index, mask.shape)
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=values.dtype)
    running = torch.zeros(B, dtype=values.dtype)
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * running
        # A padded position must not break the recursion: carry the state across it.
        next_value = torch.where(m, values[:, t], next_value)
        running = torch.where(m, gae, running)
        adv[:, t] = torch.where(m, gae, torch.zeros_like(gae))
    returns = torch.where(mask, adv + values, torch.zeros_like(adv))
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each ``[B]`` score on its response's last token: ``[B, T]`` (for GAE)."""
    out = torch.zeros(mask.shape, dtype=scores.dtype)
    lengths = mask.sum(dim=1)
    rows = torch.nonzero(lengths > 0).flatten()
    # Index of the last True per row (responses are left-aligned in their row).
    last = mask.shape[1] - 1 - mask.flip(1).to(torch.int8).argmax(dim=1)
    out[rows, last[rows]] = scores[rows]
    return out


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    episodes: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """REINFORCE++: ``[B, T]`` token rewards and bool mask -> ``[B, T]`` advantages, the
    discounted return from each token whitened over the batch's masked tokens (zero
    outside the mask). ``episodes``: as :func:`gae_advantages`'s."""
    if any_split(episodes):
        index = join_index(mask, episodes)
        joined = reinforce_pp_advantages(
            join_rows(token_rewards, index), join_rows(mask, index), gamma
        )
        return split_rows(joined, index, mask.shape)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        # A masked token (padding, or tool output between turns) carries the sum across.
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, mask)


def reinforce_pp_baseline_advantages(centered: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group baseline: ``[B]`` scores minus their group's mean, put on
    every masked token and whitened over them, ``[B, T]``."""
    tiled = torch.where(mask, centered[:, None].to(torch.float32), 0.0)
    return masked_whiten(tiled, mask)


def any_split(episodes: Sequence[Sequence[int]] | None) -> TypeGuard[Sequence[Sequence[int]]]:
    """Whether some episode spans several rows. Unsplit batches keep the row layout (and
    its exact sums): nothing to join."""
    return episodes is not None and any(len(rows) > 1 for rows in episodes)


def join_index(mask: torch.Tensor, episodes: Sequence[Sequence[int]]) -> torch.Tensor:
    """Where each episode's tokens sit in ``mask`` ``[B, T]``: ``[E, W]`` long indices
    into ``mask.flatten()``, each row of an episode up to its last True, the rows in the
    episode's order (``episodes``: row indices; every row in exactly one episode); W the
    longest episode, shorter ones filled with ``mask.numel()`` (a slot that reads 0)."""
    B, T = mask.shape
    # A row's tokens after its last True are padding or masked: left out, nothing lost.
    ends = (T - mask.flip(1).to(torch.int8).argmax(dim=1)) * mask.any(dim=1)
    flat = [
        torch.cat(
            [torch.arange(r * T, r * T + int(ends[r])) for r in rows]
            or [torch.zeros(0, dtype=torch.long)]
        )
        for rows in episodes
    ]
    width = max((len(f) for f in flat), default=0)
    index = torch.full((len(flat), width), B * T, dtype=torch.long)
    for e, f in enumerate(flat):
        index[e, : len(f)] = f
    return index


def join_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``[E, W]``: each episode's rows end to end (:func:`join_index`),
    zero (False) in the fill."""
    return torch.cat([x.flatten(), x.new_zeros(1)])[index]


def split_rows(joined: torch.Tensor, index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of :func:`join_rows`: ``[E, W]`` -> ``shape`` ``[B, T]``, zero where
    no episode token sits (a row's tail after its last True)."""
    out = joined.new_zeros(shape.numel() + 1)
    out[index.flatten()] = joined.flatten()  # the fill all lands on the extra slot
    return out[:-1].view(shape)
