"""The shared layout (learner/shared_prefix.py): one row per distinct prompt, the samples'
responses after it under a 4D mask. Its rows say what each token may see (pure checks), and
the model gives it the padded layout's logprobs and gradients, through FSDP2 on one rank and
on two (real process groups)."""

from __future__ import annotations

import random

import torch

from asyncrl.config import load_config
from learner.collate import collate
from learner.rollouts import Rollout
from learner.shared_prefix import collate_shared
from learner.trainer import Trainer
from tests.helpers import free_port, join_ranks, leave_ranks, rank_env, start_ranks
from tests.trainer_helpers import float32_tolerance


def demo_like(seed: int, groups: int = 4, n: int = 4) -> list[Rollout]:
    """The demo's shape: long prompts, short responses, n samples per prompt."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(250) for _ in range(rng.randint(12, 20))]
        for _ in range(n):
            k = rng.randint(1, 4)
            resp = [rng.randrange(250) for _ in range(k)]
            out.append(Rollout(prompt, resp, [-1.0] * k, float(rng.random() < 0.5), g))
    return out


def test_a_shared_row_holds_each_prompt_once_and_masks_the_other_samples():
    prompt = [5, 6, 7]
    batch = [
        Rollout(prompt, [1, 2, 3], [0.0] * 3, 0.0, 0),
        Rollout(prompt, [4, 8], [0.0] * 2, 0.0, 0),
    ]
    batch += [Rollout([9] * 12, [3], [0.0], 0.0, 1)]  # long prompt: no repeat, but sharable rows
    mb = collate_shared(batch, torch.zeros(3), [0, 1, 2])
    assert mb.attention_mask is not None and mb.position_ids is not None
    assert mb.input_ids.shape == (2, 12)  # rows: prompt 0 + 2 + 1 inputs; the long prompt
    assert mb.input_ids[0, :6].tolist() == [5, 6, 7, 1, 2, 4]
    assert mb.position_ids[0, :6].tolist() == [0, 1, 2, 3, 4, 3]  # each sample's own positions
    seen = mb.attention_mask[0, 0]
    assert seen[5, :6].tolist() == [True, True, True, False, False, True]  # sample 2 only
    assert seen[4, :6].tolist() == [True, True, True, True, True, False]
    # token t of sample b is predicted where its token t - 1 sits (the prompt's end for t=0)
    assert mb.gather_index[0].tolist() == [2, 3, 4] and mb.gather_index[1, :2].tolist() == [2, 5]
    assert mb.gather_index[2, 0].item() == 12 + 11


def _mask_dims(mb) -> int:
    assert mb.attention_mask is not None
    return mb.attention_mask.ndim


def test_rows_stay_padded_where_sharing_would_not_pay():
    prompt = [1, 2]
    long_answers = [Rollout(prompt, list(range(40)), [0.0] * 40, 0.0, 0) for _ in range(4)]
    assert _mask_dims(collate_shared(long_answers, torch.zeros(4), [0, 1, 2, 3])) == 2
    distinct = [Rollout([i, i + 1, i + 2], [3], [0.0], 0.0, i) for i in range(3)]
    assert _mask_dims(collate_shared(distinct, torch.zeros(3), [0, 1, 2])) == 2


def _cfg(model, layout: str):
    return load_config(None, [f"model.path={model}", f"actor.sequence_layout={layout}"])


def _grads(trainer: Trainer, mb) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    trainer.model.zero_grad()
    logp, _ = trainer._forward(trainer.model, mb)
    (logp * mb.mask * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    grads = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert g is not None, name
        grads[name] = g.detach().clone()
    return logp.detach(), grads


def _compare(model, out_path=None) -> None:
    trainer = Trainer(_cfg(model, "shared"))
    assert trainer.layout == "shared"
    batch = demo_like(0)
    ids = list(range(len(batch)))
    shared_mb = collate_shared(batch, torch.zeros(len(batch)), ids)
    assert _mask_dims(shared_mb) == 4 and shared_mb.input_ids.shape[0] == 4
    lp_s, g_s = _grads(trainer, shared_mb)
    lp_p, g_p = _grads(trainer, collate(batch, torch.zeros(len(batch)), ids, packed=False))
    tol = float32_tolerance(trainer, batch)
    torch.testing.assert_close(lp_s[shared_mb.mask], lp_p[shared_mb.mask], rtol=0, atol=1e-5)
    for name, g in g_p.items():
        torch.testing.assert_close(g_s[name], g, rtol=0, atol=tol * g.abs().max().item())
    if out_path is not None:
        torch.save({"ok": True}, out_path)


def test_shared_rows_give_the_padded_logprobs_and_gradients(tiny_model, single_rank):
    _compare(tiny_model)


def _rank(rank: int, world: int, port: int, model: str, out: str) -> None:

    rank_env(rank, world, port)
    torch.set_num_threads(1)
    _compare(model, f"{out}/{rank}.pt")  # every rank: shared == padded, sharded the same way
    leave_ranks()


def test_shared_rows_through_fsdp2_on_two_ranks(tiny_model, tmp_path):
    join_ranks(start_ranks(_rank, 2, free_port(), str(tiny_model), str(tmp_path)))
    assert (tmp_path / "0.pt").is_file() and (tmp_path / "1.pt").is_file()
