"""From rollouts to model inputs: cleaning, mini-batches, rank shards, micro-batches.

Pure (torch tensors, no model, no process group). The learner receives the *global* batch
on every rank; every rank computes the same plan (:func:`plan_minibatch`) and keeps its own
share, so no extra collective is needed and the same global batch gives the same result on
1 or N ranks (the loss normalisers are global, see :class:`learner.losses.AggNorm`).

Layout of one micro-batch (:class:`MicroBatch`): sequences (prompt + response) are packed
into one row ``[1, S]`` with per-sequence ``position_ids`` (padding removed; the model sees
where each sequence starts from its positions) or right-padded ``[B, L]`` with an attention
mask, rows of similar length together (:mod:`learner.layout` says which layout is used). Either way ``gather_index`` ``[B, T]``
points into the flattened logits at the position that predicts each response token, so the
per-token tensors downstream are ``[B, T]`` (T = the longest response in the micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import torch

from learner.advantages import outcome_advantages


@dataclass
class Rollout:
    """One sampled response, as the learner trains on it.

    ``behaviour_logprobs[i]`` is vLLM's logprob of ``response_ids[i]`` after temperature
    (NaN: not reported; the loss drops the token); ``version_spans`` lists
    ``(policy_version, n_tokens)`` runs over the response. ``temperature`` is the one the
    response was sampled at; None means the run's configured one (see :func:`collate`).
    ``loss_mask`` (multi-turn) is 1 on the response tokens the policy sampled, 0 on tool
    output and other inserted tokens (None: all 1); only masked-in tokens count in the loss,
    the importance weights, KL and entropy. ``episode`` names the episode within the group
    when one episode became several samples; group statistics count each episode once
    (None: the rollout is an episode of its own).
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]
    reward: float
    group_id: Hashable
    version_spans: Sequence[tuple[int, int]] = ()
    temperature: float | None = None
    loss_mask: Sequence[int] | None = None
    episode: Hashable | None = None

    @property
    def oldest_version(self) -> int | None:
        return min((v for v, _ in self.version_spans), default=None)


DROP_REASONS: tuple[str, ...] = (
    "length_mismatch",
    "empty_response",
    "empty_prompt",
    "nonfinite_reward",
    "too_long",
)


def drop_reason(r: Rollout, max_len: int | None = None) -> str | None:
    """Why a rollout cannot be trained on (one of :data:`DROP_REASONS`), or None."""
    if len(r.response_ids) != len(r.behaviour_logprobs) or (
        r.loss_mask is not None and len(r.loss_mask) != len(r.response_ids)
    ):
        return "length_mismatch"
    if len(r.response_ids) == 0:
        return "empty_response"
    if len(r.prompt_ids) == 0:
        return "empty_prompt"  # the first response token would have no context
    if not math.isfinite(float(r.reward)):
        return "nonfinite_reward"
    if max_len is not None and len(r.prompt_ids) + len(r.response_ids) > max_len:
        return "too_long"
    return None


def clean_rollouts(
    rollouts: Sequence[Rollout], max_len: int | None = None
) -> tuple[list[Rollout], dict[str, int]]:
    """Keep the trainable rollouts; count the others by reason (never raises)."""
    kept: list[Rollout] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for r in rollouts:
        reason = drop_reason(r, max_len)
        if reason is None:
            kept.append(r)
        else:
            dropped[reason] += 1
    return kept, dropped


def baseline_advantages(
    rollouts: Sequence[Rollout],
    kept: Sequence[Rollout],
    estimator: str,
    *,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """Outcome advantages ``[len(kept)]`` of the ``kept`` rollouts (a sub-list of
    ``rollouts``, as :func:`clean_rollouts` returns it).

    Each group's statistics are taken over every member of ``rollouts`` with a finite
    reward, trainable or not: a member cleaned away (an empty or too long response) was
    still sampled and scored, so it stays in its group's baseline (veRL scores every
    sampled response). Computed over the survivors only, a group that lost a member would
    give its lone survivor its raw score as advantage. The samples of one episode (see
    :attr:`Rollout.episode`) share its reward and count once; each gets its advantage.
    """
    if not kept:
        return torch.zeros(0, dtype=torch.float32)
    episodes: dict[Hashable, int] = {}  # episode key -> row among the episodes
    firsts: list[Rollout] = []
    for r in rollouts:
        if not math.isfinite(float(r.reward)):
            continue
        if episodes.setdefault(_episode(r), len(firsts)) == len(firsts):
            firsts.append(r)
    rewards = torch.tensor([float(r.reward) for r in firsts], dtype=torch.float32)
    adv = outcome_advantages(estimator, rewards, group_indices(firsts), norm_by_std=norm_by_std)
    return adv[[episodes[_episode(r)] for r in kept]]


def _episode(r: Rollout) -> Hashable:
    # Kept rollouts are the same objects as in ``rollouts``: a lone one is keyed by identity.
    return id(r) if r.episode is None else (r.group_id, r.episode)


def group_indices(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """Dense group index ``[N]`` (long), groups numbered in order of first appearance."""
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(r.group_id, len(ids)) for r in rollouts], dtype=torch.long)


def minibatches(group_index: torch.Tensor, groups_per_minibatch: int) -> list[list[int]]:
    """Sequence indices of each mini-batch: consecutive runs of ``groups_per_minibatch``
    groups (``actor.ppo_mini_batch_size`` counts prompts, as in veRL). The last may be
    smaller when the batch lost groups."""
    if groups_per_minibatch <= 0:
        raise ValueError("groups_per_minibatch must be positive")
    n_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    out = []
    for start in range(0, n_groups, groups_per_minibatch):
        sel = (group_index >= start) & (group_index < start + groups_per_minibatch)
        out.append(torch.nonzero(sel).flatten().tolist())
    return out


def shard(indices: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split ``indices`` across ranks: counts differ by at most one, tokens balanced.

    Longest first, each to the least-loaded rank that still has room (a deterministic
    greedy, so every rank computes the same split). Returns one list per rank, in the
    original order of ``indices``.
    """
    cap = math.ceil(len(indices) / world_size) if indices else 0
    order = sorted(range(len(indices)), key=lambda k: (-lengths[k], k))
    loads = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for k in order:
        rank = min(
            (r for r in range(world_size) if len(owned[r]) < cap), key=lambda r: (loads[r], r)
        )
        owned[rank].append(k)
        loads[rank] += lengths[k]
    return [[indices[k] for k in sorted(ks)] for ks in owned]


def micro_batches(
    indices: Sequence[int],
    lengths: Sequence[int],
    *,
    max_tokens: int | None = None,
    max_seqs: int | None = None,
    padded: bool = False,
) -> list[list[int]]:
    """Group ``indices`` into micro-batches; ``lengths[k]`` belongs to ``indices[k]``.

    With ``max_tokens`` (dynamic batch size) the budget counts what the model is fed: for
    packed rows the real tokens (first-fit decreasing), for ``padded`` ones ``rows x
    longest row`` (longest first, so each micro-batch holds sequences of similar length and
    padding stays small). A sequence longer than the budget goes alone. Without it, runs of
    ``max_seqs`` sequences; ``padded`` sorts them by length first, for the same reason.
    """
    if max_tokens is None:
        if not max_seqs or max_seqs <= 0:
            raise ValueError("give max_tokens or a positive max_seqs")
        idx = list(indices)
        if padded:
            idx = [indices[k] for k in _longest_first(lengths)]
        return [idx[i : i + max_seqs] for i in range(0, len(idx), max_seqs)]
    if padded:
        return _padded_bins(indices, lengths, max_tokens)
    bins: list[list[int]] = []
    loads: list[int] = []
    for k in _longest_first(lengths):
        for b, load in enumerate(loads):
            if load + lengths[k] <= max_tokens:
                bins[b].append(indices[k])
                loads[b] += lengths[k]
                break
        else:
            bins.append([indices[k]])
            loads.append(lengths[k])
    return bins


def _longest_first(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))


def _padded_bins(
    indices: Sequence[int], lengths: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """Consecutive runs of the length-sorted sequences whose padded size (rows x the first,
    longest, row) fits ``max_tokens``."""
    bins: list[list[int]] = []
    width = 0
    for k in _longest_first(lengths):
        if bins and (len(bins[-1]) + 1) * width <= max_tokens:
            bins[-1].append(indices[k])
        else:
            bins.append([indices[k]])
            width = lengths[k]
    return bins


def plan_minibatch(
    indices: Sequence[int],
    lengths: Sequence[int],
    world_size: int,
    *,
    max_tokens: int | None = None,
    max_seqs: int | None = None,
    padded: bool = False,
) -> list[list[list[int]]]:
    """Per rank, the micro-batches of one mini-batch, every rank with the same count
    (``padded``: the micro-batches are padded rows, see :func:`micro_batches`).

    Ranks must run the same number of forward/backward passes (FSDP's collectives happen
    inside them), so shorter plans are padded with empty micro-batches, which the trainer
    runs as a zero-weight dummy. ``lengths`` is indexed by sequence index (global).
    """
    plans = []
    for part in shard(indices, [lengths[i] for i in indices], world_size):
        plans.append(
            micro_batches(
                part,
                [lengths[i] for i in part],
                max_tokens=max_tokens,
                max_seqs=max_seqs,
                padded=padded,
            )
        )
    n = max(1, max(len(p) for p in plans))
    return [p + [[] for _ in range(n - len(p))] for p in plans]


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


def norm_counts(rollouts: Sequence[Rollout], indices: Sequence[int]) -> tuple[int, int]:
    """``(valid tokens, sequences with a valid token)`` of a mini-batch: the global loss
    normalisers. Valid = masked in, with a finite behaviour logprob (the rule of the loss)."""
    tokens = seqs = 0
    for i in indices:
        r = rollouts[i]
        mask = r.loss_mask if r.loss_mask is not None else [1] * len(r.behaviour_logprobs)
        n = sum(
            1 for x, m in zip(r.behaviour_logprobs, mask, strict=True) if m and math.isfinite(x)
        )
        tokens += n
        seqs += n > 0
    return tokens, seqs
