"""A trajectory's way from the rollout server to the learner's loss, with the real pieces in
between: the server's group builder, the wire codec, the buffer's core and the learner's
conversion, batching and loss (no sockets: the frames are handed over as they would be sent).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch

from asyncrl import wire
from asyncrl.rewards.sandbox import ScoreResult
from buffer.core import ReplayBuffer
from learner.collate import collate
from learner.loop import to_rollouts
from learner.losses import AggNorm, LossConfig, policy_loss
from learner.plan import norm_counts
from learner.rollouts import clean_rollouts
from rollout_servers.groups import build_group
from rollout_servers.samples import Sample, sampled_logprob

PROMPT = [1, 2, 3]


def _task(task_id: str = "train/0/0") -> SimpleNamespace:
    return SimpleNamespace(task_id=task_id, validation=False, data_source="arith")


def _scores(*values: float) -> list[ScoreResult]:
    return [ScoreResult(score=v) for v in values]


def through_the_buffer(frames: list) -> wire.Batch:
    """Frames as a rollout server sends them -> the buffer -> a batch reply as the learner
    decodes it."""
    buf = ReplayBuffer(batch_size=1, capacity_groups=4, max_policy_lag=1)
    packed = wire.decode_packed([bytes(f) for f in frames])
    assert buf.add_packed(packed, now=0.0)[-1] == "completed"
    batch = buf.release(policy_version=0)
    assert batch is not None
    reply = wire.decode_reply([bytes(f) for f in wire.encode_batch(batch)])
    assert isinstance(reply, wire.Batch)
    return reply


def test_unreported_logprob_costs_one_token_not_the_group():
    """The engine turns a position vLLM did not report into NaN; the group must still reach
    the learner, which drops that one token from the loss and counts it."""
    unreported = sampled_logprob({}, 5)  # vLLM gave no entry for the sampled token
    assert math.isnan(unreported)
    a = Sample(
        token_ids=[5, 6, 7],
        logprobs=[-0.5, unreported, -1.5],
        version_spans=[(0, 3)],
        finish_reason="stop",
    )
    b = Sample(token_ids=[8, 9], logprobs=[-0.25, -0.75], version_spans=[(0, 2)])
    group = build_group(_task(), PROMPT, [a, b], _scores(1.0, 0.0), server_id="s", created_at=0.0)

    rollouts = to_rollouts(through_the_buffer(wire.encode_trajectories(group)))
    kept, dropped = clean_rollouts(rollouts)
    assert len(kept) == 2 and not any(dropped.values())  # nothing lost but the one token
    assert math.isnan(kept[0].behaviour_logprobs[1])
    assert norm_counts(kept, [0, 1]) == (4, 2)  # the loss normaliser counts 4 valid tokens

    # The loss at p = l = b (w = r = 1): token-mean of -A over the 4 valid tokens, where the
    # advantages are +1 (3 tokens, one not reported) and -0.5 (2 tokens):
    # -(1 + 1 - 0.5 - 0.5) / 4 = -0.25, exact in float32.
    mb = collate(kept, torch.tensor([1.0, -0.5]), [0, 1])
    assert torch.isnan(mb.behaviour[0, 1])
    logp = torch.where(mb.mask, mb.behaviour.nan_to_num(-1.0), 0.0).requires_grad_(True)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        mb.behaviour,
        mb.advantages,
        mb.mask,
        LossConfig(),
        norm=AggNorm(*norm_counts(kept, [0, 1])),
    )
    loss.backward()
    assert float(stats["nonfinite"]) == 1 and float(stats["tokens"]) == 4
    assert loss.item() == -0.25
    # The unreported token gets no gradient; the others get -A / 4.
    expected = torch.tensor([[-0.25, 0.0, -0.25], [0.125, 0.125, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=0)
    np.testing.assert_array_equal(mb.mask.tolist(), [[True] * 3, [True, True, False]])


def test_sampling_temperature_reaches_the_learner_with_each_trajectory():
    """A server started with its own rollout.temperature says so in every trajectory; the
    learner's rollouts carry it (the trainer divides each row's logits by it)."""
    samples = [
        Sample(token_ids=[5, 6], logprobs=[-0.5, -0.25], version_spans=[(0, 2)], temperature=0.7),
        Sample(token_ids=[7], logprobs=[-1.0], version_spans=[(0, 1)], temperature=0.7),
    ]
    group = build_group(_task(), PROMPT, samples, _scores(1.0, 0.0), server_id="s", created_at=0.0)
    assert [t.meta.temperature for t in group] == [0.7, 0.7]
    rollouts = to_rollouts(through_the_buffer(wire.encode_trajectories(group)))
    assert [r.temperature for r in rollouts] == [0.7, 0.7]
    # A producer that does not say leaves it to the learner's configured temperature.
    silent = build_group(
        _task("train/1/0"),
        PROMPT,
        [Sample([5], [-0.5], [(0, 1)])],
        _scores(1.0),
        server_id="s",
        created_at=0.0,
    )
    batch = through_the_buffer(wire.encode_trajectories(silent))
    assert [r.temperature for r in to_rollouts(batch)] == [None]
