"""The policy's forward on a micro-batch: with the entropy a metric only (entropy_coeff 0)
it is computed without a graph, so its ``[B, T, V]`` terms are not kept for the backward;
its values and the logprobs' gradient are the same either way."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from learner import forward
from learner.collate import collate
from learner.forward import response_logprobs
from learner.rollouts import Rollout


def test_a_metric_only_entropy_has_no_graph_and_the_same_values(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rollouts = [Rollout([1, 2, 3], [4, 5], [-1.0, -1.0], 0.0, 0), Rollout([6], [7], [-1.0], 0.0, 0)]
    mb = collate(rollouts, torch.zeros(2), [0, 1], packed=False)
    logp, ent = response_logprobs(model, mb, entropy=True)
    logp_m, ent_m = response_logprobs(model, mb, entropy=True, entropy_grad=False)
    assert ent is not None and ent_m is not None
    assert ent.requires_grad and not ent_m.requires_grad and logp_m.requires_grad
    torch.testing.assert_close(ent_m, ent.detach(), rtol=0, atol=0)
    torch.testing.assert_close(logp_m, logp, rtol=0, atol=0)


def _loss_and_grads(model, mb, entropy_grad: bool):
    model.zero_grad()
    logp, ent = response_logprobs(model, mb, entropy=True, entropy_grad=entropy_grad)
    assert ent is not None
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
    loss = (logp * weights).sum() + (0.01 * ent * weights.flip(-1)).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logp.detach(), ent.detach(), grads


def _kept_log_softmax(model, mb, vocab: int) -> int:
    """How many float32 ``[tokens, V]`` tensors the graph keeps for the backward."""
    shape, kept = (mb.targets.numel(), vocab), 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += int(t.dtype == torch.float32 and tuple(t.shape) == shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        response_logprobs(model, mb, entropy=True)
    return kept


class _FullSizeOps(TorchDispatchMode):
    """Counts the ops that make a tensor of ``shape`` (run under it: a backward)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape
        return out


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunks_of_tokens_give_the_same_values_and_gradients_and_keep_one_chunk(
    tiny_model, monkeypatch, entropy_grad: bool
):
    """Found by a review: the float32 log-softmax ``[tokens, V]`` was kept whole for the
    backward (9.7 GB for 16k tokens of a 152k vocabulary). Taken in chunks of 2 tokens
    here, each recomputed in the backward: the same logprobs, entropy and gradients (each
    row is computed alone either way), and no float32 ``[tokens, V]`` is kept where the
    plain path keeps the whole log-softmax."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rollouts = [
        Rollout([1, 2, 3], [4, 5, 6, 7], [-1.0] * 4, 0.0, 0),
        Rollout([6], [7, 8, 9], [-1.0] * 3, 0.0, 0),
    ]
    mb = collate(rollouts, torch.zeros(2), [0, 1], packed=False)
    mb.temperature = torch.tensor([1.0, 0.7])
    whole = _loss_and_grads(model, mb, entropy_grad)
    vocab = model.config.vocab_size
    plain = _kept_log_softmax(model, mb, vocab)
    monkeypatch.setattr(forward, "CHUNK_BYTES", 2 * 4 * vocab)  # 2 tokens a chunk
    chunked = _loss_and_grads(model, mb, entropy_grad)
    for a, b in zip(whole[:2], chunked[:2], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert len(whole[2]) == len(chunked[2]) > 0
    for a, b in zip(whole[2], chunked[2], strict=True):
        # The logits' gradient is the same row by row; the matmuls behind it sum the rows
        # in another grouping: float32 rounding of sums of O(1) terms.
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert plain > 0  # the whole [tokens, V] log-softmax, kept
    assert _kept_log_softmax(model, mb, vocab) == 0
    # Found by a review: chunks sliced from the rows each sent back a zero-filled
    # [tokens, V] gradient, added up one by one (quadratic in the tokens); split chunks'
    # gradients are joined once.
    logp, _ = response_logprobs(model, mb, entropy=False)
    with _FullSizeOps((mb.targets.numel(), vocab)) as ops:
        logp.sum().backward()
    assert ops.count <= 2, ops.count  # the join, and the logits' gather
