"""Dual clip and GSPO against veRL's formulas (written out here from its ``core_algos``
definitions) on random tensors, with and without importance weights."""

from __future__ import annotations

import pytest
import torch

from learner.losses import LossConfig, policy_loss, summarize_stats


def ref_agg(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """veRL's agg_loss for the modes compared here."""
    m = mask.float()
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    seq_sum = (loss_mat * m).sum(-1)
    seqs = (m.sum(-1) > 0).float()
    if mode == "seq-mean-token-mean":
        return (seq_sum / m.sum(-1).clamp(min=1) * seqs).sum() / seqs.sum()
    if mode == "seq-mean-token-sum":
        return (seq_sum * seqs).sum() / seqs.sum()
    raise ValueError(mode)


def ref_vanilla(old, logp, adv, mask, low, high, c):
    """veRL's vanilla policy loss with dual clip: per-token losses and the dual-clip
    fraction (its pg_clipfrac_lower)."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * c
    clip2 = torch.min(l3, clip1)
    dual = ((clip1 > l3) & (adv < 0)).float()
    return torch.where(adv < 0, clip2, clip1), (dual * mask).sum() / mask.sum()


def ref_gspo(old, logp, adv, mask, low, high):
    """veRL's GSPO: the sequence's mean log-ratio, stop-gradient, plus each token's own
    log-prob minus its stop-gradient copy, clamped above at 10."""
    m = mask.float()
    seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = logp - logp.detach() + seq.detach()[:, None]
    s = torch.exp(torch.clamp(log_s, max=10.0))
    return torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - low, 1 + high))


def _batch(seed: int, spread: float = 1.5, B: int = 8, T: int = 14):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3 - 0.1
    logp = old + torch.randn(B, T, generator=g) * spread  # many ratios beyond 3 and 1/3
    behaviour = old + torch.randn(B, T, generator=g) * 0.5
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return old, logp.requires_grad_(True), behaviour, adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(
    ("low", "high", "c"), [(0.2, 0.28, 3.0), (0.2, 0.2, 1.5), (0.1, 0.3, 10.0)]
)
def test_dual_clip_equals_verl(mode, low, high, c):
    old, logp, _, adv, mask = _batch(seed=int(c * 10) + len(mode))
    cfg = LossConfig(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, importance_mode="none",
        agg_mode=mode,
    )  # fmt: skip
    loss, stats = policy_loss(logp, old, old, adv, mask, cfg)
    a = adv[:, None].expand_as(logp)
    ref_mat, ref_dual = ref_vanilla(old, logp, a, mask.float(), low, high, c)
    ref = ref_agg(ref_mat, mask, mode)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    got = summarize_stats({k: float(v) for k, v in stats.items()}, "none")
    assert got["actor/pg_clipfrac_dual"] == pytest.approx(float(ref_dual), abs=1e-7)
    if c == 3.0:  # the check binds: some negative-advantage tokens have a ratio above 3
        assert got["actor/pg_clipfrac_dual"] > 0
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(
        ref_agg(ref_vanilla(old, logp, a, mask.float(), low, high, c)[0], mask, mode), logp
    )
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


def test_dual_clip_bounds_the_loss_only_for_negative_advantages():
    old = torch.zeros(2, 1)
    logp = torch.log(torch.tensor([[5.0], [5.0]])).requires_grad_(True)
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 1, dtype=torch.bool)
    cfg = LossConfig(importance_mode="none", agg_mode="seq-mean-token-sum")
    loss, _ = policy_loss(logp, old, old, adv, mask, cfg)
    # A < 0, r = 5: plain PPO loses 5 (max(5, 1.28)); dual clip bounds it at c = 3.
    # A > 0, r = 5: min(5, 1.28) * A -> loss -1.28, untouched.
    assert float(loss.detach()) == pytest.approx((3.0 - 1.28) / 2)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(("low", "high"), [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_equals_verl(mode, low, high):
    """veRL aggregates GSPO's policy term seq-mean-token-mean whatever ``loss_agg_mode``
    says; the mode still aggregates the entropy term (and the KL one)."""
    old, logp, _, adv, mask = _batch(seed=7, spread=0.01 if low < 0.01 else 0.5)
    entropy = torch.rand_like(logp)
    cfg = LossConfig(
        clip_ratio_low=low, clip_ratio_high=high, loss_mode="gspo", importance_mode="none",
        agg_mode=mode, entropy_coeff=0.01,
    )  # fmt: skip

    def ref_loss(logp: torch.Tensor) -> torch.Tensor:
        mat = ref_gspo(old, logp, adv[:, None].expand_as(logp), mask, low, high)
        return ref_agg(mat, mask, "seq-mean-token-mean") - 0.01 * ref_agg(entropy, mask, mode)

    loss, _ = policy_loss(logp, old, old, adv, mask, cfg, entropy=entropy)
    torch.testing.assert_close(loss, ref_loss(logp), rtol=1e-6, atol=1e-7)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(ref_loss(logp), logp)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("loss_mode", "level"), [("vanilla", "token"), ("vanilla", "sequence"), ("gspo", "sequence")]
)
def test_truncated_weights_multiply_the_clipped_loss(loss_mode, level):
    """veRL's rollout correction: the per-token loss (after dual clip or GSPO's clip) times
    the truncated weight exp(old - rollout) (token) or its geometric mean (sequence)."""
    old, logp, behaviour, adv, mask = _batch(seed=3, spread=1.0)
    cfg = LossConfig(
        loss_mode=loss_mode, importance_mode="tis", importance_cap=2.0, importance_level=level,
        agg_mode="token-mean",
    )  # fmt: skip
    loss, _ = policy_loss(logp, old, behaviour, adv, mask, cfg)
    a = adv[:, None].expand_as(logp)
    m = mask.float()
    log_w = (old - behaviour) * m
    if level == "sequence":
        log_w = (log_w.sum(-1) / m.sum(-1).clamp(min=1))[:, None].expand_as(log_w)
    w = torch.exp(log_w).clamp(max=2.0)
    if loss_mode == "gspo":
        mat = ref_gspo(old, logp, a, mask, cfg.clip_ratio_low, cfg.clip_ratio_high)
    else:
        mat = ref_vanilla(old, logp, a, m, cfg.clip_ratio_low, cfg.clip_ratio_high, 3.0)[0]
    pg_mode = "seq-mean-token-mean" if loss_mode == "gspo" else "token-mean"  # GSPO's own
    torch.testing.assert_close(loss, ref_agg(mat * w, mask, pg_mode), rtol=1e-6, atol=1e-6)


def test_bad_recipe_settings_are_refused():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        LossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_mode"):
        LossConfig(loss_mode="cispo")
