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

from learner.collate import MicroBatch, collate, padded_tensor, response_tensors, temperatures
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
    seqs = [rollouts[i] for i in seq_ids]
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, r in enumerate(seqs):
        groups.setdefault(tuple(r.prompt_ids), []).append(b)
    widths = [
        len(p) + sum(max(len(seqs[b].response_ids) - 1, 0) for b in bs) for p, bs in groups.items()
    ]
    L = max(widths, default=0)
    padded_len = max((len(r.prompt_ids) + len(r.response_ids) for r in seqs), default=0)
    if not seqs or len(groups) == len(seqs) or len(groups) * L * L > len(seqs) * padded_len**2:
        return collate(
            rollouts, advantages, seq_ids, packed=False, pad_id=pad_id, temperature=temperature
        )
    # Each row as lists: its tokens, their positions in their own sequences, and which
    # part of the row each is (0: the prompt, j + 1: the j-th response in the row).
    ids: list[list[int]] = []
    pos: list[list[int]] = []
    part: list[list[int]] = []
    gather: list[list[int]] = [[] for _ in seqs]
    for u, (prompt, members) in enumerate(groups.items()):
        n = len(prompt)
        row, row_pos, row_part = list(prompt), list(range(n)), [0] * n
        for j, b in enumerate(members):
            inputs = list(seqs[b].response_ids[:-1])  # the last token is never an input
            at, k = len(row), len(inputs)
            # The prompt's last token predicts token 0, response token t - 1 token t.
            gather[b] = [u * L + n - 1, *(u * L + at + t for t in range(k))]
            row += inputs
            row_pos += range(n, n + k)
            row_part += [j + 1] * k
        ids.append(row)
        pos.append(row_pos)
        part.append(row_part)
    parts = padded_tensor(part, L, -1, torch.long)  # -1: padding
    # A token sees earlier tokens of the prompt and of its own response; padding sees
    # itself only.
    see, by = parts[:, :, None], parts[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = causal & (see >= 0) & ((by == 0) | (by == see))
    allowed |= torch.eye(L, dtype=torch.bool) & (see < 0)
    t_max = max(len(r.response_ids) for r in seqs)
    return MicroBatch(
        padded_tensor(ids, L, pad_id, torch.long),
        padded_tensor(pos, L, 0, torch.long),
        allowed[:, None],
        padded_tensor(gather, t_max, 0, torch.long),
        *response_tensors(seqs, pad_id),
        advantages[list(seq_ids)].to(torch.float32),
        temperatures(seqs, temperature),
        list(seq_ids),
        sum(len(r.prompt_ids) + len(r.response_ids) for r in seqs),
    )


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
