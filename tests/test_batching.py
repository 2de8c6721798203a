"""Batching: bad rollouts dropped and counted, mini-batches of whole groups, equal rank
shares, token-bounded micro-batches (packed or padded rows, and which layout is chosen), and tensors whose indices point at the right logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.collate import collate, pad_rows
from learner.layout import choose_layout
from learner.plan import micro_batches, minibatches, norm_counts, plan_minibatch, shard
from learner.rollouts import Rollout, clean_rollouts, group_indices


def ro(prompt, response, group="g", reward=1.0, logprobs=None):
    lp = logprobs if logprobs is not None else [-1.0] * len(response)
    return Rollout(prompt, response, lp, reward, group, [(0, len(response))])


def test_bad_rollouts_are_counted_and_dropped():
    good = ro([1, 2], [3, 4])
    batch = [
        good,
        ro([1], [3, 4], logprobs=[-1.0]),  # one logprob for two tokens
        ro([1], []),  # empty response
        ro([], [3]),  # no prompt: the first token has no context
        ro([1], [3], reward=math.nan),
        ro([1] * 10, [2] * 10),  # longer than max_len
    ]
    kept, dropped = clean_rollouts(batch, max_len=16)
    assert kept == [good]
    assert dropped == {
        "length_mismatch": 1,
        "empty_response": 1,
        "empty_prompt": 1,
        "nonfinite_reward": 1,
        "too_long": 1,
    }
    assert clean_rollouts([]) == ([], dict.fromkeys(dropped, 0))


def test_group_index_and_minibatches_of_whole_groups():
    batch = [ro([1], [2], g) for g in ["b", "a", "b", "c", "a", "d", "c"]]
    gidx = group_indices(batch)
    assert gidx.tolist() == [0, 1, 0, 2, 1, 3, 2]
    assert minibatches(gidx, 2) == [[0, 1, 2, 4], [3, 5, 6]]
    assert minibatches(gidx, 4) == [list(range(7))]
    with pytest.raises(ValueError):
        minibatches(gidx, 0)


def test_shard_gives_equal_counts_and_balanced_tokens():
    indices = [10, 11, 12, 13, 14, 15, 16]
    lengths = [9, 1, 8, 2, 7, 3, 5]
    parts = shard(indices, lengths, 2)
    assert sorted(sum(parts, [])) == indices
    assert sorted(len(p) for p in parts) == [3, 4]
    loads = [sum(lengths[indices.index(i)] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 3  # 35 tokens split 17/18 or so
    assert shard(indices, lengths, 2) == parts  # deterministic
    assert shard([], [], 3) == [[], [], []]


def test_micro_batches_respect_the_token_budget():
    lengths = [5, 3, 9, 2, 4, 20]
    mbs = micro_batches(list(range(6)), lengths, max_tokens=10)
    assert sorted(sum(mbs, [])) == list(range(6))
    for mb in mbs:
        assert sum(lengths[i] for i in mb) <= 10 or len(mb) == 1  # 20 goes alone
    assert micro_batches([4, 5, 6, 7, 8], [1] * 5, max_seqs=2) == [[4, 5], [6, 7], [8]]


def test_plan_pads_ranks_to_the_same_number_of_micro_batches():
    lengths = [10, 10, 10, 1]
    plan = plan_minibatch([0, 1, 2, 3], lengths, 2, max_tokens=10)
    assert len(plan[0]) == len(plan[1]) == 2
    assert sorted(i for rank in plan for mb in rank for i in mb) == [0, 1, 2, 3]
    # One sequence, two ranks: the second rank runs a dummy micro-batch.
    assert plan_minibatch([0], lengths, 2, max_tokens=10) == [[[0]], [[]]]


@pytest.mark.parametrize("packed", [True, False])
def test_collate_points_each_response_token_at_the_logit_that_predicts_it(packed):
    batch = [ro([1, 2, 3], [4, 5]), ro([6], [7, 8, 9]), ro([10, 11], [12])]
    adv = torch.tensor([0.5, -1.0, 2.0])
    mb = collate(batch, adv, [2, 0, 1], packed=packed, pad_id=0)
    assert mb.seq_ids == [2, 0, 1] and mb.n_tokens == 5 + 4 + 3
    assert mb.targets.tolist() == [[12, 0, 0], [4, 5, 0], [7, 8, 9]]
    assert mb.mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert mb.advantages.tolist() == [2.0, 0.5, -1.0]
    # The logit at gather_index predicts the token right after it in the input.
    flat = mb.input_ids.reshape(-1)
    assert torch.equal(flat[mb.gather_index + 1][mb.mask], mb.targets[mb.mask])
    if packed:
        assert mb.input_ids.shape == (1, 12) and mb.attention_mask is None
        assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]]
    else:
        assert mb.input_ids.shape == (3, 5) and mb.attention_mask.sum() == 12


def test_numpy_arrays_as_from_the_wire():
    """Wire trajectories carry int32/float32 numpy arrays; they collate like lists."""
    a = Rollout(
        np.array([1, 2], np.int32),
        np.array([3, 4], np.int32),
        np.array([-1.0, np.nan], np.float32),
        1.0,
        "g",
        [(0, 2)],
    )
    kept, _ = clean_rollouts([a])
    mb = collate(kept, torch.zeros(1), [0])
    assert mb.targets.tolist() == [[3, 4]] and mb.input_ids.tolist() == [[1, 2, 3, 4]]
    assert torch.isnan(mb.behaviour[0, 1]) and norm_counts(kept, [0]) == (1, 1)


def test_dummy_micro_batch_and_helpers():
    dummy = collate([], torch.zeros(0), [])
    assert dummy.seq_ids == [] and not dummy.mask.any()
    rows = pad_rows([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], 3)
    assert rows.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]
    batch = [ro([1], [2, 3], logprobs=[-1.0, math.nan]), ro([1], [2], logprobs=[math.inf])]
    assert norm_counts(batch, [0, 1]) == (1, 1)


def test_padded_micro_batches_budget_rows_times_the_longest_row():
    lengths = [5, 3, 9, 2, 4, 20]
    mbs = micro_batches(list(range(6)), lengths, max_tokens=10, padded=True)
    # Longest first: 20 alone (over budget), 9 alone (2 x 9 > 10), then 5+4, 3+2.
    assert mbs == [[5], [2], [0, 4], [1, 3]]
    for mb in mbs:
        assert len(mb) * max(lengths[i] for i in mb) <= 10 or len(mb) == 1
    # By sequence count, padded rows are sorted by length first.
    assert micro_batches([4, 5, 6], [2, 7, 3], max_seqs=2, padded=True) == [[5, 6], [4]]


def test_padded_micro_batches_keep_padding_small():
    """Rows of similar length go together, so the padded slots stay close to the real
    tokens even when lengths vary a lot across the mini-batch."""
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 200, (256,), generator=rng).tolist()
    mbs = micro_batches(list(range(256)), lengths, max_tokens=2048, padded=True)
    assert sorted(i for mb in mbs for i in mb) == list(range(256))
    slots = sum(len(mb) * max(lengths[i] for i in mb) for mb in mbs)
    assert slots / sum(lengths) < 1.15
    # In arrival order instead, each micro-batch pads to its longest row: about 2x here.
    unsorted = [list(range(i, min(i + 16, 256))) for i in range(0, 256, 16)]
    assert sum(len(mb) * max(lengths[i] for i in mb) for mb in unsorted) / sum(lengths) > 1.5


def test_plan_passes_the_layout_to_every_rank():
    lengths = [8, 2, 7, 3]
    plan = plan_minibatch([0, 1, 2, 3], lengths, 1, max_tokens=16, padded=True)
    assert plan == [[[0, 2], [3, 1]]]
    assert plan_minibatch([0, 1, 2, 3], lengths, 1, max_tokens=16) == [[[0, 2], [3, 1]]]


@pytest.mark.parametrize(
    ("requested", "attn", "device", "layout"),
    [
        ("auto", "sdpa", "cpu", "shared"),
        ("auto", "sdpa", "cuda", "shared"),  # a dense mask over the packed row on GPU too
        ("auto", "eager", "cuda", "shared"),
        ("auto", None, "cpu", "shared"),
        ("auto", "flash_attention_2", "cuda", "packed"),
        ("auto", "flash_attention_3", "cuda", "packed"),
        ("auto", "flash_attention_2", "cpu", "shared"),
        ("packed", "sdpa", "cpu", "packed"),
        ("padded", "flash_attention_2", "cuda", "padded"),
        ("shared", "flash_attention_2", "cuda", "shared"),
    ],
)
def test_choose_layout(requested, attn, device, layout):
    got, why = choose_layout(requested, attn, device)
    assert got == layout and why


def test_choose_layout_refuses_an_unknown_layout():
    with pytest.raises(ValueError, match="sequence_layout='pad'.*auto"):
        choose_layout("pad", "sdpa", "cpu")


def test_the_shared_layout_keeps_a_prompts_samples_in_one_micro_batch():
    """Found by a review: the shared layout was planned as padded rows, sorted by length
    alone, so a prompt's samples were scattered over the micro-batches and each computed
    the prompt again (3.2x the tokens fed on a GRPO-shaped batch of long prompts). Its
    micro-batches now keep each group together, within the same budgets."""
    import random

    from learner.plan import plan_step
    from learner.rollouts import Rollout

    rng = random.Random(0)
    batch = []
    for g in range(16):  # 16 prompts of 180-220 tokens, 8 samples of 1-50 tokens each
        prompt = [rng.randrange(100) for _ in range(rng.randint(180, 220))]
        for _ in range(8):
            k = rng.randint(1, 50)
            batch.append(Rollout(prompt, [1] * k, [0.0] * k, 0.0, g))
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in batch]

    def plan(seqs: int | None, tokens: int | None, shared: bool) -> list[list[int]]:
        (mini,), _ = plan_step(
            batch, 16, world_size=1, rank=0, padded=True, max_seqs=seqs, max_tokens=tokens,
            shared=shared,
        )  # fmt: skip
        return mini

    for seqs, tokens in ((16, None), (None, 8 * 270)):
        shared, apart = plan(seqs, tokens, True), plan(seqs, tokens, False)
        for micro in shared:
            if tokens is not None and len(micro) > 1:  # rows x the longest row fit
                assert len(micro) * max(lengths[i] for i in micro) <= tokens
        assert sorted(i for m in shared for i in m) == list(range(len(batch)))
        prompts = [len({batch[i].group_id for i in m}) for m in shared]
        assert sum(prompts) <= len(shared) + 16, prompts  # each group split at most once
        assert sum(len({batch[i].group_id for i in m}) for m in apart) > 2 * sum(prompts)
