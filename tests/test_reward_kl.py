"""The KL penalty in the reward (``algorithm.use_kl_in_reward``, :mod:`learner.reward_kl`)
with REINFORCE++: equal to veRL's ``apply_kl_penalty`` then its REINFORCE++ returns on
random tensors, and wired into the trainer's step on the tiny model. (With GAE, the critic's
tests train with it on, and resume its adaptive coefficient.)"""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import load_config
from learner.trainer import Trainer
from tests.test_advantages import verl_reinforce_pp
from tests.trainer_helpers import synthetic_batch

BATCHES = [synthetic_batch(s) for s in range(2)]


def verl_kl(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """veRL's ``core_algos.kl_penalty`` written out for the kinds used here (k1 is its
    "kl", k3 its "low_var_kl", with its clamps)."""
    if kind == "k1":
        return logp - ref
    if kind == "abs":
        return (logp - ref).abs()
    assert kind == "k3", kind
    kl = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


@pytest.mark.parametrize("kind", ["k1", "k3", "abs"])
def test_reinforce_plus_plus_with_the_kl_in_the_reward_matches_verl(kind):
    """``algorithm.use_kl_in_reward`` with REINFORCE++ (the paper's setting): veRL's
    ``apply_kl_penalty`` (score on the last token, ``- beta * kl`` on every token) then its
    REINFORCE++ returns, against the learner's path (learner.reward_kl's penalty then
    learner.advantages), on random logprobs and responses of random lengths."""
    from learner.advantages import outcome_token_rewards, reinforce_pp_advantages
    from learner.values import kl_in_reward

    g = torch.Generator().manual_seed(len(kind))
    B, T, beta = 10, 9, 0.05
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    scores = torch.randint(0, 2, (B,), generator=g).to(torch.float64)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    m = mask.to(torch.float64)
    verl_scores = torch.zeros(B, T, dtype=torch.float64)
    verl_scores[torch.arange(B), lengths - 1] = scores
    verl_rewards = verl_scores - beta * verl_kl(logp, ref, kind) * m
    expected = verl_reinforce_pp(verl_rewards, mask, 0.99)
    rewards, kl = kl_in_reward(
        outcome_token_rewards(scores, mask), logp, ref, mask, coef=beta, kind=kind
    )
    torch.testing.assert_close(
        reinforce_pp_advantages(rewards, mask, 0.99), expected, atol=1e-6, rtol=0
    )
    per_seq = (verl_kl(logp, ref, kind) * m).sum(1) / m.sum(1)
    assert kl == pytest.approx(float(per_seq.mean()), rel=1e-9)


def test_reinforce_plus_plus_takes_the_kl_in_the_reward(tiny_model, single_rank, monkeypatch):
    """With ``algorithm.use_kl_in_reward`` the token rewards REINFORCE++ reads carry the
    penalty: on the second step (the policy has moved off the reference) they fall short
    of the outcome rewards by ``beta`` times a KL whose mean is the step's
    ``actor/reward_kl_penalty``, and the advantages are REINFORCE++'s of those rewards."""
    from learner import trainer as trainer_module
    from learner.rollouts import outcome_rewards, response_mask

    seen: list[tuple[list, torch.Tensor]] = []
    real = trainer_module.token_advantages

    def recording(rollouts, kept, estimator, gamma, token_rewards=None):
        seen.append((kept, token_rewards))
        out = real(rollouts, kept, estimator, gamma, token_rewards)
        mask, _ = response_mask(kept)
        expected = verl_reinforce_pp(token_rewards, mask, gamma)  # veRL's, written out
        for i, adv in out.items():
            torch.testing.assert_close(adv, expected[i, : len(adv)])
        return out

    monkeypatch.setattr(trainer_module, "token_advantages", recording)
    beta = 0.5
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model}",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.use_kl_in_reward=true",
            f"algorithm.kl_ctrl.kl_coef={beta}",
            "actor.optim.lr=1e-2",
            "actor.ppo_mini_batch_size=4",
        ],
    )
    trainer = Trainer(cfg)
    trainer.train_step(BATCHES[0], 1.0)
    metrics = trainer.train_step(BATCHES[1], 1.0)
    assert metrics["actor/reward_kl_penalty_coeff"] == beta
    kl = metrics["actor/reward_kl_penalty"]
    assert kl != 0.0  # the policy moved off the reference in step 1
    kept, rewards = seen[-1]
    mask, _ = response_mask(kept)
    penalty = (outcome_rewards(kept) - rewards) / beta
    per_seq = (penalty * mask).sum(1) / mask.sum(1)
    assert float(per_seq.mean()) == pytest.approx(kl, rel=1e-5)
