"""The critic's config group (PPO with GAE, ``algorithm.adv_estimator: gae``) and the
optimizer group it shares with the actor. Keys follow veRL's ``critic.*``; unset batch
sizes fall back to the actor's, as veRL's defaults interpolate them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncrl.config.section import Section


class OptimConfig(Section):
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    lr_warmup_steps: int = Field(
        default=-1,
        ge=-1,
        description="Linear warmup steps; -1 (veRL's default): lr_warmup_steps_ratio of the "
        "run's steps.",
    )
    lr_warmup_steps_ratio: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Warmup as a share of trainer.total_training_steps, when lr_warmup_steps "
        "is -1.",
    )
    lr_scheduler_type: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="Schedule after warmup."
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="Floor of cosine/linear decay (null: 0)."
    )

    @field_validator("min_lr_ratio", mode="before")
    @classmethod
    def _null_is_zero(cls, v: object) -> object:
        return 0.0 if v is None else v  # veRL's critic leaves it null

    def warmup_steps(self, total_steps: int | None) -> int:
        """Warmup steps: ``lr_warmup_steps``, or (-1) ``lr_warmup_steps_ratio`` of
        ``total_steps``, as veRL counts them."""
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        if self.lr_warmup_steps_ratio == 0:
            return 0
        if total_steps is None:
            raise ValueError("lr_warmup_steps_ratio needs trainer.total_training_steps")
        return int(self.lr_warmup_steps_ratio * total_steps)


class CriticOptimConfig(OptimConfig):
    lr: float = Field(default=1e-5, gt=0, description="Critic AdamW learning rate.")
    weight_decay: float = Field(
        default=0.01, ge=0, description="Critic AdamW weight decay (veRL's default)."
    )


class CriticModelConfig(Section):
    path: str | None = Field(
        default=None,
        description="Critic HF model: a causal LM (its backbone gets a fresh value head) or "
        "a saved critic; default model.path.",
    )
    enable_gradient_checkpointing: bool = Field(
        default=False, description="Recompute the critic's activations in backward."
    )


class CriticConfig(Section):
    model: CriticModelConfig = Field(default_factory=CriticModelConfig)
    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig)
    ppo_epochs: int | None = Field(
        default=None, gt=0, description="Critic passes over each batch; default the actor's."
    )
    ppo_mini_batch_size: int | None = Field(
        default=None, gt=0, description="Prompts per critic update; default the actor's."
    )
    ppo_micro_batch_size_per_gpu: int | None = Field(
        default=None, gt=0, description="Sequences per critic micro-batch; default the actor's."
    )
    use_dynamic_bsz: bool | None = Field(
        default=None, description="Size critic micro-batches by tokens; default the actor's."
    )
    ppo_max_token_len_per_gpu: int | None = Field(
        default=None, gt=0, description="Tokens per critic micro-batch; default the actor's."
    )
    cliprange_value: float = Field(
        default=0.5, gt=0, description="How far a value may move from the batch's own."
    )
    loss_agg_mode: (
        Literal[
            "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
        ]
        | None
    ) = Field(
        default=None,
        description="How token value losses are averaged (veRL's names); default the actor's.",
    )
    grad_clip: float = Field(default=1.0, gt=0, description="Max critic gradient norm.")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(
        default="fixed", description="KL-in-reward coefficient: fixed, or adaptive to target_kl."
    )
    kl_coef: float = Field(default=0.001, ge=0, description="(Initial) KL-in-reward coefficient.")
    horizon: int = Field(default=10000, gt=0, description="Adaptive: sequences per full move.")
    target_kl: float = Field(default=0.1, gt=0, description="Adaptive: the KL it steers to.")
