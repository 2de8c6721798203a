"""Reductions of per-token losses shared by the policy loss (:mod:`learner.losses`) and the
value loss (:mod:`learner.values`): veRL's aggregation modes and KL estimators, pure torch.

Aggregation over a mini-batch that may be split into micro-batches and data-parallel
ranks: pass the *global* counts (:class:`AggNorm`) so that the micro-batch losses sum
exactly to the mini-batch loss whatever the split. Tensors are ``[B, T]`` with a bool
``mask`` of real response tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# A log-ratio is clamped before exp so one wild token cannot make a loss infinite.
LOG_RATIO_CLAMP = 20.0
# veRL clamps the k3 estimator to this range for the same reason.
_K3_CLAMP = 10.0


@dataclass(frozen=True)
class AggNorm:
    """Global normalisers of one mini-batch (over all its micro-batches and ranks).

    ``num_tokens``: valid response tokens; ``num_seqs``: sequences with at least one valid
    token. ``None`` means "this call's own count" (a single, unsplit batch).

    A multi-turn episode split into several samples is one sequence (``num_seqs`` counts
    episodes). ``seq_tokens``: when the mini-batch holds such an episode, each sample's
    episode's valid tokens, by sequence index (None: every sample is its own episode);
    :meth:`rows` gives a micro-batch's rows theirs as ``row_tokens`` ``[B]``, the
    ``seq-mean-token-mean`` divisor, so that a split episode's samples share one token
    mean. None: each row's own count. ``episodes``: likewise when the mini-batch holds a
    split episode, each of its samples' episode number (0, 1, ... within the mini-batch) by
    sequence index: the rows over which GSPO's ratio and the sequence-level importance
    weight pool (:mod:`learner.episode_means`); a micro-batch's :meth:`rows` drop it.
    """

    num_tokens: float | None = None
    num_seqs: float | None = None
    seq_tokens: Mapping[int, float] | None = None
    row_tokens: tuple[float, ...] | None = None
    episodes: Mapping[int, int] | None = None

    def rows(self, seq_ids: Sequence[int]) -> AggNorm:
        """The normalisers of a micro-batch whose rows are the sequences ``seq_ids``."""
        if self.seq_tokens is None or not seq_ids:  # no split episode, or a dummy batch
            return self
        return AggNorm(
            self.num_tokens, self.num_seqs, row_tokens=tuple(self.seq_tokens[s] for s in seq_ids)
        )


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    norm_const: float = 1.0,
    norm: AggNorm | None = None,
) -> torch.Tensor:
    """Reduce ``[B, T]`` token losses over ``mask`` to a scalar (veRL's modes).

    - ``token-mean``: sum over tokens / number of tokens
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum
    - ``seq-mean-token-sum-norm``: sum over tokens / (number of sequences * ``norm_const``)
      (Dr.GRPO: a constant instead of each response's length)

    A sequence is an episode: a split one's rows (``norm.row_tokens``) share its token mean.
    """
    norm = norm or AggNorm()
    m = mask.to(loss_mat.dtype)
    masked = torch.where(mask, loss_mat, torch.zeros_like(loss_mat))
    if mode == "token-mean":
        denom = norm.num_tokens if norm.num_tokens is not None else m.sum().clamp(min=1)
        return masked.sum() / denom
    seq_tokens = m.sum(dim=1)
    if norm.row_tokens is None:
        divisor = seq_tokens.clamp(min=1)
        own_seqs = (seq_tokens > 0).sum().clamp(min=1)
    else:  # each row its episode's count; its share of the episode counts as a sequence
        divisor = torch.tensor(norm.row_tokens, dtype=m.dtype, device=m.device).clamp(min=1)
        own_seqs = (seq_tokens / divisor).sum()
        own_seqs = torch.where(own_seqs > 0, own_seqs, torch.ones_like(own_seqs))
    n_seqs = norm.num_seqs if norm.num_seqs is not None else own_seqs
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=1) / divisor).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (n_seqs * norm_const)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {AGG_MODES}")


#: The KL estimators: Schulman's k1, k2, k3, veRL's ``abs``, and ``k1+``/``k3+``/``abs+``,
#: which take the value of their base estimator and the gradient of k2.
KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate to the reference, ``[B, T]``: k1 ``l - ref``, k2
    ``(l - ref)^2 / 2``, k3 ``exp(ref - l) - (ref - l) - 1`` (clamped like veRL), abs
    ``|l - ref|``.

    A ``+`` kind (veRL's ``k3+``) has its base estimator's value and k2's gradient: k1's and
    k3's expected values are the KL, but their expected gradients are not its gradient,
    while k2's is (a straight-through estimate)."""
    if kind not in KL_KINDS:
        raise ValueError(f"kl type {kind!r} not in {KL_KINDS}")
    diff = logprobs - ref_logprobs
    base = kind.rstrip("+")
    if base == "k1":
        value = diff
    elif base == "k2":
        value = 0.5 * diff.square()
    elif base == "abs":
        value = diff.abs()
    else:
        d = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        value = (d.exp() - d - 1).clamp(-_K3_CLAMP, _K3_CLAMP)
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * diff.square()
    return k2 - k2.detach() + value.detach()
