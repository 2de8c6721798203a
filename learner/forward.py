"""The policy's forward pass on a micro-batch: logprobs (and entropy) of the response
tokens, each row at the temperature it was sampled at."""

from __future__ import annotations

import torch

from learner.collate import MicroBatch


def response_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    *,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[B, T]`` of the response tokens and, if asked, the entropy ``[B, T]``
    of the same distribution. Each row's logits are divided by the temperature it was
    sampled at (``mb.temperature`` ``[B]``): rollout servers may differ from the config.
    ``mb`` must be on the model's device. ``entropy_grad`` False: the entropy is a metric
    only, computed without a graph (its ``[B, T, V]`` terms are not kept for a backward)."""
    out = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        attention_mask=mb.attention_mask,
        use_cache=False,
    )
    logits = out.logits.reshape(-1, out.logits.shape[-1])[mb.gather_index]
    # logits [B, T, V]: one temperature per row.
    logp_all = torch.log_softmax(logits.float() / mb.temperature[:, None, None], dim=-1)
    logp = logp_all.gather(-1, mb.targets[..., None]).squeeze(-1)
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent
