"""What the trainer makes of a batch, on the tiny model: group baselines include the members
cleaning drops, and every row's logits are divided by the temperature its trajectory was
sampled at."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.config import Config, load_config
from learner.rollouts import Rollout
from learner.trainer import Trainer

PROMPT = [258, 84, 82, 68, 81, 198, 18, 10, 20, 28, 256, 198, 258, 64]  # a chat prompt


def make_cfg(model_dir, **importance) -> Config:
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "data.max_response_length=12",
            "actor.ppo_mini_batch_size=2",  # the test batches' two groups: one optimizer step
            *(f"algorithm.importance.{k}={v}" for k, v in importance.items()),
        ],
    )


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


def _rows() -> list[Rollout]:
    """Two groups of two responses (token ids the tiny model's tokenizer has)."""
    responses = [[30, 31, 32], [40, 41], [50, 51, 52, 53], [60]]
    return [
        Rollout(PROMPT, r, [-1.0] * len(r), float(i % 2), f"g{i // 2}", [(0, len(r))])
        for i, r in enumerate(responses)
    ]


def test_each_row_is_scored_at_the_temperature_it_was_sampled_at(tiny_model, single_rank):
    """A rollout server started with rollout.temperature=0.7 while the learner's config says
    1.0: the trajectories say 0.7, and the learner's logprobs are those at 0.7."""
    trainer = Trainer(make_cfg(tiny_model))
    plain = _rows()
    at = {t: torch.cat(trainer.compute_logprobs(plain, t)) for t in (0.7, 1.0, 1.3)}
    carried = [dataclasses.replace(r, temperature=0.7) for r in plain]
    got = torch.cat(trainer.compute_logprobs(carried, 1.0))  # 1.0: the configured one
    # The same forward and the same division: equal up to a float32 ulp of |logprob| < 20.
    torch.testing.assert_close(got, at[0.7], rtol=0, atol=1e-5)
    assert (got - at[1.0]).abs().max() > 0.05  # what dividing by the configured 1.0 gives

    # A batch mixing two servers' temperatures, each row's behaviour logprobs those of its
    # own temperature (what vLLM reports at lag 0): every importance weight is 1.
    rows = [
        dataclasses.replace(r, temperature=t, behaviour_logprobs=at[t][start:end].tolist())
        for r, t, start, end in zip(plain, (0.7, 0.7, 1.3, 1.3), *_bounds(plain), strict=True)
    ]
    m = trainer.train_step(rows, 1.0)
    assert m["actor/updates"] == 1 and m["importance/nonfinite_dropped"] == 0
    assert m["importance/log_w_abs_max"] < 1e-5, m["importance/log_w_abs_max"]


def _bounds(rows: list[Rollout]) -> tuple[list[int], list[int]]:
    """Start and end of each row's response tokens in the concatenated logprobs."""
    ends = torch.tensor([len(r.response_ids) for r in rows]).cumsum(0).tolist()
    return [0, *ends[:-1]], ends
