"""The critic of PPO with GAE (``algorithm.adv_estimator: gae``): a value model under FSDP2
beside the actor, with its own optimizer and schedule. Only the actor is ever pushed to the
rollout servers; the critic lives and is checkpointed on the learner alone.

Off-policy by construction: values are computed here, at train time, on the trajectories
of the batch (never by the rollout servers), so they always come from the critic's latest
weights, whatever policy version sampled the tokens.

One learner step, as :class:`learner.trainer.Trainer` drives it:

- :meth:`Critic.targets` consumes the cleaned global batch and its token rewards
  (:mod:`learner.reward_kl`) and produces
  per-token advantages, returns and the values they came from for *every* sequence, the
  same on every rank (the values of each rank's share are gathered, so GAE's whitening is
  over the whole batch as in veRL); the samples of a split episode run end to end
  (:func:`learner.advantages.gae_advantages`). A collective.
- :meth:`Critic.update` trains on those returns: ``critic.ppo_epochs`` x mini-batches, one
  optimizer step each, the clipped value loss of :mod:`learner.values`. A collective. Its
  epochs and aggregation mode, unset, are the actor's (as veRL's critic config reads them).

The value model: the HF checkpoint at ``critic.model.path`` (default: the actor's) loaded
as a token classifier with one label, i.e. the backbone's last hidden state through a
linear head. A causal-LM checkpoint has no such head: it starts at zero (every value 0,
the same on every rank without drawing random numbers); a saved critic keeps its own.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.config import Config
from learner import fsdp
from learner.advantages import gae_advantages
from learner.collate import MicroBatch, collate, pad_rows
from learner.forward import evaluating
from learner.losses import valid_token_mask
from learner.plan import plan_step
from learner.reductions import AggNorm
from learner.rollouts import Rollout, episode_rows, response_mask
from learner.values import (
    VALUE_STAT_SUMS,
    explained_variance,
    value_loss,
)

log = logging.getLogger(__name__)


@dataclass
class Targets:
    """One step's GAE outputs, per cleaned sequence index, each ``[T_i]`` (global)."""

    advantages: dict[int, torch.Tensor]
    returns: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]


def load_value_model(
    path: str,
    mesh,
    *,
    device: str,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    offload: bool = False,
    config_overrides: dict[str, Any] | None = None,
):
    """The value model of ``path`` (any HF causal LM, or a saved critic) under FSDP2:
    logits ``[B, L, 1]`` are the values. A missing head starts at zero. The attention
    kernel, offload and config overrides are the actor's (:func:`fsdp.load_sharded_model`):
    the critic reads the actor's micro-batch layout (packed rows need the kernel that
    keeps sequences apart without a dense mask)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # values must not be noisy (and ranks must agree)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model, info = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    name, head = value_head(model)
    if any(k.startswith(f"{name}.") for k in info["missing_keys"]):
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
        log.info("critic: fresh value head (zero) on the backbone of %s", path)
    return fsdp.shard_model(
        model, mesh, device=device, gradient_checkpointing=gradient_checkpointing, offload=offload
    )


#: Where transformers' token-classification models keep their output layer: ``score``
#: (Llama, Qwen, Mistral, Gemma), ``classifier`` (GPT-2, GPT-NeoX, Falcon, Bloom, MPT).
HEAD_NAMES = ("score", "classifier")


def value_head(model: torch.nn.Module) -> tuple[str, torch.nn.Linear]:
    """The value head of a token-classification model (``[hidden] -> [1]``), by name."""
    for name in HEAD_NAMES:
        if isinstance(head := getattr(model, name, None), torch.nn.Linear):
            return name, head
    raise ValueError(
        f"critic: {type(model).__name__} has no linear value head named "
        f"{' or '.join(HEAD_NAMES)}; give critic.model.path a model whose "
        "AutoModelForTokenClassification class has one"
    )


class Critic:
    """The value model, its optimizer, schedule and KL-in-reward coefficient (see the
    module docstring). ``packed``/``pad_id``: the actor's micro-batch layout, reused."""

    def __init__(
        self, cfg: Config, mesh, *, model_path: str, total_steps: int | None, packed: bool
    ):
        self.cfg, c = cfg, cfg.critic
        self.device = torch.device(cfg.trainer.device)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        path = c.model.path or model_path
        self.model = load_value_model(
            path,
            mesh,
            device=cfg.trainer.device,
            gradient_checkpointing=c.model.enable_gradient_checkpointing,
            attn_implementation=cfg.model.attn_implementation,
            offload=fsdp.offload_wanted(cfg),
            # The actor's overrides fit the actor's model: a critic of its own path keeps its own
            config_overrides=cfg.model.override_config if path == model_path else None,
        )
        self.optimizer = fsdp.build_optimizer(self.model, c.optim)
        self.scheduler = fsdp.build_scheduler(self.optimizer, c.optim, total_steps)
        # Unset, the actor's (veRL's critic reads them from the actor's config).
        self.epochs = c.ppo_epochs or cfg.actor.ppo_epochs
        self.agg_mode = c.loss_agg_mode or cfg.actor.loss_agg_mode
        self.packed = packed
        self.pad_id = self.model.config.pad_token_id or 0

    # ------------------------------------------------------------------ planning
    def _plan(self, rollouts: Sequence[Rollout]) -> tuple[list[list[list[int]]], list[AggNorm]]:
        """This rank's micro-batches of every critic mini-batch, and their global norms;
        unset critic batch sizes are the actor's."""
        c, a = self.cfg.critic, self.cfg.actor
        dynamic = a.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
        return plan_step(
            rollouts,
            c.ppo_mini_batch_size or a.ppo_mini_batch_size,
            world_size=self.world_size,
            rank=self.rank,
            padded=not self.packed,
            max_seqs=c.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu,
            max_tokens=(c.ppo_max_token_len_per_gpu or a.ppo_max_token_len_per_gpu)
            if dynamic
            else None,
        )

    def _collate(self, rollouts: Sequence[Rollout], micro: list[int]) -> MicroBatch:
        zeros = torch.zeros(len(rollouts))  # collate wants advantages; the critic has none
        return collate(rollouts, zeros, micro, packed=self.packed, pad_id=self.pad_id)

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        """Values ``[B, T]`` of the states that produce each response token (the same
        positions as the actor's logits for that token)."""
        mb = mb.to(self.device)
        with warnings.catch_warnings():
            # FSDP2 warns that the classifier's output is a view (in-place ops on it would
            # skip a hook); the values are only read through a gather, never modified.
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            out = self.model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                attention_mask=mb.attention_mask,
                use_cache=False,
            )
        return out.logits.reshape(-1)[mb.gather_index].float()

    # ------------------------------------------------------------------ targets
    @torch.no_grad()
    def values(self, rollouts: Sequence[Rollout]) -> dict[int, torch.Tensor]:
        """Current values ``[T_i]`` of every sequence (global; a collective)."""
        mbs, _ = self._plan(rollouts)
        local: dict[int, torch.Tensor] = {}
        with evaluating(self.model):  # dropout off: V and the clip's V_old not noisy
            for micro in (m for mini in mbs for m in mini):  # dummies too: FSDP's collectives
                mb = self._collate(rollouts, micro)
                v = self._forward(mb)
                for b, sid in enumerate(mb.seq_ids):
                    local[sid] = v[b, : len(rollouts[sid].response_ids)].cpu()
        return fsdp.gather_sequences(local, self.world_size)

    def targets(
        self, rollouts: Sequence[Rollout], token_rewards: torch.Tensor
    ) -> tuple[Targets, dict[str, float]]:
        """GAE advantages and returns of the cleaned batch (see the module docstring) from
        its ``token_rewards`` ``[B, T]`` (:mod:`learner.reward_kl`: the outcome on the last
        token, less the KL in the reward when it is on). Returns the targets and veRL's
        ``critic/*`` batch metrics."""
        alg = self.cfg.algorithm
        values = self.values(rollouts)
        mask, lengths = response_mask(rollouts)
        width = mask.shape[1]
        v = pad_rows([values[i] for i in range(len(rollouts))], width)
        adv, ret = gae_advantages(
            token_rewards, v, mask, gamma=alg.gamma, lam=alg.lam, episodes=episode_rows(rollouts)
        )
        metrics = _batch_metrics(adv, ret, v, mask)
        rows = range(len(rollouts))
        out = Targets(
            advantages={i: adv[i, : lengths[i]] for i in rows},
            returns={i: ret[i, : lengths[i]] for i in rows},
            values={i: v[i, : lengths[i]] for i in rows},
        )
        return out, metrics

    # ------------------------------------------------------------------ training
    def update(self, rollouts: Sequence[Rollout], targets: Targets) -> dict[str, float]:
        """Train the critic on the batch's returns; ``critic/*`` metrics (every rank the
        same). The schedule steps once per call (one learner step)."""
        mbs, norms = self._plan(rollouts)
        sums = dict.fromkeys(VALUE_STAT_SUMS, 0.0)
        grad_norms: list[float] = []
        updates = 0
        for _ in range(self.epochs):
            for micros, norm in zip(mbs, norms, strict=True):
                gnorm, applied = self._minibatch(rollouts, targets, micros, norm, sums)
                updates += 1
                if applied:
                    grad_norms.append(gnorm)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate these updates used
        self.scheduler.step()
        total = torch.tensor([sums[k] for k in VALUE_STAT_SUMS], dtype=torch.float64)
        if self.world_size > 1:
            total = total.to(self.device)
            dist.all_reduce(total)
        s: dict[str, float] = dict(zip(VALUE_STAT_SUMS, total.tolist(), strict=True))
        tokens = max(s["vf_tokens"], 1.0)
        out = {
            "critic/vf_loss": s["vf_loss"] / max(updates, 1),
            "critic/vf_clipfrac": s["vf_clipped"] / tokens,
            "critic/vpred_mean": s["vpred_sum"] / tokens,
            "critic/lr": lr,
            "critic/skipped_updates": float(updates - len(grad_norms)),
        }
        if grad_norms:  # no applied update, no norm (left out, not 0)
            out["critic/grad_norm"] = sum(grad_norms) / len(grad_norms)
        return out

    def _minibatch(self, rollouts, targets: Targets, micros, norm, sums) -> tuple[float, bool]:
        """Forward/backward each micro-batch, then one optimizer step unless the loss or
        gradient is not finite on some rank (every rank decides the same)."""
        self.optimizer.zero_grad(set_to_none=True)
        finite = True
        for micro in micros:  # gradients reduce-scattered at each backward (see the actor's)
            mb = self._collate(rollouts, micro)
            vpred = self._forward(mb)
            loss, st = value_loss(
                vpred,
                _rows(targets.values, mb.seq_ids, vpred),
                _rows(targets.returns, mb.seq_ids, vpred),
                valid_token_mask(mb.mask, mb.behaviour).to(vpred.device),
                cliprange=self.cfg.critic.cliprange_value,
                agg_mode=self.agg_mode,
                norm_const=float(self.cfg.data.max_response_length),
                norm=norm.rows(mb.seq_ids),
            )
            finite &= bool(torch.isfinite(loss))
            # FSDP averages over ranks; the norms are global: scale back to the sum.
            (loss * self.world_size).backward()
            if mb.seq_ids:
                for k in VALUE_STAT_SUMS:
                    sums[k] += float(st[k])
        gnorm, ok = fsdp.step_if_finite(
            self.model,
            self.optimizer,
            self.cfg.critic.grad_clip,
            finite,
            world_size=self.world_size,
            device=self.device,
        )
        if not ok:
            log.warning("critic: non-finite loss or gradient (norm %s); update skipped", gnorm)
        return gnorm, ok

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """What a checkpoint keeps besides the critic's tensors (JSON-serialisable)."""
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the schedule. (Checkpoints before the KL in the reward moved to the
        trainer also hold its ``kl_coef``, which the trainer reads.)"""
        self.scheduler.load_state_dict(state["scheduler"])


def _rows(per_seq: dict[int, torch.Tensor], seq_ids: list[int], like: torch.Tensor):
    """``[B, T]`` like ``like`` from per-sequence ``[T_i]`` (zeros for a dummy batch)."""
    if not seq_ids:
        return torch.zeros_like(like)
    return pad_rows([per_seq[s] for s in seq_ids], like.shape[1]).to(like.device)


def _batch_metrics(
    adv: torch.Tensor, ret: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """veRL's batch metrics of the critic, all ``[N, T]`` over ``mask``."""
    n = max(int(mask.sum()), 1)
    return {
        "critic/vf_explained_var": explained_variance(ret, values, mask),
        "critic/values/mean": float(values[mask].sum()) / n,
        "critic/returns/mean": float(ret[mask].sum()) / n,
        "critic/advantages/mean": float(adv[mask].sum()) / n,
    }
