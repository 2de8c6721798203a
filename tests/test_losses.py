"""The decoupled, importance-corrected PPO loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import load_config
from learner.losses import (
    AggNorm,
    LossConfig,
    aggregate,
    importance_weights,
    kl_penalty,
    policy_loss,
    summarize_stats,
)

LN = math.log


def close(a, b, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float32),
        torch.as_tensor(b, dtype=torch.float32),
        atol=tol,
        rtol=0,
    )


# --------------------------------------------------------------- PPO clipping, w = 1
# Two sequences, T = 3; eps_low 0.2, eps_high 0.28 (clip range [0.8, 1.28]).
#   seq 0, A = +1: r = 1.5 -> min(1.5, 1.28) = 1.28 (clipped high) -> loss -1.28
#                  r = 0.5 -> min(0.5, 0.8) = 0.5                  -> loss -0.5
#   seq 1, A = -1: r = 0.5 -> min(-0.5, -0.8) = -0.8 (clipped low) -> loss  0.8
#                  r = 1.5 -> min(-1.5, -1.28) = -1.5              -> loss  1.5
#                  r = 1.0                                          -> loss  1.0
# Token losses: [-1.28, -0.5 | 0.8, 1.5, 1.0]
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]])
MASK = torch.tensor([[True, True, False], [True, True, True]])
ADV = torch.tensor([1.0, -1.0])
PROX = torch.full((2, 3), -2.0)
EXPECTED_AGG = {
    "token-mean": (-1.28 - 0.5 + 0.8 + 1.5 + 1.0) / 5,  # 0.304
    "seq-mean-token-mean": ((-1.28 - 0.5) / 2 + (0.8 + 1.5 + 1.0) / 3) / 2,  # 0.105
    "seq-mean-token-sum": ((-1.28 - 0.5) + (0.8 + 1.5 + 1.0)) / 2,  # 0.76
    "seq-mean-token-sum-norm": 1.52 / (2 * 4),  # norm_const 4 -> 0.19
}


def ppo_case(mode: str = "token-mean", importance: str = "none"):
    logprobs = (PROX + torch.log(RATIOS)).requires_grad_(True)
    cfg = LossConfig(agg_mode=mode, norm_const=4.0, importance_mode=importance)
    return logprobs, policy_loss(logprobs, PROX, PROX, ADV, MASK, cfg)


@pytest.mark.parametrize("mode", sorted(EXPECTED_AGG))
def test_clipping_both_sides_each_aggregation(mode):
    _, (loss, stats) = ppo_case(mode)
    close(loss, EXPECTED_AGG[mode])
    m = summarize_stats({k: float(v) for k, v in stats.items()}, "none")
    close(m["actor/pg_clipfrac"], 2 / 5)
    close(m["actor/pg_clipfrac_lower"], 1 / 5)
    close(m["actor/pg_clipfrac_upper"], 1 / 5)
    # ppo_kl = mean(p - l) = -(ln 1.5 + ln 0.5 + ln 0.5 + ln 1.5 + 0) / 5
    close(m["actor/ppo_kl"], -(2 * LN(0.75)) / 5)


def test_gradient_flows_only_through_unclipped_tokens():
    logprobs, (loss, _) = ppo_case("token-mean")
    loss.backward()
    # d(-A r)/dl = -A r for unclipped tokens, 0 for clipped ones, over 5 tokens.
    expected = torch.tensor([[0.0, -0.5, 0.0], [0.0, 1.5, 1.0]]) / 5
    close(logprobs.grad, expected)


# --------------------------------------------------------------- importance weights
# r = 1 everywhere (l = p), A = +1, one sequence; w = exp(p - b) = [0.5, 3.0, 1.0], cap 2.
W = torch.tensor([[0.5, 3.0, 1.0]])
ONE = torch.ones(1, 3, dtype=torch.bool)


def weighted(mode: str, level: str = "token", w=W, mask=ONE, adv=None):
    adv = torch.tensor([1.0]) if adv is None else adv
    p = torch.full(w.shape, -1.0)
    b = p - torch.log(w)
    cfg = LossConfig(importance_mode=mode, importance_cap=2.0, importance_level=level)
    loss, stats = policy_loss(p.clone(), p, b, adv, mask, cfg)
    return loss, summarize_stats({k: float(v) for k, v in stats.items()}, mode)


def test_tis_truncates_at_cap():
    loss, m = weighted("tis")
    close(loss, -(0.5 + 2.0 + 1.0) / 3)  # -1.1666667
    close(m["importance/truncated_frac"], 1 / 3)
    close(m["importance/masked_frac"], 0.0)
    close(m["importance/w_mean"], 1.5)  # raw weights: (0.5 + 3 + 1) / 3
    close(m["importance/w_max"], 3.0)
    close(m["importance/ess"], 4.5**2 / (3 * (0.25 + 9 + 1)))  # 0.6585366
    # mismatch KL = mean(b - p) = mean(-ln w) = -(ln 0.5 + ln 3) / 3
    close(m["importance/mismatch_kl"], -(LN(0.5) + LN(3.0)) / 3)
    close(m["importance/log_w_abs_max"], LN(3.0))


def test_mis_masks_the_token_but_keeps_it_in_the_normaliser():
    loss, m = weighted("mis")
    close(loss, -(0.5 + 0.0 + 1.0) / 3)  # -0.5
    close(m["importance/masked_frac"], 1 / 3)
    close(m["importance/truncated_frac"], 0.0)


def test_none_ignores_the_weights():
    loss, m = weighted("none")
    close(loss, -1.0)
    close(m["importance/w_max"], 3.0)  # still reported


def test_sequence_level_uses_the_geometric_mean():
    # seq 0: w = [0.5, 2] -> exp((ln 0.5 + ln 2) / 2) = 1;  seq 1: w = [4, 4] -> 4.
    w = torch.tensor([[0.5, 2.0], [4.0, 4.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])
    loss, m = weighted("tis", "sequence", w, mask, adv)
    close(loss, -(1 + 1 + 2 + 2) / 4)  # seq 1 truncated to 2 -> -1.5
    close(m["importance/w_max"], 4.0)
    close(m["importance/truncated_frac"], 1 / 2)  # one of two sequences
    loss, m = weighted("mis", "sequence", w, mask, adv)
    close(loss, -(1 + 1 + 0 + 0) / 4)  # seq 1 masked -> -0.5
    close(m["importance/masked_frac"], 1 / 2)
    loss, _ = weighted("tis", "token", w, mask, adv)
    close(loss, -(0.5 + 2 + 2 + 2) / 4)  # token level: -1.625


def test_importance_weights_outputs():
    p = torch.zeros(1, 3)
    b = -torch.log(W)
    applied, keep, raw = importance_weights(p, b, ONE, mode="mis", cap=2.0, level="token")
    close(raw, W)
    close(applied, [[0.5, 0.0, 1.0]])
    assert keep.tolist() == [[True, False, True]]


# --------------------------------------------------------------- non-finite behaviour
def test_non_finite_behaviour_tokens_are_dropped_and_counted():
    p = torch.full((1, 4), -1.0)
    b = torch.tensor([[-1.0, float("nan"), float("-inf"), -1.0]])
    lp = p.clone().requires_grad_(True)
    loss, stats = policy_loss(
        lp, p, b, torch.tensor([2.0]), torch.ones(1, 4, dtype=torch.bool), LossConfig()
    )
    close(loss, -2.0)  # mean over the two valid tokens of -(w=1)*(r=1)*(A=2)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    close(lp.grad, [[-1.0, 0.0, 0.0, -1.0]])  # -A / 2 on the valid tokens only
    assert float(stats["nonfinite"]) == 2 and float(stats["tokens"]) == 2


# --------------------------------------------------------------- KL and entropy
def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # l - ref = 0.5
    close(kl_penalty(lp, ref, "k1"), [0.5])
    close(kl_penalty(lp, ref, "k2"), [0.125])
    close(kl_penalty(lp, ref, "k3"), [math.exp(-0.5) + 0.5 - 1])  # 0.1065307


def test_kl_abs_and_the_straight_through_kinds():
    """veRL's abs is |l - ref|; a "+" kind (veRL's k3+) keeps its estimator's value and
    takes k2's gradient, l - ref, whose expectation is the KL's gradient."""
    ref = torch.tensor([-1.5, -0.2])
    e = math.exp
    # l - ref = [0.5, -0.5]; value and d value / d l of each kind, by hand
    k1 = ([0.5, -0.5], [1.0, 1.0])
    k3 = ([e(-0.5) + 0.5 - 1, e(0.5) - 0.5 - 1], [1 - e(-0.5), 1 - e(0.5)])  # e^(ref-l)-(ref-l)-1
    absolute = ([0.5, 0.5], [1.0, -1.0])  # the sign of l - ref
    k2_grad = [0.5, -0.5]
    expected = {
        "k1": k1,
        "k3": k3,
        "abs": absolute,
        "k2": ([0.125, 0.125], k2_grad),
        "k1+": (k1[0], k2_grad),
        "k3+": (k3[0], k2_grad),
        "abs+": (absolute[0], k2_grad),
    }
    for kind, (want_value, want_grad) in expected.items():
        lp = torch.tensor([-1.0, -0.7], requires_grad=True)
        value = kl_penalty(lp, ref, kind)
        close(value, want_value)
        value.sum().backward()
        close(lp.grad, want_grad)
    with pytest.raises(ValueError, match="not in"):
        kl_penalty(ref, ref, "full")


def test_verl_kl_names_load():
    from asyncrl.config import load_config

    # veRL takes "+" on any estimator; on k2 (mse), whose gradient "+" borrows, it is k2
    names = [("low_var_kl+", "k3+"), ("abs", "abs"), ("kl+", "k1+"), ("mse", "k2")]
    for verl, ours in [*names, ("mse+", "k2"), ("k2+", "k2")]:
        cfg = load_config(
            None, [f"actor_rollout_ref.actor.kl_loss_type={verl}", f"algorithm.kl_penalty={verl}"]
        )
        assert cfg.actor.kl_loss_type == ours and cfg.algorithm.kl_penalty == ours


def test_kl_and_entropy_terms_enter_the_loss():
    p = torch.full((1, 2), -1.0)
    mask = torch.ones(1, 2, dtype=torch.bool)
    ref = torch.tensor([[-1.5, -1.0]])  # k3 = [0.1065307, 0]
    ent = torch.tensor([[2.0, 4.0]])
    cfg = LossConfig(kl_coef=0.1, kl_type="k3", entropy_coeff=0.01)
    loss, stats = policy_loss(
        p.clone(), p, p, torch.tensor([0.0]), mask, cfg, entropy=ent, ref_logprobs=ref
    )
    close(loss, 0.1 * (0.1065307 / 2) - 0.01 * 3.0)
    close(stats["kl_loss"], 0.1065307 / 2)
    close(stats["entropy_loss"], 3.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(p, p, p, torch.tensor([0.0]), mask, cfg, entropy=ent)
    # At coefficient 0 (the default) the term is still measured (loss/entropy read 0 on
    # every step of the demo), and the loss does not move.
    off = LossConfig(entropy_coeff=0.0)
    loss, stats = policy_loss(p.clone(), p, p, torch.tensor([0.0]), mask, off, entropy=ent)
    close(stats["entropy_loss"], 3.0)
    close(loss, 0.0)


def test_use_kl_loss_at_coefficient_0_measures_the_kl_and_adds_none():
    """veRL's use_kl_loss with kl_loss_coef=0: the KL to the reference is computed and
    logged (a run watching its drift), and the loss is the plain policy loss."""
    p = torch.full((1, 2), -1.0)
    mask = torch.ones(1, 2, dtype=torch.bool)
    ref = torch.tensor([[-1.5, -1.0]])  # k3 = [0.1065307, 0]
    track = LossConfig(kl_coef=0.0, kl_type="k3", kl_track=True)
    loss, stats = policy_loss(p.clone(), p, p, torch.tensor([0.5]), mask, track, ref_logprobs=ref)
    plain, plain_stats = policy_loss(p.clone(), p, p, torch.tensor([0.5]), mask, LossConfig())
    close(loss, plain)
    close(stats["kl_loss"], 0.1065307 / 2)
    close(stats["ref_kl"], 0.1065307)
    close(plain_stats["ref_kl"], 0.0)
    cfg = load_config("configs/cpu_demo.yaml", ["actor.use_kl_loss=true", "actor.kl_loss_coef=0"])
    assert LossConfig.from_config(cfg).kl_track


# --------------------------------------------------------------- global normalisers
@pytest.mark.parametrize("mode", sorted(EXPECTED_AGG))
def test_split_batch_with_global_norm_sums_to_the_whole(mode):
    torch.manual_seed(0)
    loss_mat = torch.randn(4, 5)
    mask = torch.rand(4, 5) > 0.3
    mask[:, 0] = True
    whole = aggregate(loss_mat, mask, mode, norm_const=5.0)
    norm = AggNorm(num_tokens=float(mask.sum()), num_seqs=4.0)
    parts = sum(
        aggregate(loss_mat[s], mask[s], mode, norm_const=5.0, norm=norm)
        for s in (slice(0, 1), slice(1, 4))
    )
    close(parts, whole)


def test_config_validation():
    with pytest.raises(ValueError, match="agg_mode"):
        LossConfig(agg_mode="sum")
    with pytest.raises(ValueError, match="importance_mode"):
        LossConfig(importance_mode="cap")
