"""The micro-batches of the learner's no-grad logprob passes, under veRL's names.

Before an update the learner may need logprobs it does not train through: the proximal
policy's (``rollout.log_prob_*``, veRL's old-logprob recompute; needed with several
mini-batches or epochs) and the reference model's (``ref.log_prob_*``, for a KL term).
With no gradients kept, such a pass fits bigger micro-batches than training does; unset,
each falls back to the training micro-batches (``actor.ppo_*``), as veRL's interpolations do.
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.section import Section


class LogProbPass(Section):
    """veRL's ``log_prob_*`` keys of one no-grad pass."""

    log_prob_micro_batch_size_per_gpu: int | None = Field(
        default=None,
        gt=0,
        description="Sequences per micro-batch of this no-grad logprob pass, when "
        "log_prob_use_dynamic_bsz is off (default: actor.ppo_micro_batch_size_per_gpu).",
    )
    log_prob_use_dynamic_bsz: bool | None = Field(
        default=None,
        description="Size this pass's micro-batches by tokens (default: actor.use_dynamic_bsz).",
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        default=None,
        gt=0,
        description="Tokens per micro-batch of this pass with dynamic batch size (default: "
        "actor.ppo_max_token_len_per_gpu).",
    )

    def budget(
        self, max_seqs: int | None, dynamic: bool, max_tokens: int
    ) -> tuple[int | None, int | None]:
        """``(max_seqs, max_tokens)`` of this pass given the training micro-batch's
        (``max_tokens`` None: sized by sequences)."""
        use_dynamic = (
            dynamic if self.log_prob_use_dynamic_bsz is None else self.log_prob_use_dynamic_bsz
        )
        if use_dynamic:
            return None, self.log_prob_max_token_len_per_gpu or max_tokens
        return self.log_prob_micro_batch_size_per_gpu or max_seqs, None


class RefConfig(LogProbPass):
    """veRL's ``actor_rollout_ref.ref.*``: the reference model's logprob pass (the model
    itself is the actor's starting weights)."""
