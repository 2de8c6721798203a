"""What the trainer makes of a batch, on the tiny model: group baselines include the members
cleaning drops, and every row's logits are divided by the temperature its trajectory was
sampled at."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from asyncrl.config.schema import Config
from learner.batching import Rollout
from learner.trainer import Trainer

PROMPT = [258, 84, 82, 68, 81, 198, 18, 10, 20, 28, 256, 198, 258, 64]  # a chat prompt


@pytest.fixture(scope="module")
def single_rank():
    """A one-rank default process group in this process (removed after the module)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def make_cfg(model_dir, **importance) -> Config:
    cfg = Config()
    cfg.model.path = str(model_dir)
    cfg.data.max_response_length = 12
    cfg.actor.ppo_mini_batch_size = 2  # the test batches' two groups: one optimizer step
    for k, v in importance.items():
        setattr(cfg.algorithm.importance, k, v)
    return cfg


def test_group_baseline_counts_members_the_learner_drops(tiny_model, single_rank):
    """Group g0 lost its second member to cleaning (an empty response, score 0): its
    survivor's advantage is measured against both scores, not its raw score."""
    trainer = Trainer(make_cfg(tiny_model, mode="none"))  # w = 1: the loss shows A alone
    batch = [
        Rollout(PROMPT, [30, 31], [-1.0, -1.0], 1.0, "g0", [(0, 2)]),
        Rollout(PROMPT, [], [], 0.0, "g0", [(0, 0)]),  # dropped: empty_response
        Rollout(PROMPT, [32, 33], [-1.0, -1.0], 1.0, "g1", [(0, 2)]),
        Rollout(PROMPT, [34, 35], [-1.0, -1.0], 0.0, "g1", [(0, 2)]),
    ]
    m = trainer.train_step(batch, 1.0)
    assert m["batch/dropped_empty_response"] == 1 and m["actor/updates"] == 1
    # One update at lag 0: r = 1, so each valid token's loss is -A. Both groups score (1, 0):
    # GRPO gives +-0.5 / (std + eps), std = 1/sqrt(2). Token mean over 6 tokens of -A:
    # -(2a + 2a - 2a) / 6 = -a / 3. (Over the survivors only, g0's A was its score, 1.)
    a = 0.5 / (2**-0.5 + 1e-6)
    # float32 sums of six terms near 0.7: a few ulps of 0.7.
    assert m["loss/pg"] == pytest.approx(-a / 3, abs=1e-6)
    assert m["loss/pg"] != pytest.approx(-1 / 3, abs=1e-3)  # what the survivors-only gave
