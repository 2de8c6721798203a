"""The KL penalty in the reward (``algorithm.use_kl_in_reward``) with the group estimators
(GRPO, Dr.GRPO, RLOO, REINFORCE++ with a baseline), as veRL runs them: ``apply_kl_penalty``
(score on the last response token, ``- beta * KL_t`` on every response token) and then the
estimator on ``token_level_rewards.sum(-1)``, so that each response's score loses
``beta`` times its summed KL before the group statistics.

On random tensors the learner's path (:func:`learner.reward_kl.token_rewards`, then
:func:`learner.rollouts.baseline_advantages` / :func:`~learner.rollouts.token_advantages`)
equals veRL's formulas written out here, with a fixed and an adaptive coefficient; the
config takes the key with every estimator; and a train step on the tiny model trains on
the penalised advantages once the policy has moved off the reference."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.config.advisories import config_advisories
from learner.reward_kl import RewardKL, token_rewards
from learner.rollouts import Rollout, baseline_advantages, group_indices, token_advantages
from learner.trainer import Trainer
from tests.test_advantages import verl_reinforce_pp_baseline
from tests.test_reward_kl import verl_kl
from tests.trainer_helpers import synthetic_batch

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
# Group sizes 3, 4, 1 (a group of one: veRL's mean 0, std 1), 2 and 4, interleaved.
INDEX = torch.tensor([0, 1, 0, 2, 1, 3, 0, 1, 3, 4, 1, 4, 4, 4])
T = 9


# ------------------------------------------------------------------ veRL, written out
def verl_apply_kl_penalty(scores, logp, ref, mask, beta, kind):
    """veRL's ``apply_kl_penalty``: ``token_level_scores - beta * kld * mask`` and the
    batch's KL (per-sequence masked mean, then the mean over sequences)."""
    m = mask.to(logp.dtype)
    kld = verl_kl(logp, ref, kind) * m
    current = float((kld.sum(-1) / m.sum(-1)).mean())
    return scores - beta * kld, current


def verl_group_scores(token_level_rewards, index, estimator, norm_by_std=True, eps=1e-6):
    """veRL's outcome estimators from ``scores = token_level_rewards.sum(-1)``: GRPO (mean 0
    and std 1 for a group of one; unbiased std), Dr.GRPO (GRPO without the std), RLOO
    (``score * n / (n - 1) - mean * n / (n - 1)``, a group of one keeps its score)."""
    scores = token_level_rewards.sum(dim=-1)
    out = scores.clone()
    for g in set(index.tolist()):
        members = index == g
        s, n = scores[members], int(members.sum())
        if estimator in ("grpo", "dr_grpo"):
            mean = s.mean() if n > 1 else torch.zeros(())
            std = torch.std(s) if n > 1 else torch.ones(())
            if estimator == "grpo" and norm_by_std:
                out[members] = (s - mean) / (std + eps)
            else:
                out[members] = s - mean
        else:
            assert estimator == "rloo", estimator
            if n > 1:
                out[members] = s * n / (n - 1) - s.mean() * n / (n - 1)
    return out


class VerlAdaptiveKL:
    """veRL's ``AdaptiveKLController``."""

    def __init__(self, value, target, horizon):
        self.value, self.target, self.horizon = value, target, horizon

    def update(self, current_kl, n_steps):
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# ------------------------------------------------------------------ random batches
def random_batch(seed: int):
    """Rollouts of groups ``INDEX`` with responses of random lengths (some with a masked
    span, as a multi-turn response's tool output), random scores, and random proximal and
    reference logprobs (float32). Returns the rollouts, the logprob dicts the trainer
    passes, and the same data as veRL's padded tensors (score on the last token)."""
    g = torch.Generator().manual_seed(seed)
    B = len(INDEX)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    for i in range(0, B, 3):  # a hole inside every third response long enough for one
        if lengths[i] >= 4:
            mask[i, 1:3] = False
    rewards = torch.randn(B, generator=g)
    logp = -torch.rand(B, T, generator=g) * 3
    ref = -torch.rand(B, T, generator=g) * 3
    batch, proximal, reference = [], {}, {}
    for i in range(B):
        n = int(lengths[i])
        holes = bool((~mask[i, :n]).any())
        batch.append(
            Rollout(
                [1, 2, 3],
                [7] * n,
                [-1.0] * n,
                float(rewards[i]),
                f"g{int(INDEX[i])}",
                loss_mask=mask[i, :n].to(torch.int64).tolist() if holes else None,
            )
        )
        proximal[i], reference[i] = logp[i, :n].clone(), ref[i, :n].clone()
    scores = torch.zeros(B, T)
    scores[torch.arange(B), lengths - 1] = rewards
    return batch, proximal, reference, (scores, logp, ref, mask)


def learner_advantages(estimator, batch, rewards, norm_by_std=True):
    """The learner's advantages of ``batch`` from its penalised token rewards, ``[B]``
    (GRPO, Dr.GRPO, RLOO) or per row ``[T_i]`` (REINFORCE++ with a baseline)."""
    if estimator == "reinforce_plus_plus_baseline":
        return token_advantages(batch, batch, estimator, 1.0, rewards)
    return baseline_advantages(
        batch, batch, estimator, norm_by_std=norm_by_std, token_rewards=rewards
    )


def verl_advantages(estimator, verl_rewards, mask, norm_by_std=True):
    if estimator == "reinforce_plus_plus_baseline":
        return verl_reinforce_pp_baseline(verl_rewards.sum(-1), INDEX, mask)
    return verl_group_scores(verl_rewards, INDEX, estimator, norm_by_std)


def assert_matches(estimator, got, expected, lengths):
    if estimator == "reinforce_plus_plus_baseline":
        for i, n in enumerate(lengths):
            torch.testing.assert_close(got[i], expected[i, :n], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def reward_kl_config(estimator: str, *extra: str):
    return load_config(
        None,
        [f"algorithm.adv_estimator={estimator}", "algorithm.use_kl_in_reward=true", *extra],
    )


@pytest.mark.parametrize("kind", ["k1", "k3"])
@pytest.mark.parametrize("estimator", [*GROUP_ESTIMATORS, "grpo-no-std"])
def test_group_estimators_with_a_fixed_coefficient_match_verl(estimator, kind):
    """A fixed ``beta``: veRL's ``apply_kl_penalty`` then its estimator on the summed token
    rewards, against the learner's path on two random batches (the coefficient stays)."""
    norm_by_std = estimator != "grpo-no-std"
    estimator = estimator.removesuffix("-no-std")
    beta = 0.3
    cfg = reward_kl_config(
        estimator, f"algorithm.kl_ctrl.kl_coef={beta}", f"algorithm.kl_penalty={kind}"
    )
    reward_kl = RewardKL(cfg, world_size=1)
    for seed in (1, 2):
        batch, proximal, ref, (scores, logp, ref_t, mask) = random_batch(seed)
        metrics: dict[str, float] = {}
        rewards = token_rewards(estimator, batch, reward_kl, proximal, ref, metrics)
        assert rewards is not None
        got = learner_advantages(estimator, batch, rewards, norm_by_std)
        verl_rewards, current = verl_apply_kl_penalty(scores, logp, ref_t, mask, beta, kind)
        expected = verl_advantages(estimator, verl_rewards, mask, norm_by_std)
        assert_matches(estimator, got, expected, [len(r.response_ids) for r in batch])
        assert metrics["actor/reward_kl_penalty_coeff"] == beta
        assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-5)
        # the penalty moved the advantages: not those of the raw scores
        plain = verl_advantages(estimator, scores, mask, norm_by_std)
        assert not torch.allclose(
            expected if estimator != "reinforce_plus_plus_baseline" else expected[mask],
            plain if estimator != "reinforce_plus_plus_baseline" else plain[mask],
            atol=1e-3,
        )


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_with_an_adaptive_coefficient_match_verl(estimator):
    """An adaptive ``beta`` over three batches: each batch is penalised with the
    coefficient veRL's controller holds after the batches before it, and the advantages
    are veRL's estimator on the summed rewards."""
    start, target, horizon = 0.2, 0.05, 20
    cfg = reward_kl_config(
        estimator,
        "algorithm.kl_ctrl.type=adaptive",
        f"algorithm.kl_ctrl.kl_coef={start}",
        f"algorithm.kl_ctrl.target_kl={target}",
        f"algorithm.kl_ctrl.horizon={horizon}",
        "algorithm.kl_penalty=low_var_kl",
    )
    reward_kl = RewardKL(cfg, world_size=1)
    verl_ctrl = VerlAdaptiveKL(start, target, horizon)
    betas = []
    for seed in (3, 4, 5):
        batch, proximal, ref, (scores, logp, ref_t, mask) = random_batch(seed)
        metrics: dict[str, float] = {}
        rewards = token_rewards(estimator, batch, reward_kl, proximal, ref, metrics)
        assert rewards is not None
        got = learner_advantages(estimator, batch, rewards)
        verl_rewards, current = verl_apply_kl_penalty(
            scores, logp, ref_t, mask, verl_ctrl.value, "k3"
        )
        assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(verl_ctrl.value)
        betas.append(verl_ctrl.value)
        verl_ctrl.update(current, len(batch))
        expected = verl_advantages(estimator, verl_rewards, mask)
        assert_matches(estimator, got, expected, [len(r.response_ids) for r in batch])
    assert betas[0] == start and betas[1] != start and betas[2] != betas[1]  # it moved
    assert reward_kl.ctrl.value == pytest.approx(verl_ctrl.value)


def test_a_split_episode_pays_the_kl_of_all_its_samples_once():
    """A multi-turn episode that reached the learner as two samples scores as the episode
    sent whole: its reward less ``beta`` times the KL over both samples' tokens, counted
    once in its group; a member cleaned from the batch keeps its raw score."""
    beta = 0.4
    reward_kl = RewardKL(reward_kl_config("grpo", f"algorithm.kl_ctrl.kl_coef={beta}"), 1)
    g = torch.Generator().manual_seed(11)
    first, second, other = (-torch.rand(n, generator=g) * 2 for n in (3, 4, 5))
    refs = [-torch.rand(n, generator=g) * 2 for n in (3, 4, 5)]
    whole = [
        Rollout([1], [5] * 7, [-1.0] * 7, 1.0, "g"),
        Rollout([1], [5] * 5, [-1.0] * 5, 0.0, "g"),
    ]
    split = [
        Rollout([1], [5] * 3, [-1.0] * 3, 1.0, "g", episode="e"),
        Rollout([1, 5, 5, 5], [5] * 4, [-1.0] * 4, 1.0, "g", episode="e"),
        Rollout([1], [5] * 5, [-1.0] * 5, 0.0, "g"),
    ]
    whole_p = {0: torch.cat([first, second]), 1: other}
    whole_r = {0: torch.cat(refs[:2]), 1: refs[2]}
    split_p = {0: first, 1: second, 2: other}
    split_r = {0: refs[0], 1: refs[1], 2: refs[2]}
    got = {}
    for name, batch, p, r in (
        ("whole", whole, whole_p, whole_r),
        ("split", split, split_p, split_r),
    ):
        rewards = token_rewards("grpo", batch, reward_kl, p, r, {})
        got[name] = baseline_advantages(batch, batch, "grpo", token_rewards=rewards)
    torch.testing.assert_close(got["split"], got["whole"][[0, 0, 1]], atol=1e-6, rtol=0)
    scores = torch.tensor(
        [
            1.0 - beta * float((whole_p[0] - whole_r[0]).sum()),
            -beta * float((other - refs[2]).sum()),
        ]
    )
    expected = verl_group_scores(scores[:, None], torch.tensor([0, 0]), "grpo")
    torch.testing.assert_close(got["whole"], expected, atol=1e-5, rtol=1e-5)
    # a third member, cleaned away (empty response), stays in the baseline with its score
    dropped = Rollout([1], [], [], 0.5, "g")
    rewards = token_rewards("grpo", whole, reward_kl, whole_p, whole_r, {})
    with_dropped = baseline_advantages([*whole, dropped], whole, "grpo", token_rewards=rewards)
    three = verl_group_scores(
        torch.cat([scores, torch.tensor([0.5])])[:, None], torch.tensor([0, 0, 0]), "grpo"
    )
    torch.testing.assert_close(with_dropped, three[:2], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_the_config_takes_the_kl_in_the_reward_with_every_estimator(estimator):
    """veRL's ``examples/rloo_trainer/run_qwen2-7b.sh`` (rloo with use_kl_in_reward) and the
    same with grpo and the other group estimators load, refused no more (gae and
    reinforce_plus_plus always did: tests/test_critic.py, tests/test_reward_kl.py)."""
    cfg = reward_kl_config(estimator, "algorithm.kl_ctrl.kl_coef=0.001")
    assert cfg.algorithm.use_kl_in_reward and cfg.algorithm.adv_estimator == estimator
    assert not any("use_kl_in_reward" in line for line in config_advisories(cfg))


def test_the_unused_coefficient_advice_no_longer_says_grpo_reads_no_token_rewards():
    """``kl_ctrl.kl_coef`` given with no penalty on, with grpo: the advice offers the KL in
    the reward too, and no longer says GRPO reads no token rewards."""
    for estimator in ("grpo", "rloo"):
        cfg = load_config(
            None, [f"algorithm.adv_estimator={estimator}", "algorithm.kl_ctrl.kl_coef=0.01"]
        )
        [line] = config_advisories(cfg)
        assert "no token rewards" not in line
        assert "set algorithm.use_kl_in_reward=true" in line


# ------------------------------------------------------------------ the trainer
def test_a_grpo_step_trains_on_the_penalised_advantages(tiny_model, single_rank, monkeypatch):
    """GRPO with the KL in the reward on the tiny model: every step logs the KL metrics the
    GAE path logs; on the first step the policy is the reference (the advantages are the
    plain ones), on the second it has moved, and the advantages the loss reads are veRL's
    GRPO on the penalised token rewards, no longer the plain ones."""
    from learner import trainer as trainer_module

    recorded: list[tuple[list, torch.Tensor | None]] = []
    real = trainer_module.token_rewards

    def recording(estimator, kept, reward_kl, proximal, ref, metrics):
        out = real(estimator, kept, reward_kl, proximal, ref, metrics)
        recorded.append((kept, out))
        return out

    monkeypatch.setattr(trainer_module, "token_rewards", recording)
    beta = 0.5
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model}",
            "algorithm.adv_estimator=grpo",
            "algorithm.use_kl_in_reward=true",
            f"algorithm.kl_ctrl.kl_coef={beta}",
            "actor.optim.lr=1e-2",
            "actor.ppo_mini_batch_size=4",
        ],
    )
    trainer = Trainer(cfg)
    trained: dict[int, float] = {}  # the advantage each sequence's loss read
    real_collate = trainer._collate

    def collating(plan, seq_ids):
        mb = real_collate(plan, seq_ids)
        for b, sid in enumerate(mb.seq_ids):
            trained[sid] = float(mb.advantages[b])
        return mb

    monkeypatch.setattr(trainer, "_collate", collating)
    steps = []
    for batch in (synthetic_batch(0), synthetic_batch(1)):
        trained.clear()
        metrics = trainer.train_step(batch, 1.0)
        assert metrics["actor/updates"] >= 1
        for key in ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"):
            assert key in metrics, key
        assert metrics["actor/reward_kl_penalty_coeff"] == beta
        kept, rewards = recorded[-1]
        assert rewards is not None
        used = torch.tensor([trained[i] for i in range(len(kept))])
        plain = baseline_advantages(batch, kept, "grpo")
        steps.append((batch, kept, rewards, used, plain, metrics["actor/reward_kl_penalty"]))

    _, _, _, used, plain, kl = steps[0]
    assert abs(kl) < 1e-4  # the policy is the reference before the first update
    torch.testing.assert_close(used, plain, atol=1e-3, rtol=0)

    batch, kept, rewards, used, plain, kl = steps[1]
    assert abs(kl) > 1e-4  # the policy moved off the reference in step 1 (k1: any sign)
    assert (used - plain).abs().max() > 1e-3  # the penalty changed what the loss reads
    # veRL: GRPO on each response's summed penalised token rewards; the malformed member
    # (cleaned away: no forward pass, no KL) stays in its group's baseline with its score
    kept_at = [next(i for i, r in enumerate(batch) if r is k) for k in kept]
    assert len(kept_at) == len(batch) - 1
    scores = torch.tensor([float(r.reward) for r in batch], dtype=torch.float64)
    scores[kept_at] = rewards.sum(dim=-1).to(torch.float64)
    verl = verl_group_scores(scores[:, None], group_indices(batch), "grpo")[kept_at]
    torch.testing.assert_close(used, verl.to(torch.float32), atol=1e-5, rtol=1e-5)
