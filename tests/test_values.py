"""The critic's pure functions against hand-computed values and veRL's formulas."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import AggNorm, kl_penalty
from learner.values import KLController, explained_variance, kl_in_reward, value_loss


def close(a, b, tol=1e-6):
    got = torch.as_tensor(a, dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(b, dtype=torch.float64), atol=tol, rtol=0)


def test_value_loss_by_hand():
    # Token 1: V 1.0, V_old 0.5, R 2.0, c 0.2 -> clipped V 0.7: (1-2)^2 = 1 < (0.7-2)^2 = 1.69
    #   -> the clipped term wins: 1.69, clipped.
    # Token 2: V 0.0, V_old 0.1, R -1.0 -> clipped V = -0.1: 1 vs 0.81 -> 1, not clipped.
    # Token 3: masked out (huge values must not leak in).
    vpreds = torch.tensor([[1.0, 0.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.1, 0.0]])
    returns = torch.tensor([[2.0, -1.0, -50.0]])
    mask = torch.tensor([[True, True, False]])
    loss, st = value_loss(vpreds, old, returns, mask, cliprange=0.2)
    close(loss, 0.5 * (1.69 + 1.0) / 2)
    close(st["vf_clipped"], 1.0)
    close(st["vf_tokens"], 2.0)
    close(st["vpred_sum"], 1.0)
    loss.backward()
    # The clipped token's term does not depend on V (clip is flat there); the other gives
    # 0.5 * 2 * (V - R) / 2 tokens = 0.5 on token 2.
    assert vpreds.grad is not None
    close(vpreds.grad, [[0.0, 0.5, 0.0]])
    # seq-mean-token-sum: the token sum over the one sequence.
    loss, _ = value_loss(vpreds, old, returns, mask, cliprange=0.2, agg_mode="seq-mean-token-sum")
    close(loss, 0.5 * (1.69 + 1.0))


def verl_value_loss(vpreds, returns, values, mask, cliprange, agg_mode):
    """veRL's ``compute_value_loss`` from its definition: clip the prediction to the old
    value +- cliprange, take the larger squared error, aggregate with ``agg_loss`` and halve;
    the clip fraction is the masked mean of (clipped error > unclipped error)."""
    clipped = torch.max(torch.min(vpreds, values + cliprange), values - cliprange)
    l1 = (vpreds - returns) ** 2
    l2 = (clipped - returns) ** 2
    mat = torch.max(l1, l2)
    m = mask.to(mat.dtype)
    if agg_mode == "token-mean":
        agg = (mat * m).sum() / m.sum()
    elif agg_mode == "seq-mean-token-mean":
        agg = ((mat * m).sum(-1) / m.sum(-1)).mean()
    elif agg_mode == "seq-mean-token-sum":
        agg = (mat * m).sum(-1).mean()
    else:
        raise AssertionError(agg_mode)
    clipfrac = ((l2 > l1).to(m.dtype) * m).sum() / m.sum()
    return 0.5 * agg, clipfrac


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_value_loss_matches_verl_on_random_tensors(mode):
    g = torch.Generator().manual_seed(7)
    B, T = 12, 9
    vpreds = torch.randn(B, T, generator=g, dtype=torch.float64)
    old = vpreds + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    returns = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    loss, st = value_loss(vpreds, old, returns, mask, cliprange=0.3, agg_mode=mode)
    ref_loss, ref_clipfrac = verl_value_loss(vpreds, returns, old, mask, 0.3, mode)
    close(loss, float(ref_loss))
    close(st["vf_clipped"] / st["vf_tokens"], float(ref_clipfrac))
    assert 0 < float(ref_clipfrac) < 1  # both branches in play


def test_value_loss_split_into_parts_sums_to_the_whole():
    """Micro-batches with the global normalisers sum to the whole batch's loss (the rule
    that makes 2 ranks equal 1)."""
    g = torch.Generator().manual_seed(3)
    v, old, r = (torch.randn(6, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[:, 0] = True
    for mode in ("token-mean", "seq-mean-token-mean"):
        whole, _ = value_loss(v, old, r, mask, cliprange=0.2, agg_mode=mode)
        norm = AggNorm(num_tokens=float(mask.sum()), num_seqs=6.0)
        parts = sum(
            value_loss(v[s], old[s], r[s], mask[s], cliprange=0.2, agg_mode=mode, norm=norm)[0]
            for s in (slice(0, 2), slice(2, 6))
        )
        close(parts, float(whole))


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[True, True, True, False]])
    # Perfect values: var(R - V) = 0 -> 1 - 0 / (1 + 1e-5).
    close(explained_variance(returns, returns, mask), 1.0)
    # A constant: var(R - c) = var(R) = 1 -> 1 - 1 / (1 + 1e-5).
    close(explained_variance(returns, torch.full_like(returns, 7.0), mask), 1 - 1 / (1 + 1e-5))
    # V = [3, 2, 1]: R - V = [-2, 0, 2], unbiased var 4 -> 1 - 4 / (1 + 1e-5).
    values = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    close(explained_variance(returns, values, mask), 1 - 4 / (1 + 1e-5))


def test_kl_in_reward_by_hand():
    scores = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0], [-0.5, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    # k1 = logp - ref: row 0 [0.5, -1.0], row 1 [0.0, (masked)].
    rewards, kl = kl_in_reward(scores, logp, ref, mask, coef=0.1, kind="k1")
    close(rewards, [[-0.05, 1.1], [2.0, 0.0]])
    # Per-sequence token means: -0.25 and 0 -> mean -0.125.
    close(kl, -0.125)
    # The k3 estimator is the losses' one, applied token by token.
    rewards, _ = kl_in_reward(scores, logp, ref, mask, coef=0.1, kind="k3")
    k3 = kl_penalty(logp, ref, "k3")
    close(rewards[0], (scores[0] - 0.1 * k3[0]).tolist())


def test_kl_controllers():
    fixed = KLController(0.05)
    fixed.update(10.0, 256)
    assert fixed.value == 0.05
    ctrl = KLController(0.1, kind="adaptive", target=0.1, horizon=1000)
    ctrl.update(0.5, 100)  # error clipped at +0.2: x (1 + 0.2 * 100 / 1000)
    assert math.isclose(ctrl.value, 0.1 * 1.02)
    ctrl.update(0.09, 100)  # error -0.1: x (1 - 0.1 * 0.1)
    assert math.isclose(ctrl.value, 0.1 * 1.02 * 0.99)
