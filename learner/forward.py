"""The policy's forward pass on a micro-batch: logprobs (and entropy) of the response
tokens, each row at the temperature it was sampled at.

Memory: the float32 log-softmax over the vocabulary is ``[tokens, V]``, 9.7 GB for 16k
response tokens of a 152k vocabulary, and the backward keeps it (and, with an entropy
bonus, two more of its size). So the tokens are taken :data:`CHUNK_BYTES` of log-softmax at
a time, each chunk recomputed in the backward instead of kept
(:func:`torch.utils.checkpoint.checkpoint`): beside the logits and their gradient (the
model's dtype, whole), the float32 terms alive at once are one chunk's; the values and
gradients are the same. A vocabulary small enough for one chunk (the tiny demo models) takes
the plain path, nothing recomputed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from learner.collate import MicroBatch

#: How much float32 log-softmax one chunk of tokens may hold: ``CHUNK_BYTES // (4 V)`` rows.
CHUNK_BYTES = 256 * 2**20


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
    vocab = out.logits.shape[-1]
    b, t = mb.targets.shape
    # [B * T, V]: the response positions' logits, one row per token.
    rows = out.logits.reshape(-1, vocab)[mb.gather_index.reshape(-1)]
    temperature = mb.temperature[:, None].expand(b, t).reshape(-1)
    targets = mb.targets.reshape(-1)
    ent_grad = entropy and entropy_grad and torch.is_grad_enabled()
    step = max(1, CHUNK_BYTES // (4 * vocab))
    if rows.shape[0] <= step:
        logp, ent = _token_terms(rows, targets, temperature, entropy, ent_grad)
    else:
        # split, not slices: a slice's gradient is a zero-filled [tokens, V] that autograd
        # then adds up chunk by chunk; split's backward is one cat of the chunks' gradients.
        chunks = zip(rows.split(step), targets.split(step), temperature.split(step), strict=True)
        # Under a graph each chunk is recomputed in the backward rather than keeping its
        # [rows, V] float32 terms (only its rows, a view, are kept); nothing random inside.
        keep = {"use_reentrant": False, "preserve_rng_state": False}
        run = partial(checkpoint, _token_terms, **keep) if torch.is_grad_enabled() else _token_terms
        parts = [run(r, tg, tp, entropy, ent_grad) for r, tg, tp in chunks]
        logp = torch.cat([p[0] for p in parts])
        ent = torch.cat([e for _, e in parts if e is not None]) if entropy else None
    return logp.view(b, t), (ent.view(b, t) if ent is not None else None)


def _token_terms(
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each row's target ``[N]`` and, if asked, its entropy ``[N]``, from logits
    ``rows`` ``[N, V]`` (any float dtype; taken in float32) at ``temperature`` ``[N]``."""
    logp_all = torch.log_softmax(rows.float() / temperature[:, None], dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad):
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for a no-grad pass, then back in the mode it was in. With
    dropout in the config, a pass in training mode drew a fresh mask each time: the
    proximal logprobs and the critic's values (GAE's ``V`` and the clip's ``V_old``) came
    out noisy; veRL computes both in eval mode too."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
