"""The KL penalty in the reward (``algorithm.use_kl_in_reward``), as veRL's
``apply_kl_penalty``: every response token's reward loses ``beta * KL_t`` between the
proximal policy (the weights at the step's start) and the frozen reference, and the
outcome score stays on the last token. Every estimator reads them, as in veRL: GAE
(:mod:`learner.critic`) and REINFORCE++ (:mod:`learner.advantages`) per token, the group
estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++ with a baseline) each response's sum, its
score less ``beta`` times its summed KL, before the group statistics
(:func:`learner.rollouts.baseline_advantages`).

``beta`` is ``algorithm.kl_ctrl.kl_coef``; with ``kl_ctrl.type: adaptive`` it moves after
each batch towards ``kl_ctrl.target_kl`` (:class:`learner.values.KLController`), and is
saved with the checkpoint (in its ``extra``, :meth:`RewardKL.saved`).

One learner step: :meth:`RewardKL.token_rewards` consumes the cleaned batch and this
rank's proximal and reference logprobs, gathers the other ranks' (a collective), and
produces the batch's token rewards, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.config import Config
from asyncrl.config.policy import TOKEN_REWARD_ESTIMATORS
from learner import fsdp
from learner.checkpoint import REWARD_KL_KEY, REWARD_KL_KIND
from learner.collate import pad_rows
from learner.rollouts import Rollout, episode_rows, outcome_rewards, response_mask
from learner.values import KLController, kl_in_reward


def token_rewards(
    estimator: str,
    rollouts: Sequence[Rollout],
    reward_kl: RewardKL | None,
    proximal: dict[int, torch.Tensor] | None,
    ref: dict[int, torch.Tensor] | None,
    metrics: dict[str, float],
) -> torch.Tensor | None:
    """The token rewards ``[B, T]`` of the cleaned batch: with the penalty when
    ``reward_kl`` is on, for every estimator (its metrics into ``metrics``); without it the
    outcome rewards for ``estimator``s that read rewards per token
    (:data:`TOKEN_REWARD_ESTIMATORS`), None for the others (they read the scores).
    ``proximal``/``ref`` as :meth:`RewardKL.token_rewards` takes them."""
    if reward_kl is None:
        return outcome_rewards(rollouts) if estimator in TOKEN_REWARD_ESTIMATORS else None
    if proximal is None or ref is None:
        raise ValueError("the KL in the reward needs the proximal and reference logprobs")
    rewards, kl_metrics = reward_kl.token_rewards(rollouts, proximal, ref)
    metrics.update(kl_metrics)
    return rewards


class RewardKL:
    """The penalty's coefficient and how it is applied (see the module docstring)."""

    def __init__(self, cfg: Config, world_size: int) -> None:
        kl = cfg.algorithm.kl_ctrl
        self.ctrl = KLController(kl.kl_coef, kl.type, kl.target_kl, kl.horizon)
        self.kind = cfg.algorithm.kl_penalty
        self.world_size = world_size

    def token_rewards(
        self,
        rollouts: Sequence[Rollout],
        proximal: dict[int, torch.Tensor],
        ref: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Token rewards ``[B, T]`` of the cleaned batch ``rollouts`` with the penalty, and
        veRL's ``actor/reward_kl_penalty`` (the batch's KL) and ``..._coeff`` (the ``beta``
        used). ``proximal``/``ref``: this rank's logprobs ``[T_i]`` by index into
        ``rollouts``. Steps the adaptive controller. A collective when ranks > 1."""
        mask, _ = response_mask(rollouts)
        p = fsdp.gather_sequences(proximal, self.world_size)
        q = fsdp.gather_sequences(ref, self.world_size)
        rows = range(len(rollouts))
        logp = pad_rows([p[i] for i in rows], mask.shape[1])
        ref_lp = pad_rows([q[i] for i in rows], mask.shape[1])
        beta = self.ctrl.value
        episodes = episode_rows(rollouts)  # the KL and the batch size count episodes
        rewards, kl = kl_in_reward(
            outcome_rewards(rollouts),
            logp,
            ref_lp,
            mask,
            coef=beta,
            kind=self.kind,
            episodes=episodes,
        )
        self.ctrl.update(kl, len(episodes))
        return rewards, {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": beta}

    def saved(self, extra: dict | None) -> dict:
        """A checkpoint's ``extra`` with the coefficient (adaptive: it moved in the run)."""
        return {**(extra or {}), REWARD_KL_KEY: self.ctrl.value, REWARD_KL_KIND: self.ctrl.kind}

    def restore(self, extra: dict) -> str | None:
        """The adaptive coefficient from a checkpoint's ``extra``, where it had moved; a
        fixed one stays the config's (a resume that changes ``kl_ctrl.kl_coef`` trains with
        the new value, as with any fixed setting). Returns a line for the log when the
        config's starting value is not the one resumed."""
        if REWARD_KL_KEY not in extra or self.ctrl.kind != "adaptive":
            return None
        if extra.get(REWARD_KL_KIND, "adaptive") != "adaptive":  # saved fixed: it never moved
            return None
        saved, start = float(extra[REWARD_KL_KEY]), self.ctrl.value
        self.ctrl.value = saved
        if saved == start:
            return None
        return (
            f"the adaptive KL-in-reward coefficient resumes at {saved:.6g}, where the run had "
            f"moved it (algorithm.kl_ctrl.kl_coef={start:g} is where a new run starts)"
        )
