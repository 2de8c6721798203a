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
from itertools import accumulate, chain

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
    full = [[*r.prompt_ids, *r.response_ids] for r in seqs]
    row_len = max(len(f) for f in full)
    # Logits at position j predict token j + 1: response token t comes from n_p - 1 + t,
    # counted from where the sequence starts in the flattened rows.
    if packed:
        starts = list(accumulate((len(f) for f in full[:-1]), initial=0))
    else:
        starts = [b * row_len for b in range(len(seqs))]
    gather = [
        [s + len(r.prompt_ids) - 1 + t for t in range(len(r.response_ids))]
        for s, r in zip(starts, seqs, strict=True)
    ]
    if packed:
        input_ids = torch.tensor([list(chain.from_iterable(full))], dtype=torch.long)
        position_ids = torch.tensor([[p for f in full for p in range(len(f))]], dtype=torch.long)
        attention_mask = None
    else:
        input_ids = padded_tensor(full, row_len, pad_id, torch.long)
        attention_mask = padded_tensor([[1] * len(f) for f in full], row_len, 0, torch.long)
        position_ids = None
    return MicroBatch(
        input_ids,
        position_ids,
        attention_mask,
        padded_tensor(gather, max(len(g) for g in gather), 0, torch.long),
        *response_tensors(seqs, pad_id),
        advantages[list(seq_ids)].to(torch.float32),
        temperatures(seqs, temperature),
        list(seq_ids),
        sum(len(f) for f in full),
    )


def padded_tensor(
    rows: Sequence[Sequence[float]], width: int, fill: float, dtype: torch.dtype
) -> torch.Tensor:
    """``[len(rows), width]`` of ``dtype``: each row left-aligned, ``fill`` after it. Built
    from Python lists in one call (a slice assignment per row costs more than the copy)."""
    return torch.tensor([[*r, *([fill] * (width - len(r)))] for r in rows], dtype=dtype)


def response_tensors(
    seqs: Sequence[Rollout], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(targets, mask, behaviour)``, each ``[B, T]`` (T = the longest response): the
    response tokens (``pad_id`` after them), where the loss trains (a multi-turn
    ``loss_mask`` leaves tool output out), the behaviour logprobs (0 after them)."""
    t_max = max(len(r.response_ids) for r in seqs)
    masks = [
        [True] * len(r.response_ids) if r.loss_mask is None else [x != 0 for x in r.loss_mask]
        for r in seqs
    ]
    return (
        padded_tensor([list(r.response_ids) for r in seqs], t_max, pad_id, torch.long),
        padded_tensor(masks, t_max, False, torch.bool),
        padded_tensor([list(r.behaviour_logprobs) for r in seqs], t_max, 0.0, torch.float32),
    )


def temperatures(seqs: Sequence[Rollout], default: float) -> torch.Tensor:
    """``[B]``: each sequence's sampling temperature, ``default`` where it does not say."""
    temps = [default if r.temperature is None else float(r.temperature) for r in seqs]
    return torch.tensor(temps, dtype=torch.float32)


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
