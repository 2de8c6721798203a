"""The policy's forward on a micro-batch: with the entropy a metric only (entropy_coeff 0)
it is computed without a graph, so its ``[B, T, V]`` terms are not kept for the backward;
its values and the logprobs' gradient are the same either way."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

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
