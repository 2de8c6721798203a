"""The policy update's config groups: ``actor`` (the PPO/GRPO loss, its optimizer and
micro-batching) and ``algorithm`` (advantages, importance correction, KL in the reward,
DAPO's filter). Keys follow veRL's ``actor_rollout_ref.actor.*`` and ``algorithm.*``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.critic import KLControlConfig, OptimConfig
from asyncrl.config.recipes import (
    FilterGroupsConfig,
    FsdpConfig,
    PolicyLossConfig,
    gspo_defaults,
)
from asyncrl.config.section import Section

# --------------------------------------------------------------------------- actor
# veRL's names of the KL estimators ("+": the value of the estimator, k2's gradient).
VERL_KL_NAMES = {
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    "kl+": "k1+",
    "low_var_kl+": "k3+",
    # k2 is the estimator whose gradient "+" takes: its "+" is k2 itself
    "mse+": "k2",
    "k2+": "k2",
}
KlKind = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"]


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo_epochs: int = Field(default=1, gt=0, description="Passes over each batch.")
    ppo_mini_batch_size: int = Field(
        default=16, gt=0, description="Prompts per optimizer step (divides data.train_batch_size)."
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        default=16,
        gt=0,
        description="Sequences per forward/backward when use_dynamic_bsz is off (null needs "
        "use_dynamic_bsz).",
    )
    use_dynamic_bsz: bool = Field(
        default=True, description="Size micro-batches by token count, not sequence count."
    )
    ppo_max_token_len_per_gpu: int = Field(
        default=16384,
        gt=0,
        description="Tokens per micro-batch with use_dynamic_bsz (padded layout: rows x "
        "longest row).",
    )
    sequence_layout: Literal["auto", "packed", "padded", "shared"] = Field(
        default="auto",
        description="Micro-batch rows: packed (one row, no padding; fast only with a "
        "varlen attention kernel), padded (rows sorted by length), shared (padded rows whose "
        "repeated prompts run once, where that pays), or auto (packed with flash attention "
        "on CUDA, else shared).",
    )
    clip_ratio_low: float = Field(default=0.2, gt=0, lt=1, description="PPO clip: 1 - eps_low.")
    clip_ratio_high: float = Field(default=0.28, gt=0, description="PPO clip: 1 + eps_high.")
    clip_ratio_c: float = Field(
        default=3.0,
        gt=1,
        description="Dual clip: a negative-advantage token loses at most clip_ratio_c * |A| "
        "(vanilla loss; veRL's default).",
    )
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    fsdp_config: FsdpConfig = Field(default_factory=FsdpConfig)
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field(default="token-mean", description="How token losses are averaged (veRL's names).")
    use_kl_loss: bool = Field(default=False, description="Add a KL penalty to a frozen reference.")
    kl_loss_coef: float = Field(default=0.001, ge=0, description="Weight of the KL penalty.")
    kl_loss_type: KlKind = Field(
        default="k3",
        description="KL estimator (veRL: kl=k1, mse=k2, low_var_kl=k3; abs; a + suffix keeps "
        "the value and takes k2's gradient).",
    )
    entropy_coeff: float = Field(default=0.0, ge=0, description="Entropy bonus weight.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")

    @model_validator(mode="before")
    @classmethod
    def _gspo_defaults(cls, data: object) -> object:
        return gspo_defaults(data)

    @field_validator("kl_loss_type", mode="before")
    @classmethod
    def _verl_kl_names(cls, v: object) -> object:
        return VERL_KL_NAMES.get(v, v)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- algorithm
#: Estimators whose baseline is the other samples of the prompt: they need groups (n >= 2).
GROUP_ESTIMATORS = ("grpo", "rloo", "dr_grpo", "reinforce_plus_plus_baseline")
#: Estimators that read rewards per token (their returns run over them); the others read one
#: score per response. ``use_kl_in_reward``'s penalty (veRL's ``apply_kl_penalty``) reaches
#: both: the others' score is then the response's summed token rewards, as veRL's
#: ``token_level_rewards.sum(-1)``.
TOKEN_REWARD_ESTIMATORS = ("gae", "reinforce_plus_plus")


class ImportanceConfig(Section):
    mode: Literal["tis", "mis", "none"] = Field(
        default="tis",
        description="Behaviour-policy correction: truncate the weight (tis), mask the "
        "token (mis) or none.",
    )
    cap: float = Field(default=2.0, ge=1, description="Truncation/mask threshold of the weight.")
    level: Literal["token", "sequence"] = Field(
        default="token", description="Per-token weights or their per-sequence geometric mean."
    )


#: veRL's vectorised estimators: the same formulas as these.
VERL_VECTORIZED = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}


class AlgorithmConfig(Section):
    adv_estimator: Literal[
        "grpo", "rloo", "dr_grpo", "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
    ] = Field(default="grpo", description="Advantage estimator.")
    norm_adv_by_std_in_grpo: bool = Field(
        default=True, description="Divide GRPO advantages by std."
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount (GAE, REINFORCE++).")
    lam: float = Field(default=1.0, ge=0, le=1, description="GAE lambda.")
    use_kl_in_reward: bool = Field(
        default=False,
        description="Subtract a KL-to-reference penalty from token rewards (every "
        "adv_estimator; grpo, rloo, dr_grpo, reinforce_plus_plus_baseline: from each "
        "response's summed rewards, as veRL).",
    )
    kl_penalty: KlKind = Field(
        default="k1",
        description="KL-in-reward estimator (veRL: kl=k1, mse=k2, low_var_kl=k3; abs).",
    )
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)

    @field_validator("kl_penalty", mode="before")
    @classmethod
    def _verl_kl_names(cls, v: object) -> object:
        return VERL_KL_NAMES.get(v, v)  # type: ignore[arg-type]

    @field_validator("adv_estimator", mode="before")
    @classmethod
    def _verl_vectorized(cls, v: object) -> object:
        """veRL's vectorised spellings compute the same advantages as the plain ones."""
        return VERL_VECTORIZED.get(v, v)  # type: ignore[arg-type]

    importance: ImportanceConfig = Field(default_factory=ImportanceConfig)
