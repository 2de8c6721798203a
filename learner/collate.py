"""From a micro-batch's sequence indices to model inputs: :class:`MicroBatch`,
:func:`collate` (and the dummy micro-batch of a rank with no data), :func:`pad_rows`.

Pure (torch tensors, no model, no process group). Layout of one micro-batch
(:class:`MicroBatch`): sequences (prompt + response) are packed into one row ``[1, S]``
with per-sequence ``position_ids`` (padding removed; the model sees where each sequence
starts from its positions) or right-padded ``[B, L]`` with an attention mask, rows of
similar length together (:mod:`learner.layout` says which layout is used). Either way
``gather_index`` ``[B, T]`` points into the flattened logits at the position that predicts
each response token, so the per-token tensors downstream are ``[B, T]`` (T = the longest
response in the micro-batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from learner.rollouts import Rollout


@dataclass
class MicroBatch:
    """Model inputs and per-token targets of a few sequences (see the module docstring).

    ``seq_ids`` ``[B]`` are the sequences' indices in the cleaned batch; ``advantages`` and
    ``temperature`` (each row's sampling temperature, which its logits are divided by) are
    ``[B]``; ``targets``/``behaviour``/``mask``/``gather_index`` are ``[B, T]``. A dummy
    micro-batch (``B == 1``, mask all False) keeps ranks in step when one has no data.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    gather_index: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    temperature: torch.Tensor
    seq_ids: list[int] = field(default_factory=list)
    n_tokens: int = 0  # real (non-padding) tokens fed to the model

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return replace(self, **moved)


def collate(
    rollouts: Sequence[Rollout],
    advantages: torch.Tensor,
    seq_ids: Sequence[int],
    *,
    packed: bool = True,
    pad_id: int = 0,
    temperature: float = 1.0,
) -> MicroBatch:
    """Build the :class:`MicroBatch` of ``rollouts[i] for i in seq_ids`` (``advantages``
    ``[N]`` is indexed the same way). Empty ``seq_ids`` gives the dummy micro-batch.
    ``temperature`` stands in for rollouts that do not say what they were sampled at."""
    if not seq_ids:
        return _dummy(pad_id)
    seqs = [rollouts[i] for i in seq_ids]
    full = [list(r.prompt_ids) + list(r.response_ids) for r in seqs]
    t_max = max(len(r.response_ids) for r in seqs)
    B = len(seqs)
    gather = torch.zeros(B, t_max, dtype=torch.long)
    targets = torch.full((B, t_max), pad_id, dtype=torch.long)
    mask = torch.zeros(B, t_max, dtype=torch.bool)
    behaviour = torch.zeros(B, t_max, dtype=torch.float32)
    row_len = max(len(f) for f in full)
    offset = 0
    for b, (r, ids) in enumerate(zip(seqs, full, strict=True)):
        n_p, n_r = len(r.prompt_ids), len(r.response_ids)
        # Logits at position j predict token j + 1: response token t comes from n_p - 1 + t.
        start = offset if packed else b * row_len
        gather[b, :n_r] = start + n_p - 1 + torch.arange(n_r)
        targets[b, :n_r] = torch.as_tensor(list(r.response_ids), dtype=torch.long)
        mask[b, :n_r] = True if r.loss_mask is None else torch.as_tensor(r.loss_mask) != 0
        behaviour[b, :n_r] = torch.as_tensor(list(r.behaviour_logprobs), dtype=torch.float32)
        offset += len(ids)
    if packed:
        input_ids = torch.tensor([sum(full, [])], dtype=torch.long)
        position_ids = torch.cat([torch.arange(len(f)) for f in full])[None]
        attention_mask = None
    else:
        input_ids = torch.full((B, row_len), pad_id, dtype=torch.long)
        attention_mask = torch.zeros(B, row_len, dtype=torch.long)
        for b, ids in enumerate(full):
            input_ids[b, : len(ids)] = torch.as_tensor(ids)
            attention_mask[b, : len(ids)] = 1
        position_ids = None
    temps = [temperature if r.temperature is None else float(r.temperature) for r in seqs]
    return MicroBatch(
        input_ids,
        position_ids,
        attention_mask,
        gather,
        targets,
        mask,
        behaviour,
        advantages[list(seq_ids)].to(torch.float32),
        torch.tensor(temps, dtype=torch.float32),
        list(seq_ids),
        offset,
    )


def _dummy(pad_id: int) -> MicroBatch:
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        position_ids=torch.arange(2)[None],
        attention_mask=None,
        gather_index=torch.zeros(1, 1, dtype=torch.long),
        targets=torch.full((1, 1), pad_id, dtype=torch.long),
        mask=torch.zeros(1, 1, dtype=torch.bool),
        behaviour=torch.zeros(1, 1),
        advantages=torch.zeros(1),
        temperature=torch.ones(1),
    )


def pad_rows(values: Sequence[torch.Tensor], width: int, fill: float = 0.0) -> torch.Tensor:
    """Left-aligned ``[B, width]`` from B 1-D tensors (per-sequence stored logprobs)."""
    out = torch.full((len(values), width), fill, dtype=torch.float32)
    for b, v in enumerate(values):
        out[b, : len(v)] = v
    return out
