"""The learner's view of a batch before it is cut: :class:`Rollout` (one sampled response
as the learner trains on it), the cleaning rule (which rollouts cannot be trained on, and
why: :func:`drop_reason`, :func:`clean_rollouts`), the groups (:func:`group_indices`) and
the outcome advantages over whole groups (:func:`baseline_advantages`).

Pure (torch tensors, no model, no process group). What comes next: :mod:`learner.plan`
cuts the cleaned batch into mini-batches and micro-batches, :mod:`learner.collate` turns a
micro-batch into model inputs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from asyncrl.wire.types import usable_reward
from learner.advantages import (
    outcome_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)


@dataclass
class Rollout:
    """One sampled response, as the learner trains on it.

    ``behaviour_logprobs[i]`` is vLLM's logprob of ``response_ids[i]`` after temperature
    (NaN: not reported; the loss drops the token); ``version_spans`` lists
    ``(policy_version, n_tokens)`` runs over the response. ``temperature`` is the one the
    response was sampled at; None means the run's configured one (see :func:`learner.collate.collate`).
    ``loss_mask`` (multi-turn) is 1 on the response tokens the policy sampled, 0 on tool
    output and other inserted tokens (None: all 1); only masked-in tokens count in the loss,
    the importance weights, KL and entropy. ``episode`` names the episode within the group
    when one episode became several samples (None: the rollout is an episode of its own).
    The samples of an episode come in a batch in the order the server produced them (its
    ``group_index`` order, which the buffer keeps), and train as that episode sent as one
    sample with its tool answers masked out: group statistics and the per-sequence loss
    normalisers count it once, its outcome sits on its last sample
    (:func:`outcome_rewards`), GAE and REINFORCE++ run over its samples end to end
    (:func:`episode_rows`).
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
    if not usable_reward(float(r.reward)):  # float32 holds it: 1e39 would be inf there
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
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Outcome advantages ``[len(kept)]`` of the ``kept`` rollouts (a sub-list of
    ``rollouts``, as :func:`clean_rollouts` returns it).

    Each group's statistics are taken over every member of ``rollouts`` with a finite
    reward, trainable or not: a member cleaned away (an empty or too long response) was
    still sampled and scored, so it stays in its group's baseline (veRL scores every
    sampled response). Computed over the survivors only, a group that lost a member would
    give its lone survivor its raw score as advantage. The samples of one episode (see
    :attr:`Rollout.episode`) share its reward and count once; each gets its advantage.

    ``token_rewards`` ``[len(kept), T]``: the kept rows' rewards with the KL penalty in
    them (``algorithm.use_kl_in_reward``, :mod:`learner.reward_kl`). Each episode's score is
    then what veRL's outcome estimators read, ``token_level_rewards.sum(-1)``: its reward
    less ``beta`` times the KL summed over its trained tokens (all its kept samples). A
    member cleaned away had no forward pass, so no KL: it keeps its reward.
    """
    if not kept:
        return torch.zeros(0, dtype=torch.float32)
    episodes: dict[Hashable, int] = {}  # episode key -> row among the episodes
    firsts: list[Rollout] = []
    for r in rollouts:
        if not usable_reward(float(r.reward)):
            continue
        if episodes.setdefault(episode_key(r), len(firsts)) == len(firsts):
            firsts.append(r)
    rows = [episodes[episode_key(r)] for r in kept]
    rewards = torch.tensor([float(r.reward) for r in firsts], dtype=torch.float32)
    if token_rewards is not None:
        rewards = rewards - kl_paid(kept, token_rewards, rows, len(firsts))
    adv = outcome_advantages(estimator, rewards, group_indices(firsts), norm_by_std=norm_by_std)
    return adv[rows]


def kl_paid(
    kept: Sequence[Rollout], token_rewards: torch.Tensor, rows: Sequence[int], n: int
) -> torch.Tensor:
    """What the KL penalty took from each of ``n`` episodes' scores, ``[n]`` float32:
    ``beta * sum KL_t`` over every trained token of its kept samples (0 for an episode with
    none kept), from the token rewards ``[len(kept), T]`` (the outcome rewards less the
    penalty); ``rows[i]``: the episode of ``kept[i]``."""
    paid = (outcome_rewards(kept) - token_rewards).sum(dim=1)
    index = torch.as_tensor(list(rows), dtype=torch.long)
    return torch.zeros(n, dtype=paid.dtype).index_add_(0, index, paid)


def response_mask(rollouts: Sequence[Rollout]) -> tuple[torch.Tensor, list[int]]:
    """``[N, T]`` bool, True on the tokens the loss trains (a multi-turn ``loss_mask``
    leaves tool output out), and each response's length."""
    lengths = [len(r.response_ids) for r in rollouts]
    mask = torch.zeros(len(rollouts), max(lengths, default=0), dtype=torch.bool)
    for i, r in enumerate(rollouts):
        lm = r.loss_mask
        mask[i, : lengths[i]] = True if lm is None else torch.as_tensor(lm) != 0
    return mask, lengths


def outcome_rewards(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """Each episode's score on its last trained response token, ``[B, T]`` float32 (no
    penalty): a split episode's on its last sample with a trained token, paid once."""
    mask, _ = response_mask(rollouts)
    last = {episode_key(r): i for i, r in enumerate(rollouts) if mask[i].any()}
    scores = torch.tensor(
        [float(r.reward) if last.get(episode_key(r)) == i else 0.0 for i, r in enumerate(rollouts)],
        dtype=torch.float32,
    )
    return outcome_token_rewards(scores, mask)


def episode_rows(rollouts: Sequence[Rollout]) -> list[list[int]]:
    """The indices into ``rollouts`` of each episode's samples, in order (a lone rollout
    is an episode of one), episodes in order of first appearance: what
    :func:`~learner.advantages.gae_advantages` and REINFORCE++ join."""
    rows: dict[Hashable, list[int]] = {}
    for i, r in enumerate(rollouts):
        rows.setdefault(episode_key(r), []).append(i)
    return list(rows.values())


def token_advantages(
    rollouts: Sequence[Rollout],
    kept: Sequence[Rollout],
    estimator: str,
    gamma: float,
    token_rewards: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """REINFORCE++'s token advantages of ``kept`` (see :mod:`learner.advantages`): ``[T_i]``
    per index into ``kept``, whitened over the kept tokens; the baseline variant's group
    means are over every scored member, as :func:`baseline_advantages`'s are.
    ``token_rewards`` ``[B, T]``: the rewards when they are more than the outcome on the
    last token (the KL in the reward, :mod:`learner.reward_kl`): ``reinforce_plus_plus``
    runs its returns over them, the baseline variant centres each response's sum."""
    mask, lengths = response_mask(kept)
    if estimator == "reinforce_plus_plus":
        rewards = outcome_rewards(kept) if token_rewards is None else token_rewards
        adv = reinforce_pp_advantages(rewards, mask, gamma, episode_rows(kept))
    elif estimator == "reinforce_plus_plus_baseline":
        centered = baseline_advantages(
            rollouts, kept, "grpo", norm_by_std=False, token_rewards=token_rewards
        )
        adv = reinforce_pp_baseline_advantages(centered, mask)
    else:
        raise ValueError(f"{estimator!r} has no token advantages without a critic")
    return {i: adv[i, : lengths[i]] for i in range(len(kept))}


def episode_key(r: Rollout) -> Hashable:
    """What the samples of ``r``'s episode share: ``(group_id, episode)``, or the rollout's
    identity when it is an episode of its own (a kept rollout is the same object as in the
    batch it was cleaned from, so the key holds across both)."""
    return id(r) if r.episode is None else (r.group_id, r.episode)


def group_indices(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """Dense group index ``[N]`` (long), groups numbered in order of first appearance."""
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(r.group_id, len(ids)) for r in rollouts], dtype=torch.long)
