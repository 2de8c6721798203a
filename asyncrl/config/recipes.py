"""The recipes veRL users switch on daily, with veRL's key names and defaults:

- ``actor.policy_loss.loss_mode``: ``vanilla`` (clipped PPO with dual clip, ``actor.
  clip_ratio_c``) or ``gspo`` (sequence-level ratio; see :mod:`learner.losses`);
- ``algorithm.filter_groups.*``: DAPO's dynamic sampling, done at the rollout servers (a
  group whose members all score alike is never pushed, and more prompts are dealt);
- ``reward.overlong_buffer.*`` (veRL: ``reward_model.overlong_buffer.*``): DAPO's soft
  penalty on responses that end in the last ``len`` tokens before the length limit;
- ``actor.fsdp_config.*``: veRL's offload switches.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from asyncrl.config.section import Section

# GSPO's clip range from its paper and veRL's recipe: the sequence ratio is a geometric
# mean, so it moves far less than a token's ratio.
GSPO_CLIP_LOW, GSPO_CLIP_HIGH = 3e-4, 4e-4
# How GSPO's policy term is aggregated whatever actor.loss_agg_mode says (as in veRL, whose
# GSPO loss fixes it); loss_agg_mode still aggregates the KL and entropy terms.
GSPO_AGG = "seq-mean-token-mean"
# Dr. GRPO's aggregation whatever actor.loss_agg_mode says: a sum over tokens divided by
# the response length limit, not by each response's own length (its point).
DR_GRPO_AGG = "seq-mean-token-sum-norm"


class PolicyLossConfig(Section):
    loss_mode: Literal["vanilla", "gspo"] = Field(
        default="vanilla",
        description="vanilla: clipped PPO with dual clip; gspo: GSPO's sequence ratio (clip "
        "range 3e-4/4e-4 unless set; its policy term is always seq-mean-token-mean, as in "
        "veRL, and loss_agg_mode aggregates the KL and entropy terms).",
    )


def gspo_defaults(actor: Any) -> Any:
    """Fill an actor mapping's unset clip range with GSPO's when its
    ``policy_loss.loss_mode`` is ``gspo`` (run before validation, so the resolved config
    every role reads holds the values used)."""
    if not isinstance(actor, dict):
        return actor
    loss = actor.get("policy_loss")
    if not (isinstance(loss, dict) and loss.get("loss_mode") == "gspo"):
        return actor
    out = dict(actor)
    out.setdefault("clip_ratio_low", GSPO_CLIP_LOW)
    out.setdefault("clip_ratio_high", GSPO_CLIP_HIGH)
    return out


class FilterGroupsConfig(Section):
    enable: bool = Field(
        default=False,
        description="Drop groups whose members all score alike (no GRPO signal) at the "
        "rollout server and deal more prompts (DAPO dynamic sampling).",
    )
    metric: str = Field(
        default="acc",
        description="What must vary within a group: acc (the scorer's 'acc', else its "
        "score), score (before overlong shaping), seq_reward / seq_final_reward (after), "
        "or any other key the scorer returns.",
    )
    max_num_gen_batches: int = Field(
        default=0,
        ge=0,
        description="Filtered groups allowed per trained batch, in batches of "
        "data.gen_batch_size (else data.train_batch_size), as veRL counts them; past it, "
        "tasks are dealt unfiltered until the next step (0: no bound).",
    )
    skip_uninformative: bool = Field(
        default=False,
        description="Before dealing a training prompt whose last k groups were all "
        "filtered, pass it over with probability 1 - max(skip_explore**k, "
        "skip_explore_min) (GRESO's pre-rollout filter): less generation thrown away.",
    )
    skip_explore: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Chance a prompt filtered once is still dealt (squared after two...).",
    )
    skip_explore_min: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="The least chance a prompt is dealt, however often it was filtered.",
    )


class OverlongBufferConfig(Section):
    enable: bool = Field(default=False, description="Penalise responses near the length limit.")
    len: int = Field(
        default=0, ge=0, description="Tokens before data.max_response_length the penalty starts."
    )
    penalty_factor: float = Field(
        default=0.0, ge=0, description="Penalty at the limit (linear from 0 over len tokens)."
    )
    log: bool = Field(default=False, description="veRL's flag; the penalty is always a metric.")


class FsdpConfig(Section):
    param_offload: bool = Field(
        default=False,
        description="Keep the sharded parameters, gradients and optimizer state of the actor "
        "(and reference) in CPU memory between uses (FSDP2's CPU offload; CUDA only, no "
        "effect on the CPU).",
    )
    optimizer_offload: bool = Field(
        default=False,
        description="Same as param_offload here: FSDP2 offloads the optimizer state with "
        "the parameters it updates.",
    )

    @property
    def offload(self) -> bool:
        return self.param_offload or self.optimizer_offload
