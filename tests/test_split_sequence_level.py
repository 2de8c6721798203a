"""A split episode's sequence-level means, GSPO's ratio ``exp(mean(l - p))`` and the
sequence-level importance weight ``exp(mean(p - b))``, are taken over all its samples: it
trains as the same episode sent as one sample, whichever micro-batch or rank holds each
sample (the two layouts of :mod:`tests.test_split_episodes`). First the loss as the trainer
runs it over micro-batches and ranks, then the trainer itself on the tiny model."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import load_config
from learner.collate import pad_rows
from learner.episode_means import episode_means, episode_sums, row_means
from learner.losses import LossConfig, policy_loss
from learner.plan import plan_step
from learner.rollouts import Rollout, baseline_advantages, response_mask
from learner.trainer import Trainer
from tests.helpers import free_port, join_ranks, leave_ranks, rank_env, start_ranks
from tests.test_split_episodes import N_TRAINED, batch, rows, stream, trained
from tests.trainer_helpers import assert_gradients_match, float32_tolerance, record_gradients

# Per trained token, in batch order (the same in both layouts): the proximal logprob p near
# the behaviour's, the current one l near p; far enough apart that each sample's own mean
# lands elsewhere than its episode's, against every clip range and cap below.
_B = trained(
    batch(False), {i: torch.tensor(r.behaviour_logprobs) for i, r in enumerate(batch(False))}
)
P_VALUES = _B + 0.4 * stream(7)
L_VALUES = P_VALUES + 0.3 * stream(8)

# The layouts sum the same terms in another order: a mean over n float32 terms is off by up
# to n * eps (relative), exp carries that over, and the loss sums n terms of it again, each
# times a weight or an advantage carrying the same: a few n * eps, n = the trained tokens.
TOL = 4 * N_TRAINED * torch.finfo(torch.float32).eps


def step(rs: list[Rollout], cfg: LossConfig, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mini-batch loss (GRPO advantages), summed over the one-sequence micro-batches
    of every rank as the trainer runs them, and its gradient by the current logprob of each
    trained token ``[N_TRAINED]``. The episode means come from each rank's sums of the
    samples it holds, added up (the trainer's all-reduce)."""
    current = L_VALUES.clone().requires_grad_(True)
    lp, prox = rows(rs, current), rows(rs, P_VALUES)
    detached = {i: v.detach() for i, v in lp.items()}
    behaviour = {i: torch.tensor(r.behaviour_logprobs) for i, r in enumerate(rs)}
    adv, mask = baseline_advantages(rs, rs, "grpo"), response_mask(rs)[0]
    plans = [
        plan_step(rs, 2, world_size=world_size, rank=k, padded=True, max_seqs=1)[0][0]
        for k in range(world_size)
    ]
    norm = plan_step(rs, 2, world_size=1, rank=0, padded=True, max_seqs=1)[1][0]
    means = None
    if norm.episodes is not None:
        sums = [episode_sums(rs, norm.episodes, sum(p, []), prox, detached) for p in plans]
        means = episode_means(torch.stack(sums).sum(0))
    total = torch.zeros(())
    for micro in (m for p in plans for m in p if m):
        width = max(len(rs[i].response_ids) for i in micro)
        l_rows, p_rows, b_rows = (
            pad_rows([x[i] for i in micro], width) for x in (lp, prox, behaviour)
        )
        loss, _ = policy_loss(
            l_rows,
            p_rows,
            b_rows,
            adv[micro],
            mask[micro, :width],
            cfg,
            norm=norm.rows(micro),
            episodes=None if means is None else row_means(means, norm.episodes or {}, micro),
        )
        total = total + loss
    total.backward()
    assert current.grad is not None
    return total.detach(), current.grad


def assert_same_step(cfg: LossConfig, world_size: int) -> None:
    (loss_one, grad_one), (loss_split, grad_split) = (
        step(batch(split), cfg, world_size) for split in (False, True)
    )
    assert grad_one.abs().max() > 0.01  # not a vacuous comparison: tokens train
    torch.testing.assert_close(loss_split, loss_one, rtol=TOL, atol=TOL)
    torch.testing.assert_close(grad_split, grad_one, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28), (0.05, 0.1), (0.99, 5.0)])
def test_gspo_takes_the_ratio_over_the_episode(clip, world_size):
    low, high = clip
    cfg = LossConfig(clip_ratio_low=low, clip_ratio_high=high, loss_mode="gspo")
    assert_same_step(cfg, world_size)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    ("mode", "cap"), [("tis", 1.5), ("tis", 10.0), ("mis", 1.5), ("mis", 10.0)]
)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_the_sequence_level_weight_is_the_episodes(loss_mode, mode, cap, world_size):
    cfg = LossConfig(
        loss_mode=loss_mode, importance_mode=mode, importance_cap=cap, importance_level="sequence"
    )
    assert_same_step(cfg, world_size)


def test_unsplit_batches_keep_the_per_row_path():
    """No mini-batch of an unsplit batch names episodes to pool, and a micro-batch of
    unpooled rows gets the per-row loss bit for bit."""
    rs = batch(split=False)
    assert plan_step(rs, 2, world_size=1, rank=0, padded=True, max_seqs=1)[1][0].episodes is None
    assert row_means(torch.ones(1, 2), {7: 0}, [0, 1, 2]) is None
    cfg = LossConfig(loss_mode="gspo", importance_level="sequence")
    lp, prox = rows(rs, L_VALUES), rows(rs, P_VALUES)
    behaviour = {i: torch.tensor(r.behaviour_logprobs) for i, r in enumerate(rs)}
    args = [pad_rows([x[i] for i in range(4)], 8) for x in (lp, prox, behaviour)]
    adv, mask = baseline_advantages(rs, rs, "grpo"), response_mask(rs)[0]
    plain, _ = policy_loss(*args, adv, mask, cfg)
    pooled = row_means(torch.full((1, 2), 5.0), {0: 0}, [0, 1, 2, 3])
    assert pooled is not None
    pooled = pooled._replace(pooled=torch.zeros(4, dtype=torch.bool))  # no row pooled
    assert torch.equal(policy_loss(*args, adv, mask, cfg, episodes=pooled)[0], plain)


# ------------------------------------------------------------------ the trainer
def trainer_batch(split: bool) -> list[Rollout]:
    """The batch with the single-turn group first: with one group per mini-batch, the first
    update is the same in both layouts and the second, which holds the episode, starts from
    weights it moved (so GSPO's current ratio is not 1)."""
    b = batch(split)
    return [*b[-2:], *b[:-2]]


def trainer_cfg(model, loss_mode: str, level: str, groups: int, clip: tuple[str, ...] = ()):
    """``groups`` per mini-batch, each sample its own micro-batch, a learning rate at which
    one update moves the episode's mean log-ratio to about -0.2 (GSPO's ratio near 0.8)."""
    return load_config(
        None,
        [
            f"model.path={model}",
            "data.max_response_length=12",
            f"actor.ppo_mini_batch_size={groups}",
            "actor.use_dynamic_bsz=false",
            "actor.ppo_micro_batch_size_per_gpu=1",
            "actor.optim.lr=1e-4",
            f"actor.policy_loss.loss_mode={loss_mode}",
            f"algorithm.importance.level={level}",
            *clip,
        ],
    )


@pytest.mark.parametrize(
    ("loss_mode", "level", "groups", "clip"),
    [
        ("gspo", "token", 1, ()),  # GSPO's own narrow clip range
        ("gspo", "token", 1, ("actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28")),
        ("vanilla", "sequence", 2, ()),
        ("gspo", "sequence", 1, ()),
    ],
)
def test_the_trainer_trains_a_split_episode_as_one(
    tiny_model, single_rank, loss_mode, level, groups, clip
):
    """``groups`` 1: two updates, the episode's after the first (its current logprobs are
    taken before its backward; its samples' own mean log-ratios lie apart from the
    episode's); 2: one update, at the proximal policy (not stored: the episode's proximal
    logprobs are taken)."""
    grads, metrics, trainers = [], [], []
    for split in (False, True):
        trainers.append(Trainer(trainer_cfg(tiny_model, loss_mode, level, groups, clip)))
        grads.append(record_gradients(trainers[-1]))
        metrics.append(trainers[-1].train_step(trainer_batch(split), 1.0))
    assert metrics[0]["actor/updates"] == metrics[1]["actor/updates"] == 2 // groups
    rel = float32_tolerance(trainers[0], trainer_batch(False))
    for got, expected in zip(grads[1], grads[0], strict=True):
        assert_gradients_match(got, expected, rel)
    assert metrics[1]["loss/total"] == pytest.approx(metrics[0]["loss/total"], rel=rel, abs=1e-7)


def _split_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:

    rank_env(rank, world, port)
    torch.set_num_threads(1)
    trainer = Trainer(trainer_cfg(model_dir, "gspo", "sequence", 1))
    grads = record_gradients(trainer)
    trainer.train_step(trainer_batch(split=True), 1.0)
    if rank == 0:
        torch.save(grads, out)
    leave_ranks()


def test_two_ranks_pool_the_episode_across_ranks(tiny_model, single_rank, tmp_path):
    """On 2 ranks the episode's samples sit on different ranks (the shard balances tokens),
    each rank running its own forwards of them: the updates match the unsplit episode's on
    one rank."""
    rs = trainer_batch(split=True)  # the episode's samples are 2 and 3, in mini-batch 2
    rank_of = {
        i: k
        for k in (0, 1)
        for micro in plan_step(rs, 1, world_size=2, rank=k, padded=True, max_seqs=1)[0][1]
        for i in micro
    }
    assert rank_of[2] != rank_of[3]
    out = tmp_path / "grads.pt"
    ctx = start_ranks(_split_worker, 2, free_port(), str(tiny_model), str(out))
    one = Trainer(trainer_cfg(tiny_model, "gspo", "sequence", 1))
    expected = record_gradients(one)
    one.train_step(trainer_batch(split=False), 1.0)
    join_ranks(ctx)
    got = torch.load(out)
    rel = float32_tolerance(one, trainer_batch(False))
    for g, e in zip(got, expected, strict=True):
        assert_gradients_match(g, e, rel)
