"""``trainer.health.*``: the thresholds of the learner's health alarms (:mod:`learner.health`).

The importance-weight levels are veRL's documented ones for its rollout-correction
metrics; the others are far outside what a healthy run shows, so that an alarm means
something is wrong rather than noise."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncrl.config.section import Section


class HealthConfig(Section):
    enable: bool = Field(default=True, description="Check every learner step.")
    action: Literal["warn", "stop"] = Field(
        default="warn",
        description="warn: log and count (health/<rule>); stop: also end the run, with a "
        "checkpoint, at the first alarm (the launcher does not restart it).",
    )
    patience: int = Field(
        default=3,
        gt=0,
        description="Steps in a row a threshold must be crossed before it alarms (one "
        "step's excursion is noise); non-finite values alarm at once.",
    )
    w_mean_range: tuple[float, float] = Field(
        default=(0.5, 2.0), description="Mean importance weight (behaviour to learner) range."
    )
    min_ess: float = Field(
        default=0.3, ge=0, le=1, description="Normalised effective sample size of the weights."
    )

    @field_validator("w_mean_range")
    @classmethod
    def _low_then_high(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[0] > v[1]:  # reversed, every step is outside it: an alarm at 1.0 too
            raise ValueError(f"[{v[0]:g}, {v[1]:g}] is reversed; give it as [low, high]")
        return v

    max_chi2: float = Field(default=1.0, ge=0, description="chi^2 of the weights, E[w^2] - 1.")
    max_truncated_frac: float = Field(
        default=0.1, ge=0, le=1, description="Share of weights above the TIS cap."
    )
    max_mismatch_kl: float = Field(
        default=0.1, ge=0, description="|KL(behaviour || learner)| per token."
    )
    max_ppo_kl: float = Field(
        default=0.1, ge=0, description="Approximate KL of one step's updates."
    )
    entropy_collapse_frac: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Entropy below this share of its value 10 steps before (a collapse; a "
        "slow fall over a run is learning).",
    )
    grad_norm_spike: float = Field(
        default=10.0, gt=1, description="Grad norm above this many times its recent median."
    )
    max_probe_diff: float = Field(
        default=0.1,
        ge=0,
        description="Post-sync probe: mean |learner - server| logprob per token on fixed "
        "tokens after a push (a server off by more holds other weights; alarms at once).",
    )
    probe: bool = Field(default=True, description="Score the post-sync probe at every push.")
    nonfinite: bool = Field(
        default=True, description="Alarm on skipped non-finite updates or dropped logprobs."
    )
