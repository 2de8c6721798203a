"""Advantage estimators against hand-computed values (veRL's conventions)."""

from __future__ import annotations

import pytest
import torch

from learner.advantages import (
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    loss_agg_mode_for,
    masked_whiten,
    outcome_advantages,
    outcome_token_rewards,
    rloo_advantages,
)

# Three groups, interleaved so that indexing mistakes show:
#   group 0: scores 1, 2, 3 -> mean 2, unbiased std 1
#   group 1: scores 0, 0    -> zero variance
#   group 2: score 5 alone  -> mean 0, std 1 (veRL's convention for a group of one)
SCORES = torch.tensor([1.0, 0.0, 2.0, 5.0, 0.0, 3.0])
GROUPS = torch.tensor([0, 1, 0, 2, 1, 0])


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), atol=tol, rtol=0)


def test_grpo_normalised_by_unbiased_std():
    eps = 1e-6
    close(
        grpo_advantages(SCORES, GROUPS),
        [-1 / (1 + eps), 0.0, 0.0, 5 / (1 + eps), 0.0, 1 / (1 + eps)],
    )


def test_grpo_std_of_two_members():
    # scores 1 and 4: mean 2.5, unbiased std = sqrt(((1.5)^2 * 2) / 1) = 2.1213203
    adv = grpo_advantages(torch.tensor([1.0, 4.0]), torch.tensor([0, 0]))
    close(adv, [-1.5 / (2.1213203 + 1e-6), 1.5 / (2.1213203 + 1e-6)])


def test_grpo_without_std_and_dr_grpo():
    expected = [-1.0, 0.0, 0.0, 5.0, 0.0, 1.0]
    close(grpo_advantages(SCORES, GROUPS, norm_by_std=False), expected)
    close(dr_grpo_advantages(SCORES, GROUPS), expected)


def test_zero_variance_group_gives_zero_not_nan():
    adv = grpo_advantages(torch.tensor([0.7, 0.7, 0.7]), torch.tensor([0, 0, 0]))
    close(adv, [0.0, 0.0, 0.0])


def test_rloo_baseline_is_mean_of_the_others():
    # group 0: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5; a lone 5 keeps 5.
    close(rloo_advantages(SCORES, GROUPS), [-1.5, 0.0, 0.0, 5.0, 0.0, 1.5])


def test_dispatch_and_dr_grpo_aggregation():
    close(outcome_advantages("rloo", SCORES, GROUPS), [-1.5, 0.0, 0.0, 5.0, 0.0, 1.5])
    close(
        outcome_advantages("grpo", SCORES, GROUPS, norm_by_std=False),
        [-1.0, 0.0, 0.0, 5.0, 0.0, 1.0],
    )
    with pytest.raises(ValueError, match="not an outcome estimator"):
        outcome_advantages("gae", SCORES, GROUPS)
    assert loss_agg_mode_for("dr_grpo", "token-mean") == "seq-mean-token-sum-norm"
    assert loss_agg_mode_for("grpo", "seq-mean-token-mean") == "seq-mean-token-mean"


def test_gae_by_hand():
    # Row 0: r = [0, 1], V = [0.5, 0.2], gamma 0.9, lam 0.5
    #   t=1: delta = 1 + 0 - 0.2 = 0.8                  -> A = 0.8,  R = 1.0
    #   t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32
    #        A = -0.32 + 0.9*0.5*0.8 = 0.04             -> R = 0.54
    # Row 1: one real token then padding: r = [2, .], V = [1, 99 (ignored)]
    #   t=0: delta = 2 + 0 - 1 = 1                      -> A = 1,    R = 2
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    values = torch.tensor([[0.5, 0.2], [1.0, 99.0]])
    mask = torch.tensor([[True, True], [True, False]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, whiten=False)
    close(adv, [[0.04, 0.8], [1.0, 0.0]])
    close(ret, [[0.54, 1.0], [2.0, 0.0]])
    # gamma = lam = 1: every advantage is the return-to-go minus the value.
    adv, ret = gae_advantages(rewards, values, mask, whiten=False)
    close(adv, [[0.5, 0.8], [1.0, 0.0]])
    close(ret, [[1.0, 1.0], [2.0, 0.0]])


def test_whitening_over_the_mask():
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[True, True], [True, False]])
    # mean 2, unbiased var 1 -> -1, 0, 1; the masked position is 0.
    close(masked_whiten(x, mask), [[-1.0, 0.0], [1.0, 0.0]], tol=1e-5)
    adv, _ = gae_advantages(
        torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    )
    assert abs(adv.sum().item()) < 1e-6


def test_outcome_rewards_sit_on_the_last_response_token():
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    close(
        outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask),
        [[0, 0, 1.0], [2.0, 0, 0], [0, 0, 0]],
    )


# --------------------------------------------------------------- cleaned members
def test_cleaned_members_still_count_in_their_group_baseline():
    """A member the learner cannot train on (an empty response, too long) still has a
    reward: it stays in its group's statistics, as in veRL where every sampled response is
    scored; only members without a finite reward leave the baseline."""
    from learner.rollouts import Rollout, baseline_advantages, clean_rollouts

    nan = float("nan")
    batch = [
        Rollout([1, 2], [3], [-0.1], 1.0, "g0"),
        Rollout([1, 2], [], [], 0.0, "g0"),  # empty response: cleaned away
        Rollout([1, 2], [3], [-0.1], 1.0, "g1"),
        Rollout([1, 2], [4], [-0.2], 0.0, "g1"),
        Rollout([1], [5], [-0.3], 2.0, "g2"),
        Rollout([1], [5], [-0.3], nan, "g2"),  # no reward: in no baseline
        Rollout([1], [5], [-0.3], 1e39, "g2"),  # inf in float32: no reward either
        Rollout([1], [6], [-0.3], 0.0, "g2"),
        Rollout([1], [7] * 20, [-0.3] * 20, 4.0, "g2"),  # too long: cleaned away
    ]
    kept, dropped = clean_rollouts(batch, max_len=8)
    assert [batch.index(r) for r in kept] == [0, 2, 3, 4, 7]
    assert dropped["nonfinite_reward"] == 2
    assert dropped["empty_response"] == dropped["too_long"] == 1
    eps, s2 = 1e-6, 2**-0.5
    # g0: scores 1, 0 -> mean 0.5, unbiased std sqrt(2 * 0.25) = 1/sqrt(2): +0.5 * sqrt(2).
    # g1: the same two scores, both kept. g2: scores 2, 0, 4 -> mean 2, unbiased std 2.
    grpo = baseline_advantages(batch, kept, "grpo")
    close(grpo, [0.5 / (s2 + eps), 0.5 / (s2 + eps), -0.5 / (s2 + eps), 0.0, -2 / (2 + eps)])
    close(baseline_advantages(batch, kept, "grpo", norm_by_std=False), [0.5, 0.5, -0.5, 0, -2])
    close(baseline_advantages(batch, kept, "dr_grpo"), [0.5, 0.5, -0.5, 0.0, -2.0])
    # RLOO: minus the mean of the others: g0 1 - 0; g2 2 - (0 + 4) / 2, 0 - (2 + 4) / 2.
    close(baseline_advantages(batch, kept, "rloo"), [1.0, 1.0, -1.0, 0.0, -3.0])
    assert baseline_advantages(batch, [], "grpo").shape == (0,)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_rewards_at_the_bound_give_finite_advantages(estimator):
    """The wire and the learner take rewards up to MAX_ABS_REWARD: a group of them keeps
    finite advantages in float32 (at float32's own limit RLOO's n/(n-1) * (r - mean) of
    +-3e38 was inf); past the bound a reward is no reward."""
    from asyncrl.wire.types import MAX_ABS_REWARD, usable_reward
    from learner.rollouts import Rollout, baseline_advantages

    for rewards in ([MAX_ABS_REWARD, -MAX_ABS_REWARD], [MAX_ABS_REWARD, -MAX_ABS_REWARD] * 4):
        batch = [Rollout([1], [2], [-0.1], r, "g") for r in rewards]
        assert torch.isfinite(baseline_advantages(batch, batch, estimator)).all(), rewards
    assert not usable_reward(MAX_ABS_REWARD * 1.01)


# --------------------------------------------------------------- GAE against veRL
def verl_gae(rewards, values, mask, gamma, lam):
    """veRL's ``compute_gae_advantage_return`` written out from its definition: the
    recursion multiplies by the mask (a masked token carries the state across), returns are
    advantages + values before whitening, and the whitening is over the mask with the
    unbiased variance and ``rsqrt(var + 1e-8)``."""
    m = mask.to(rewards.dtype)
    next_v = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    last = torch.zeros_like(next_v)
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        step = delta + gamma * lam * last
        next_v = values[:, t] * m[:, t] + (1 - m[:, t]) * next_v
        last = step * m[:, t] + (1 - m[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    returns = adv + values
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) ** 2) * m).sum() / (m.sum() - 1)
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_matches_verl_on_random_tensors(gamma, lam):
    """Random rewards and values, responses of random length (right padding) with holes
    inside (multi-turn tool output): equal on every response token."""
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    B, T = 16, 12
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    mask &= torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = verl_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv[mask], ref_adv[mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(ret[mask], ref_ret[mask], atol=1e-6, rtol=0)
    assert not adv[~mask].any() and not ret[~mask].any()


# --------------------------------------------------------------- REINFORCE++ against veRL
def _verl_whiten(x, m):
    mean = (x * m).sum() / m.sum()
    var = (((x - mean) ** 2) * m).sum() / (m.sum() - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8) * m


def verl_reinforce_pp(token_rewards, mask, gamma):
    """veRL's ``compute_reinforce_plus_plus_outcome_advantage`` written out: the running
    return, stored at every token, then multiplied by the mask (a masked token restarts it);
    whitened over the mask and masked."""
    m = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * m[:, t]
    return _verl_whiten(returns, m)


def verl_reinforce_pp_baseline(scores, index, mask):
    """veRL's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` written out: score
    minus its group's mean (0 for a group of one), tiled over the response, whitened over
    the mask and masked."""
    centered = scores.clone()
    for g in set(index.tolist()):
        members = index == g
        if int(members.sum()) > 1:
            centered[members] = scores[members] - scores[members].mean()
    m = mask.to(scores.dtype)
    return _verl_whiten(centered[:, None] * m, m)


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.9])
def test_reinforce_plus_plus_matches_verl_on_random_tensors(gamma):
    from learner.advantages import reinforce_pp_advantages

    g = torch.Generator().manual_seed(int(gamma * 1000))
    B, T = 12, 10
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]  # right padding, no holes
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    got = reinforce_pp_advantages(rewards, mask, gamma)
    torch.testing.assert_close(got, verl_reinforce_pp(rewards, mask, gamma), atol=1e-6, rtol=0)


def test_reinforce_plus_plus_lets_earlier_turns_see_the_outcome():
    """A multi-turn episode's tool output is masked inside the response. veRL's loop
    restarts the sum there, so the first turn's return is 0 whatever the outcome; here the
    sum passes over it: a won episode's first turn gets a higher advantage than a lost one's."""
    from learner.advantages import reinforce_pp_advantages

    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    rewards = torch.zeros(2, 6)
    rewards[0, 5] = 1.0  # won; the second episode scored 0
    ours = reinforce_pp_advantages(rewards, mask, 1.0)
    assert float(ours[0, 0]) > float(ours[1, 0])
    verl = verl_reinforce_pp(rewards, mask, 1.0)
    torch.testing.assert_close(verl[0, :2], verl[1, :2])  # veRL's: blind to the outcome


def test_reinforce_plus_plus_baseline_matches_verl_through_the_learners_path():
    """Through learner.rollouts.token_advantages, as the trainer calls it: outcome scores
    of random groups (one of a single member), responses of random lengths."""
    from learner.rollouts import Rollout, token_advantages

    g = torch.Generator().manual_seed(7)
    index = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    scores = torch.randint(0, 3, (len(index),), generator=g).to(torch.float32)
    lengths = torch.randint(1, 9, (len(index),), generator=g).tolist()
    batch = [
        Rollout([1, 2], [5] * n, [-0.5] * n, float(s), f"g{int(i)}")
        for i, s, n in zip(index, scores, lengths, strict=True)
    ]
    got = token_advantages(batch, batch, "reinforce_plus_plus_baseline", gamma=1.0)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    ref = verl_reinforce_pp_baseline(scores, index, mask)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(got[i], ref[i, :n], atol=1e-6, rtol=0)
    plain = token_advantages(batch, batch, "reinforce_plus_plus", gamma=0.9)
    rewards = outcome_token_rewards(scores, mask)
    ref = verl_reinforce_pp(rewards, mask, 0.9)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(plain[i], ref[i, :n], atol=1e-6, rtol=0)
