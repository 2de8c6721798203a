"""The ``shared`` sequence layout: one row per distinct prompt, holding the prompt once and
then the responses of every sample of it, each response attending to the prompt and to its
own earlier tokens only (a 4D attention mask).

A GRPO micro-batch holds ``n`` samples of each prompt; padded rows ``[B, L]`` compute every
prompt ``n`` times over. A shared row ``prompt + r_1[:-1] + r_2[:-1] + ...`` computes it
once: response ``j``'s token ``t`` is predicted at the position of its token ``t - 1`` (the
prompt's last token for ``t = 0``, the same for every sample), with the positions it would
have in its own sequence. The logprobs are the padded layout's to float32 rounding. It is
one forward pass, so FSDP2 shards it as any other (a KV cache of the prompts, computed in a
first pass, would run each layer twice before one backward, which FSDP2 does not take).

Attention over a shared row is dense (``L x L``), so it pays where prompts are long against
responses: on the CPU demo's batch (16 prompts of ~23 tokens, 8 samples of 1-4 tokens) a
forward and backward took 0.036 s against 0.161 s padded. :func:`collate_shared` keeps the
padded rows for a micro-batch where ``U x L^2`` would exceed padded attention's
``B x L_padded^2`` (long responses), or where no prompt repeats. Pure except
:func:`sharing_works`, which runs the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from learner.collate import MicroBatch, collate
from learner.rollouts import Rollout


def collate_shared(
    rollouts: Sequence[Rollout],
    advantages: torch.Tensor,
    seq_ids: Sequence[int],
    *,
    pad_id: int = 0,
    temperature: float = 1.0,
) -> MicroBatch:
    """The :class:`MicroBatch` of ``seq_ids`` in shared rows (``input_ids`` and
    ``position_ids`` ``[U, L]``, ``attention_mask`` ``[U, 1, L, L]``, True where a token
    may attend); the padded one where sharing would not pay (see the module docstring)."""
    mb = collate(
        rollouts, advantages, seq_ids, packed=False, pad_id=pad_id, temperature=temperature
    )
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, i in enumerate(seq_ids):
        groups.setdefault(tuple(rollouts[i].prompt_ids), []).append(b)
    seqs = [rollouts[i] for i in seq_ids]
    widths = [len(p) + sum(len(seqs[b].response_ids) - 1 for b in bs) for p, bs in groups.items()]
    L = max(widths, default=0)
    if (
        not seq_ids
        or len(groups) == len(seqs)
        or len(groups) * L * L > mb.input_ids.numel() * mb.input_ids.shape[1]
    ):
        return mb
    U = len(groups)
    input_ids = torch.full((U, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros(U, L, dtype=torch.long)
    allowed = torch.eye(L, dtype=torch.bool).repeat(U, 1, 1)  # padding sees itself only
    gather = torch.zeros_like(mb.gather_index)
    for u, (prompt, members) in enumerate(groups.items()):
        n = len(prompt)
        input_ids[u, :n] = torch.as_tensor(prompt)
        position_ids[u, :n] = torch.arange(n)
        allowed[u, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        at = n
        for b in members:
            inputs = list(seqs[b].response_ids[:-1])  # the last token is never an input
            k = len(inputs)
            gather[b, 0] = u * L + n - 1  # the prompt's last token predicts token 0
            if k:
                input_ids[u, at : at + k] = torch.as_tensor(inputs)
                position_ids[u, at : at + k] = n + torch.arange(k)
                allowed[u, at : at + k, :n] = True
                allowed[u, at : at + k, at : at + k] = torch.ones(k, k, dtype=torch.bool).tril()
                gather[b, 1 : k + 1] = u * L + at + torch.arange(k)
            at += k
    mb.input_ids, mb.position_ids = input_ids, position_ids
    mb.attention_mask = allowed[:, None]
    mb.gather_index = gather
    return mb


def sharing_works(forward: Callable[[MicroBatch], torch.Tensor], atol: float = 1e-3) -> bool:
    """Whether the model gives shared rows the padded layout's logprobs (its attention
    takes a 4D boolean mask as given): ``forward`` (micro-batch -> logprobs ``[B, T]``) of
    three short sequences, two with the same prompt, in both layouts, within ``atol``
    (:func:`learner.layout.probe_atol`: wider on CUDA's bf16)."""
    probe = [
        Rollout([1, 2, 3, 4, 5, 6], [4, 5], [0.0, 0.0], 0.0, 0),
        Rollout([1, 2, 3, 4, 5, 6], [6], [0.0], 0.0, 0),
        Rollout([7, 8], [9, 10, 11], [0.0, 0.0, 0.0], 0.0, 1),
    ]
    adv = torch.zeros(3)
    shared_mb = collate_shared(probe, adv, [0, 1, 2])
    if shared_mb.attention_mask is None or shared_mb.attention_mask.ndim != 4:
        raise AssertionError("the probe must take shared rows")
    try:
        with torch.no_grad():
            shared = forward(shared_mb)
            padded = forward(collate(probe, adv, [0, 1, 2], packed=False))
    except (TypeError, RuntimeError, ValueError):
        return False  # an attention that refuses a 4D mask
    mask = shared_mb.mask.to(shared.device)
    return bool(torch.allclose(shared[mask], padded[mask], atol=atol))
