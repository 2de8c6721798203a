"""A multi-turn episode that reached the learner as several samples (a split: the chat
template rewrote history) trains exactly as the same episode sent as one sample whose tool
answer is masked out: the outcome is paid once, GAE and REINFORCE++ run across its samples,
the per-sequence loss modes count it once. Each test builds both layouts of one batch and
compares what every trained token gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from learner.advantages import gae_advantages, join_index, join_rows, split_rows
from learner.collate import pad_rows
from learner.critic import Critic
from learner.losses import LossConfig, policy_loss
from learner.plan import norm_counts, plan_step
from learner.reductions import AGG_MODES
from learner.reward_kl import RewardKL
from learner.rollouts import (
    Rollout,
    baseline_advantages,
    episode_rows,
    outcome_rewards,
    response_mask,
    token_advantages,
)
from learner.values import KLController, value_loss

# Episode A: 3 sampled tokens, a 2-token tool answer, 3 sampled tokens; reward 1.
A_BEHAVIOUR = [-1.0, -0.5, -2.0, -1.5, -0.7, -1.2]
GARBAGE = 99.0  # at masked positions: must never count


def batch(split: bool) -> list[Rollout]:
    """Episode A (split in two, or one sample with the tool answer masked), episode B of
    the same group, and a group of two single-turn rollouts (no episode)."""
    if split:
        a = [
            Rollout([1], [5, 5, 5], A_BEHAVIOUR[:3], 1.0, "g", episode=0),
            Rollout([1, 5, 5, 5, 7, 7], [6, 6, 6], A_BEHAVIOUR[3:], 1.0, "g", episode=0),
        ]
    else:
        lps = [*A_BEHAVIOUR[:3], 0.0, 0.0, *A_BEHAVIOUR[3:]]  # tool tokens: logprob 0
        mask = [1, 1, 1, 0, 0, 1, 1, 1]
        a = [Rollout([1], [5, 5, 5, 7, 7, 6, 6, 6], lps, 1.0, "g", loss_mask=mask, episode=0)]
    return [
        *a,
        Rollout([1], [8, 8, 8, 8], [-0.3, -0.4, -0.9, -1.1], 0.0, "g", episode=1),
        Rollout([2], [9, 9], [-0.2, -0.6], 0.5, "h"),
        Rollout([2], [9, 9, 9], [-0.8, -0.1, -0.5], 0.0, "h"),
    ]


N_TRAINED = 6 + 4 + 2 + 3  # the trained tokens of either layout, in batch order


def stream(seed: int) -> torch.Tensor:
    """One value per trained token, in batch order (the same for both layouts)."""
    return torch.randn(N_TRAINED, generator=torch.Generator().manual_seed(seed))


def rows(rollouts: list[Rollout], values: torch.Tensor) -> dict[int, torch.Tensor]:
    """``values`` (one per trained token) laid into each rollout's ``[T_i]``, garbage at
    the masked positions."""
    mask, lengths = response_mask(rollouts)
    out, k = {}, 0
    for i, n in enumerate(lengths):
        row = torch.full((n,), GARBAGE)
        m = mask[i, :n]
        row[m] = values[k : k + int(m.sum())]
        out[i] = row
        k += int(m.sum())
    return out


def trained(rollouts: list[Rollout], per_row: dict[int, torch.Tensor]) -> torch.Tensor:
    """What the trained tokens got, in batch order: comparable across layouts."""
    mask, lengths = response_mask(rollouts)
    return torch.cat([per_row[i][:n][mask[i, :n]] for i, n in enumerate(lengths)])


def both(fn) -> tuple[torch.Tensor, torch.Tensor]:
    return fn(batch(split=False)), fn(batch(split=True))


def assert_same(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(pair[1], pair[0], atol=1e-6, rtol=1e-6)


def test_the_outcome_is_paid_once_on_the_last_sample():
    split = batch(split=True)
    r = outcome_rewards(split)
    assert r[0, :3].tolist() == [0.0, 0.0, 0.0]  # the first sample's end is not the episode's
    assert r[1, :3].tolist() == [0.0, 0.0, 1.0]
    assert_same(both(lambda b: trained(b, dict(enumerate(outcome_rewards(b))))))


def test_gae_runs_across_the_samples_of_an_episode():
    # By hand (values 0, gamma 0.9, lam 1): the returns are 0.9^k from the episode's end,
    # k counting the trained tokens after it: the first turn sees the outcome.
    for rs in (batch(split=False), batch(split=True)):
        mask, _ = response_mask(rs)
        r = outcome_rewards(rs)
        _, ret = gae_advantages(
            r,
            torch.zeros_like(r),
            mask,
            gamma=0.9,
            lam=1.0,
            whiten=False,
            episodes=episode_rows(rs),
        )
        got = trained(rs, dict(enumerate(ret)))[:6]
        torch.testing.assert_close(got, torch.tensor([0.9**k for k in range(5, -1, -1)]))


def test_the_critics_targets_match_with_values_given():
    """Through :meth:`Critic.targets` (the critic's values stand in): whitened advantages,
    returns and the batch metrics, gamma and lam below 1."""
    values = stream(0)
    cfg = SimpleNamespace(algorithm=SimpleNamespace(gamma=0.9, lam=0.8))

    def targets(rs):
        critic = SimpleNamespace(cfg=cfg, values=lambda _: rows(rs, values))
        return Critic.targets(critic, rs, outcome_rewards(rs))  # type: ignore[arg-type]

    (one, m_one), (split, m_split) = both(targets)
    for field in ("advantages", "returns", "values"):
        assert_same(
            (
                trained(batch(False), getattr(one, field)),
                trained(batch(True), getattr(split, field)),
            )
        )
    assert m_split == pytest.approx(m_one, rel=1e-6, abs=1e-6)  # the whitened mean is ~0


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_matches(estimator):
    assert_same(both(lambda b: trained(b, token_advantages(b, b, estimator, gamma=0.9))))


def test_the_kl_in_the_reward_counts_episodes():
    """:meth:`RewardKL.token_rewards` (one rank): the penalised rewards, the KL it
    reports and the adaptive coefficient it moves to; then REINFORCE++ of those rewards."""
    proximal, ref = stream(1), stream(2)

    def run(rs):
        rk = RewardKL.__new__(RewardKL)  # no config: the controller and estimator only
        rk.ctrl, rk.kind, rk.world_size = KLController(0.5, "adaptive", 0.01, 10), "k3", 1
        rewards, metrics = rk.token_rewards(rs, rows(rs, proximal), rows(rs, ref))
        adv = token_advantages(rs, rs, "reinforce_plus_plus", 0.9, rewards)
        return trained(rs, dict(enumerate(rewards))), trained(rs, adv), metrics, rk.ctrl.value

    one, split = both(run)
    for a, b in zip(one[:2], split[:2], strict=True):
        assert_same((a, b))
    assert split[2] == pytest.approx(one[2], rel=1e-6)
    assert split[3] == pytest.approx(one[3], rel=1e-6)


def test_grpo_advantages_match():
    def per_token(rs):
        adv = baseline_advantages(rs, rs, "grpo")
        return trained(rs, {i: adv[i].expand(len(r.response_ids)) for i, r in enumerate(rs)})

    assert_same(both(per_token))


def micro_loss(rs, micro, norm, cfg, tensors) -> torch.Tensor:
    """The policy loss plus the value loss of the micro-batch ``micro`` (as the trainer and
    the critic run it, with ``norm.rows``)."""
    current, behaviour, vpred, ret, old_v = (
        pad_rows([x[i] for i in micro], max(len(rs[i].response_ids) for i in micro))
        for x in tensors
    )
    adv = baseline_advantages(rs, rs, "grpo")[micro]
    mask = response_mask(rs)[0][micro, : current.shape[1]]
    norm = norm.rows(micro)
    pg, _ = policy_loss(current, current, behaviour, adv, mask, cfg, norm=norm)
    vf, _ = value_loss(
        vpred, old_v, ret, mask, cliprange=0.2, agg_mode=cfg.agg_mode, norm_const=8.0, norm=norm
    )
    return torch.stack([pg, vf])


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_the_losses_and_normalisers_match_in_every_aggregation_mode(mode, world_size):
    """The policy loss (GRPO advantages) and the value loss of the mini-batch, summed over
    one-sequence micro-batches on every rank as the trainer runs them: a split episode's
    samples land in different micro-batches, even on different ranks."""
    cfg = LossConfig(agg_mode=mode, norm_const=8.0)

    def losses(rs):
        behaviour = {i: torch.tensor(r.behaviour_logprobs) for i, r in enumerate(rs)}
        current, vpred, ret, old_v = (rows(rs, stream(seed)) for seed in (3, 4, 5, 6))
        tensors = (current, behaviour, vpred, ret, old_v)
        total = torch.zeros(2)
        for rank in range(world_size):
            mbs, norms = plan_step(rs, 2, world_size=world_size, rank=rank, padded=True, max_seqs=1)
            assert len(mbs) == 1
            for micro in (m for m in mbs[0] if m):
                total = total + micro_loss(rs, micro, norms[0], cfg, tensors)
        counts = [float(norms[0].num_tokens or 0), float(norms[0].num_seqs or 0)]
        return torch.cat([total, torch.tensor(counts)])

    assert_same(both(losses))


def test_the_normalisers_count_episodes():
    assert norm_counts(batch(split=True), range(5)) == (N_TRAINED, 4)
    assert norm_counts(batch(split=False), range(4)) == (N_TRAINED, 4)


def test_joining_rows_is_undone_by_splitting():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    x = torch.arange(12.0).view(3, 4)
    index = join_index(mask, [[1, 0], [2]])
    assert join_rows(x, index).tolist() == [[4.0, 5.0, 6.0, 0.0, 1.0], [0.0] * 5]
    # Tokens after a row's last True are not an episode's: they come back as 0.
    assert split_rows(join_rows(x, index), index, x.shape).tolist() == [
        [0.0, 1.0, 0.0, 0.0],
        [4.0, 5.0, 6.0, 0.0],
        [0.0] * 4,
    ]
