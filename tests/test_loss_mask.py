"""Multi-turn samples on the wire and in the learner: the loss mask (1 on sampled tokens,
0 on tool output) and episodes split into several samples. Single-turn messages are
unchanged on the wire."""

from __future__ import annotations

import msgpack
import pytest
import torch

from asyncrl import wire
from learner.collate import collate
from learner.loop import to_rollouts
from learner.losses import LossConfig, policy_loss
from learner.plan import norm_counts
from learner.rollouts import Rollout, baseline_advantages, clean_rollouts


def turns(task_id: str = "t", *, group_index: int = 0, group_size: int = 1, **meta):
    """A two-turn response: 3 sampled tokens, 2 of tool output, 2 sampled again."""
    return wire.Trajectory.build(
        task_id=task_id,
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 90, 91, 13, 14],
        logprobs=[-0.5, -0.6, -0.7, 0.0, 0.0, -0.8, -0.9],
        version_spans=[(3, 5), (4, 2)],
        masked_spans=[(3, 2)],
        group_index=group_index,
        group_size=group_size,
        reward=1.0,
        **meta,
    )


def test_mask_and_episode_travel_and_single_turn_is_unchanged_on_the_wire():
    [back] = wire.decode_trajectories(wire.encode_trajectories([turns(episode=0)]))
    assert back.loss_mask().tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert back.meta.masked_spans == [(3, 2)] and back.meta.episode_index == 0
    plain = wire.Trajectory.build(
        task_id="s", prompt_ids=[1], response_ids=[2], logprobs=[-1], group_index=0, group_size=1
    )
    header = msgpack.unpackb(wire.encode_trajectories([plain])[0])
    assert not {"masked_spans", "episode"} & set(header["trajectories"][0])
    assert (
        back.loss_mask().dtype == bool
        and plain.loss_mask().tolist() == [True]
        and plain.meta.episode_index == 0
    )


@pytest.mark.parametrize(
    "change, kind",
    [
        ({"masked_spans": [(3, 2), (4, 1)]}, "invalid"),  # overlap
        ({"masked_spans": [(5, 1), (3, 1)]}, "invalid"),  # backwards
        ({"masked_spans": [(6, 2)]}, "invalid"),  # past the response
        ({"masked_spans": [(2, 1)]}, "invalid"),  # a sampled token's logprob under the mask
        ({"masked_spans": [(3, 0)]}, "invalid"),  # an empty run
        ({"episode": 1}, "invalid"),  # episode beyond the group
    ],
)
def test_bad_masks_and_episodes_are_refused(change, kind):
    t = turns()
    header = msgpack.unpackb(wire.encode_trajectories([t])[0])
    header["trajectories"][0].update(
        {k: [list(x) for x in v] if k == "masked_spans" else v for k, v in change.items()}
    )
    frames = [msgpack.packb(header), *wire.encode_trajectories([t])[1:]]
    with pytest.raises(wire.WireError) as e:
        wire.decode_trajectories(frames)
    assert e.value.kind == kind


def test_masked_tokens_take_no_part_in_the_loss():
    """Tool-output tokens: no gradient, not in the normalisers; the loss over the sampled
    tokens equals the loss of the same tokens with the others cut from the mask by hand."""
    [r] = to_rollouts(type("B", (), {"trajectories": [turns()]})())
    assert r.loss_mask == [1, 1, 1, 0, 0, 1, 1] and r.version_spans == [(3, 5), (4, 2)]
    kept, dropped = clean_rollouts([r])
    assert kept == [r] and not any(dropped.values())
    mb = collate(kept, torch.tensor([1.0]), [0])
    assert mb.mask.tolist() == [[True, True, True, False, False, True, True]]
    assert norm_counts(kept, [0]) == (5, 1)

    torch.manual_seed(0)
    logprobs = (torch.randn(1, 7) - 1).requires_grad_()
    cfg = LossConfig()
    loss, _ = policy_loss(logprobs, logprobs.detach(), mb.behaviour, mb.advantages, mb.mask, cfg)
    loss.backward()
    assert logprobs.grad is not None
    assert torch.all(logprobs.grad[0, 3:5] == 0) and torch.all(
        logprobs.grad[0, [0, 1, 2, 5, 6]] != 0
    )
    keep = [0, 1, 2, 5, 6]
    lp2 = logprobs.detach()[:, keep].clone().requires_grad_()
    loss2, _ = policy_loss(
        lp2, lp2.detach(), mb.behaviour[:, keep], mb.advantages, mb.mask[:, keep], cfg
    )
    torch.testing.assert_close(loss, loss2, rtol=1e-6, atol=1e-7)


def test_group_statistics_count_episodes_not_samples():
    """Episode 0 split into two samples (reward 1), episode 1 one sample (reward 0): GRPO
    over the two episodes gives +-1/std; both samples of episode 0 get the same advantage."""
    rollouts = [
        Rollout([1], [2], [-1.0], 1.0, "g", episode=0),
        Rollout([1, 2, 5], [6], [-1.0], 1.0, "g", episode=0),
        Rollout([1], [3], [-1.0], 0.0, "g", episode=1),
    ]
    adv = baseline_advantages(rollouts, rollouts, "grpo")
    expected = torch.tensor([1.0, 0.0]) - 0.5
    expected = expected / (expected.std() + 1e-6)
    torch.testing.assert_close(adv, expected[[0, 0, 1]])
    lone = [Rollout([1], [2], [-1.0], r, "g") for r in (1.0, 1.0, 0.0)]  # three episodes
    assert not torch.allclose(baseline_advantages(lone, lone, "grpo")[:2], adv[:2])
