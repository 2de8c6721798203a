"""The decoupled, importance-corrected PPO loss (docs/DESIGN.md section 5): pure torch.

Notation per response token: behaviour logprob ``b`` (vLLM, after temperature), proximal
logprob ``p`` (learner weights at the start of the step, no gradient), current logprob
``l`` (with gradient)::

    r = exp(l - p)                  # PPO ratio against the proximal policy
    w = exp(p - b)                  # importance weight: proximal vs behaviour (no grad)
    loss_t = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

With dual clip (veRL's ``clip_ratio_c``, default 3), a token with ``A < 0`` loses at most
``-w * c * A``: a ratio far above 1 on a token the policy should leave (off-policy data is
where such ratios occur) cannot push the loss without bound.

GSPO (``loss_mode="gspo"``) replaces the per-token ratio by the sequence's length-normalised
one, ``s = exp(mean_t(l - p))``, written per token as ``exp(l - sg(l) + sg(log s))`` so each
token's gradient is its own; it has no dual clip, and its clip range is the narrow one
GSPO is run with (3e-4 / 4e-4 when the config leaves it unset).

A multi-turn episode split into several samples takes both sequence-level means (GSPO's
``s`` and the sequence-level ``w``) over all its samples (:mod:`learner.episode_means`,
the ``episodes`` argument of :func:`policy_loss`).

``w`` is truncated at ``cap`` (``tis``), or the unit with ``w > cap`` is masked (``mis``),
or left out entirely (``none``: ``w = 1``). ``level="sequence"`` replaces the per-token
``w`` by the geometric mean over the response, ``exp(mean_t(p - b))``. A masked unit (MIS)
contributes zero but still counts in the normaliser, so the loss scale does not jump with the
masked fraction. Tokens whose ``b`` is not finite are dropped (and counted) before anything
else.

All per-token tensors are ``[B, T]``: B sequences, T = the longest response in the batch,
left-aligned, with a bool ``mask`` marking real response tokens.

Token losses are reduced with :mod:`learner.reductions` (veRL's aggregation modes, with the
global counts of a split mini-batch; the KL estimators), which the value loss shares.

``policy_loss`` returns the loss and a dict of *sums and maxima* (:data:`STAT_SUMS`,
:data:`STAT_MAXES`) rather than means, so metrics can be combined exactly over micro-batches
and ranks; :func:`summarize_stats` turns them into metric values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from learner.episode_means import EpisodeMeans
from learner.reductions import (
    AGG_MODES,
    KL_KINDS,
    LOG_RATIO_CLAMP,
    AggNorm,
    aggregate,
    kl_penalty,
)

if TYPE_CHECKING:  # this module stays pure torch at run time
    from asyncrl.config import Config

#: How GSPO's policy term is aggregated, whatever ``loss_agg_mode`` says (veRL's
#: ``compute_policy_loss_gspo`` fixes it so); the KL and entropy terms follow the mode.
GSPO_PG_AGG = "seq-mean-token-mean"

# ...and GSPO's sequence log-ratio from above at this value.
_GSPO_LOG_RATIO_MAX = 10.0
LOSS_MODES = ("vanilla", "gspo")


@dataclass(frozen=True)
class LossConfig:
    """Everything the loss needs from the run config (see :meth:`from_config`)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0  # dual clip of negative-advantage tokens (vanilla only)
    loss_mode: str = "vanilla"  # vanilla | gspo
    importance_mode: str = "tis"  # tis | mis | none
    importance_cap: float = 2.0
    importance_level: str = "token"  # token | sequence
    agg_mode: str = "token-mean"
    norm_const: float = 1.0  # seq-mean-token-sum-norm divisor (max response length)
    kl_coef: float = 0.0  # 0: no KL term (and no reference logprobs needed)
    # actor.use_kl_loss: the KL to the reference is computed and logged (actor/ref_kl) even
    # at kl_coef 0, as veRL does, so a run can watch its drift without a penalty.
    kl_track: bool = False
    kl_type: str = "k3"  # one of learner.reductions.KL_KINDS
    entropy_coeff: float = 0.0

    def __post_init__(self) -> None:
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode {self.agg_mode!r} not in {AGG_MODES}")
        if self.importance_mode not in ("tis", "mis", "none"):
            raise ValueError(f"importance_mode {self.importance_mode!r} not tis/mis/none")
        if self.importance_level not in ("token", "sequence"):
            raise ValueError(f"importance_level {self.importance_level!r} not token/sequence")
        if self.kl_type not in KL_KINDS:
            raise ValueError(f"kl_type {self.kl_type!r} not in {KL_KINDS}")
        if self.loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode {self.loss_mode!r} not in {LOSS_MODES}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")

    @classmethod
    def from_config(cls, cfg: Config) -> LossConfig:
        """Read ``actor``, ``algorithm`` and ``data.max_response_length``; Dr.GRPO forces
        the constant-normalised aggregation it is defined with."""
        from learner.advantages import loss_agg_mode_for

        actor, imp = cfg.actor, cfg.algorithm.importance
        return cls(
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c,
            loss_mode=actor.policy_loss.loss_mode,
            importance_mode=imp.mode,
            importance_cap=imp.cap,
            importance_level=imp.level,
            agg_mode=loss_agg_mode_for(cfg.algorithm.adv_estimator, actor.loss_agg_mode),
            norm_const=float(cfg.data.max_response_length),
            kl_coef=actor.kl_loss_coef if actor.use_kl_loss else 0.0,
            kl_track=actor.use_kl_loss,
            kl_type=actor.kl_loss_type,
            entropy_coeff=actor.entropy_coeff,
        )


def valid_token_mask(mask: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: response tokens whose behaviour logprob is finite."""
    return mask & torch.isfinite(behaviour)


def importance_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    valid: torch.Tensor,
    *,
    mode: str,
    cap: float,
    level: str,
    episodes: EpisodeMeans | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights ``w = exp(p - b)`` as applied in the loss.

    Args:
        proximal, behaviour: ``[B, T]`` logprobs (no gradient needed).
        valid: ``[B, T]`` bool (:func:`valid_token_mask`).
        episodes: at sequence level, the rows of split episodes take their episode's mean
            (``log_w`` ``[B]``) in place of their own.
    Returns:
        ``(applied, keep, raw)``, each ``[B, T]``: ``applied`` is the weight the loss uses
        (truncated for tis, 1 for none, zero where masked), ``keep`` is False for units
        MIS masked, ``raw`` the untruncated weight (token or sequence level) for metrics.
        Positions outside ``valid`` hold 1 (raw/applied) and keep=False.
    """
    log_w = torch.where(valid, proximal - behaviour, torch.zeros_like(proximal)).detach()
    if level == "sequence":
        n = valid.sum(dim=1, keepdim=True).clamp(min=1)
        log_w = log_w.sum(dim=1, keepdim=True) / n
        if episodes is not None:
            log_w = torch.where(episodes.pooled[:, None], episodes.log_w[:, None], log_w)
        log_w = log_w.expand_as(proximal)
    raw = torch.where(valid, log_w.clamp(max=LOG_RATIO_CLAMP).exp(), torch.ones_like(log_w))
    keep = valid.clone()
    if mode == "tis":
        applied = raw.clamp(max=cap)
    elif mode == "mis":
        keep = keep & (raw <= cap)
        applied = torch.where(keep, raw, torch.zeros_like(raw))
    elif mode == "none":
        applied = torch.ones_like(raw)
    else:
        raise ValueError(f"importance mode {mode!r} not tis/mis/none")
    return applied, keep, raw


# Keys of the stats dict returned by policy_loss: summed across micro-batches and ranks...
STAT_SUMS: tuple[str, ...] = (
    "tokens",
    "seqs",
    "nonfinite",
    "clipped_low",
    "clipped_high",
    "clipped_dual",
    "ppo_kl",
    "w_units",
    "w_sum",
    "w_sq_sum",
    "w_over_cap",
    "mismatch",
    "abs_log_w",
    "entropy",
    "ref_kl",
    "pg_loss",
    "kl_loss",
    "entropy_loss",
    "loss",
)
# ...and maxed.
STAT_MAXES: tuple[str, ...] = ("w_max", "abs_log_w_max")


class PgTerms(NamedTuple):
    """The policy-gradient part of the loss per token, ``[B, T]`` each."""

    loss: torch.Tensor  # before the importance weight
    log_ratio: torch.Tensor  # l - p, per token (what ppo_kl averages)
    clipped_low: torch.Tensor  # bool: the clip at 1 - eps_low is active
    clipped_high: torch.Tensor  # bool: the clip at 1 + eps_high is active
    clipped_dual: torch.Tensor  # bool: the dual clip bounded the loss (A < 0)


def _pg_terms(
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    cfg: LossConfig,
    episodes: EpisodeMeans | None = None,
) -> PgTerms:
    """Clipped PPO with dual clip (``vanilla``), or GSPO's sequence ratio (``gspo``; the
    rows of split episodes take their episode's ``log s``, ``episodes.log_ratio`` ``[B]``)."""
    log_ratio = (logprobs - proximal).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.loss_mode == "gspo":
        n = valid.sum(dim=1, keepdim=True).clamp(min=1)
        seq = (torch.where(valid, logprobs - proximal, 0).sum(dim=1, keepdim=True) / n).detach()
        if episodes is not None:
            seq = torch.where(episodes.pooled[:, None], episodes.log_ratio[:, None], seq)
        ratio = (logprobs - logprobs.detach() + seq).clamp(max=_GSPO_LOG_RATIO_MAX).exp()
    else:
        ratio = log_ratio.exp()
    clipped = ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    # max of the negated objectives == -min(r*A, clip(r)*A)
    loss_t = torch.maximum(-adv * ratio, -adv * clipped)
    active = (-adv * clipped) > (-adv * ratio)
    dual = torch.zeros_like(active)
    if cfg.loss_mode == "vanilla":
        bound = -adv * cfg.clip_ratio_c
        dual = (adv < 0) & (loss_t > bound)
        loss_t = torch.where(adv < 0, torch.minimum(loss_t, bound), loss_t)
    return PgTerms(loss_t, log_ratio, active & (ratio < 1), active & (ratio > 1), dual)


def policy_loss(
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    episodes: EpisodeMeans | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The total loss of one (micro-)batch and its stats.

    Args:
        logprobs: ``[B, T]`` current logprobs ``l`` (with gradient).
        proximal: ``[B, T]`` proximal logprobs ``p`` (detached).
        behaviour: ``[B, T]`` behaviour logprobs ``b``; non-finite entries are dropped.
        advantages: ``[B]`` per sequence or ``[B, T]`` per token.
        mask: ``[B, T]`` bool, True on response tokens.
        entropy: ``[B, T]`` policy entropy; needed for ``entropy_coeff > 0`` and metrics.
        ref_logprobs: ``[B, T]`` reference logprobs; needed when ``cfg.kl_coef > 0``.
        norm: global normalisers when the batch is one part of a larger mini-batch.
        episodes: the means of the split episodes among the rows (``[B]`` each, see
            :mod:`learner.episode_means`), for GSPO and sequence-level weights; None: every
            row is its own sequence.
    Returns:
        ``(loss, stats)``: scalar loss = pg - entropy_coeff * entropy + kl_coef * kl, each
        term aggregated with ``cfg.agg_mode`` (GSPO's pg term: :data:`GSPO_PG_AGG`); stats are detached scalar tensors keyed by
        :data:`STAT_SUMS` and :data:`STAT_MAXES`.
    """
    valid = valid_token_mask(mask, behaviour)
    # Replace dropped entries before any arithmetic: NaN * 0 is still NaN.
    proximal = torch.where(valid, proximal.detach(), torch.zeros_like(proximal))
    behaviour = torch.where(valid, behaviour, proximal)
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    lp = torch.where(valid, logprobs, proximal)

    w, keep, raw_w = importance_weights(
        proximal,
        behaviour,
        valid,
        mode=cfg.importance_mode,
        cap=cfg.importance_cap,
        level=cfg.importance_level,
        episodes=episodes,
    )
    pg = _pg_terms(lp, proximal, adv, valid, cfg, episodes)
    agg = {"mode": cfg.agg_mode, "norm_const": cfg.norm_const, "norm": norm}
    pg_agg = {**agg, "mode": GSPO_PG_AGG} if cfg.loss_mode == "gspo" else agg
    pg_loss = aggregate(w * pg.loss, valid, **pg_agg)
    loss = pg_loss
    zero = pg_loss.new_zeros(())
    kl_loss, ent_loss, ref_kl = zero, zero, zero
    if cfg.kl_coef > 0 or cfg.kl_track:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 (or kl_track) needs ref_logprobs")
        kl_t = kl_penalty(lp, torch.where(valid, ref_logprobs, proximal), cfg.kl_type)
        kl_loss = aggregate(kl_t, valid, **agg)
        ref_kl = torch.where(valid, kl_t, 0).sum()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
    if cfg.entropy_coeff > 0 and entropy is None:
        raise ValueError("entropy_coeff > 0 needs entropy")
    if entropy is not None:  # reported as loss/entropy even when it does not train
        ent_loss = aggregate(entropy, valid, **agg)
        if cfg.entropy_coeff > 0:
            loss = loss - cfg.entropy_coeff * ent_loss

    stats = _stats(valid, keep, raw_w, pg, proximal, behaviour, mask, cfg)
    ent = torch.where(valid, entropy, 0).sum() if entropy is not None else zero
    stats.update(
        entropy=ent.detach(),
        ref_kl=ref_kl.detach(),
        pg_loss=pg_loss.detach(),
        kl_loss=kl_loss.detach(),
        entropy_loss=ent_loss.detach(),
        loss=loss.detach(),
    )
    return loss, stats


def _stats(
    valid: torch.Tensor,
    keep: torch.Tensor,
    raw_w: torch.Tensor,
    pg: PgTerms,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> dict[str, torch.Tensor]:
    """Sums and maxima of one batch (see :data:`STAT_SUMS`); all ``[B, T]`` inputs."""
    f = valid.to(proximal.dtype)
    if cfg.importance_level == "sequence":
        # One weight per sequence: take it from the first valid token of each row.
        rows = valid.any(dim=1)
        units_w = raw_w[rows, valid[rows].to(torch.int8).argmax(dim=1)]
    else:
        units_w = raw_w[valid]
    log_w = (proximal - behaviour)[valid].abs()
    return {
        "tokens": f.sum(),
        "seqs": valid.any(dim=1).to(f.dtype).sum(),
        "nonfinite": (mask & ~valid).to(f.dtype).sum(),
        "clipped_low": (pg.clipped_low & valid).to(f.dtype).sum(),
        "clipped_high": (pg.clipped_high & valid).to(f.dtype).sum(),
        "clipped_dual": (pg.clipped_dual & valid).to(f.dtype).sum(),
        # veRL's ppo_kl: mean(p - l), the k1 estimate of KL(proximal || current).
        "ppo_kl": torch.where(valid, -pg.log_ratio, 0).sum().detach(),
        "w_units": torch.tensor(float(units_w.numel()), dtype=f.dtype),
        "w_sum": units_w.sum(),
        "w_sq_sum": units_w.square().sum(),
        "w_over_cap": (units_w > cfg.importance_cap).to(f.dtype).sum(),
        "w_max": units_w.max() if units_w.numel() else f.new_zeros(()),
        # KL(behaviour || proximal) estimated on behaviour samples: mean(b - p).
        "mismatch": torch.where(valid, behaviour - proximal, 0).sum(),
        "abs_log_w": log_w.sum(),
        "abs_log_w_max": log_w.max() if log_w.numel() else f.new_zeros(()),
    }


def summarize_stats(stats: dict[str, float], importance_mode: str) -> dict[str, float]:
    """Metric values from summed stats (the ``loss/*`` entries are left to the caller,
    who knows how many mini-batches were summed)."""

    def ratio(a: str, b: str) -> float:
        return stats[a] / stats[b] if stats[b] > 0 else 0.0

    over_cap = ratio("w_over_cap", "w_units")
    w_sq = stats["w_sq_sum"]
    # No valid token (every behaviour logprob dropped): nothing measured. NaN says so to the
    # health rules and the adaptive lag (which widened on ESS 1 and KL 0 as on-policy).
    measured, nan = stats["w_units"] > 0, float("nan")
    ess = stats["w_sum"] ** 2 / (stats["w_units"] * w_sq) if w_sq > 0 else 1.0
    return {
        "actor/pg_clipfrac": (stats["clipped_low"] + stats["clipped_high"])
        / max(stats["tokens"], 1.0),
        "actor/pg_clipfrac_lower": ratio("clipped_low", "tokens"),
        "actor/pg_clipfrac_upper": ratio("clipped_high", "tokens"),
        "actor/pg_clipfrac_dual": ratio("clipped_dual", "tokens"),
        "actor/ppo_kl": ratio("ppo_kl", "tokens"),
        "actor/entropy": ratio("entropy", "tokens"),
        "actor/ref_kl": ratio("ref_kl", "tokens"),
        "importance/w_mean": ratio("w_sum", "w_units") if measured else nan,
        "importance/w_max": stats["w_max"],
        # Normalised effective sample size (sum w)^2 / (n * sum w^2), in (0, 1].
        "importance/ess": ess if measured else nan,
        # E[w^2] - 1: 0 when every weight is 1 (on-policy).
        "importance/chi2": w_sq / stats["w_units"] - 1.0 if measured else nan,
        "importance/truncated_frac": over_cap if importance_mode == "tis" else 0.0,
        "importance/masked_frac": over_cap if importance_mode == "mis" else 0.0,
        "importance/mismatch_kl": ratio("mismatch", "tokens") if measured else nan,
        "importance/log_w_abs_mean": ratio("abs_log_w", "tokens") if measured else nan,
        "importance/log_w_abs_max": stats["abs_log_w_max"],
        "importance/nonfinite_dropped": stats["nonfinite"],
    }
