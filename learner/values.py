"""The critic's side of PPO as pure functions: the clipped value loss, explained variance,
the KL penalty folded into token rewards, and the KL coefficient's controllers.

Conventions follow veRL (docs/DESIGN.md section 9), so a veRL user reads the same numbers:

- Value loss: ``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))`` with
  ``agg`` one of the policy loss's aggregation modes; ``vf_clipfrac`` is the share of tokens
  where the clipped term is the larger one.
- Explained variance: ``1 - var(R - V) / (var(R) + 1e-5)`` over response tokens (unbiased
  variances), with ``V`` the values the advantages were computed from.
- KL in the reward: ``r_t = score_t - beta * kl_t`` on every response token, ``kl_t`` the
  per-token estimate between the policy that sampled (here: the proximal policy) and the
  reference; the controller moves ``beta`` towards ``target_kl`` (adaptive) or keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from learner.advantages import any_split, join_index, join_rows, split_rows
from learner.reductions import AggNorm, aggregate, kl_penalty

EXPLAINED_VAR_EPS = 1e-5
# Keys of the stats dict value_loss returns: sums over tokens, combined exactly over
# micro-batches and ranks like the policy loss's.
VALUE_STAT_SUMS: tuple[str, ...] = ("vf_tokens", "vf_clipped", "vpred_sum", "vf_loss")


def value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange: float,
    agg_mode: str = "token-mean",
    norm_const: float = 1.0,
    norm: AggNorm | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of one (micro-)batch.

    Args:
        vpreds: ``[B, T]`` current critic values (with gradient).
        old_values: ``[B, T]`` the values the batch's advantages came from (no gradient).
        returns: ``[B, T]`` GAE returns, the critic's targets.
        mask: ``[B, T]`` bool, the tokens that count.
        cliprange: how far ``vpreds`` may move from ``old_values`` before the clipped
            term takes over (veRL's ``critic.cliprange_value``).
        norm_const: ``seq-mean-token-sum-norm``'s divisor (the response length limit).
        norm: global normalisers when the batch is one part of a larger mini-batch.
    Returns:
        ``(loss, stats)``: the scalar loss and detached sums keyed by
        :data:`VALUE_STAT_SUMS`.
    """
    old = old_values.detach()
    clipped = torch.maximum(torch.minimum(vpreds, old + cliprange), old - cliprange)
    unclipped_sq = (vpreds - returns).square()
    clipped_sq = (clipped - returns).square()
    loss_t = torch.maximum(unclipped_sq, clipped_sq)
    loss = 0.5 * aggregate(loss_t, mask, agg_mode, norm_const=norm_const, norm=norm)
    f = mask.to(vpreds.dtype)
    stats = {
        "vf_tokens": f.sum(),
        "vf_clipped": ((clipped_sq > unclipped_sq) & mask).to(f.dtype).sum(),
        "vpred_sum": torch.where(mask, vpreds, 0).sum().detach(),
        "vf_loss": loss.detach(),
    }
    return loss, stats


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - var(R - V) / (var(R) + eps)`` over ``mask`` (``[B, T]`` each): 1 when the
    values predict the returns, 0 when they do no better than a constant, negative when
    they do worse. Unbiased variances, as veRL's ``torch.var``."""
    r = returns[mask].to(torch.float64)
    v = values[mask].to(torch.float64)
    if r.numel() < 2:
        return 0.0
    return float(1.0 - torch.var(r - v) / (torch.var(r) + EXPLAINED_VAR_EPS))


def kl_in_reward(
    token_scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    kind: str = "k1",
    episodes: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, float]:
    """Token rewards with the KL penalty subtracted, and the batch's KL.

    Args:
        token_scores: ``[B, T]`` rewards before the penalty (the outcome score on the last
            response token).
        logprobs, ref_logprobs: ``[B, T]`` the sampling policy's and the reference's.
        mask: ``[B, T]`` bool, response tokens.
        kind: the estimator (``k1``, ``k2``, ``k3``; veRL's ``algorithm.kl_penalty``).
        episodes: the rows of each episode when some span several (a split episode):
            ``kl`` then counts each episode as one sequence (see
            :func:`learner.advantages.gae_advantages`).
    Returns:
        ``(rewards [B, T], kl)``: ``kl`` is the mean over sequences of each sequence's
        token-mean KL, what the adaptive controller steers.
    """
    if any_split(episodes):
        index = join_index(mask, episodes)
        joined = [join_rows(x, index) for x in (token_scores, logprobs, ref_logprobs, mask)]
        rewards, kl = kl_in_reward(*joined, coef=coef, kind=kind)
        return split_rows(rewards, index, mask.shape), kl
    kl = torch.where(mask, kl_penalty(logprobs, ref_logprobs, kind), 0.0)
    rewards = token_scores - coef * kl
    per_seq = kl.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    rows = mask.any(dim=1)
    current = float(per_seq[rows].mean()) if rows.any() else 0.0
    return rewards, current


@dataclass
class KLController:
    """The KL-in-reward coefficient ``value``. ``fixed`` keeps it; ``adaptive`` (Ziegler et
    al. 2019, as veRL) multiplies it by ``1 + clip(kl / target - 1, -0.2, 0.2) * n /
    horizon`` after each batch of ``n`` sequences."""

    value: float
    kind: str = "fixed"
    target: float = 0.1
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.kind == "fixed":
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
