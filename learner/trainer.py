"""The learner's training core: one FSDP2 policy, one step per batch.

:class:`Trainer` is what the learner's service loop calls (the loop itself requests
batches, hosts the coordinator and pushes weights):

- :meth:`Trainer.train_step` consumes one *global* batch of :class:`~learner.rollouts.Rollout`
  (the same list on every rank: the loop shares rank 0's batch with
  :func:`learner.broadcast.share_batch`)
  and produces metrics. It waits for nothing but the other
  ranks (FSDP's collectives inside forward/backward, one all-reduce of metrics).
- :meth:`Trainer.full_state_for_push` produces the full weights for the weight-sync module
  (a collective: every rank calls it), gathered by :mod:`learner.policy_weights`, which
  also loads the policy and its KL reference sharded.
- :meth:`Trainer.save` / :meth:`Trainer.load` wrap :mod:`learner.checkpoint`.

One step: clean the batch (bad rollouts counted and dropped); advantages over whole groups
(dropped members included: they were sampled and scored) (both :mod:`learner.rollouts`;
with ``algorithm.use_kl_in_reward`` after the reference pass below, each score less its
KL penalty, :mod:`learner.reward_kl`),
or with ``adv_estimator: gae`` per-token advantages from :class:`learner.critic.Critic`,
which then trains on the batch; this rank's mini- and micro-batches (:mod:`learner.plan`);
proximal logprobs with the step's starting weights (no grad, each row's logits divided by
the temperature it was sampled at);
then ``actor.ppo_epochs`` x mini-batches of ``actor.ppo_mini_batch_size`` groups, each one
optimizer step accumulated over micro-batches, each micro-batch's model inputs built by
:mod:`learner.collate` (a split episode's sequence-level means, GSPO's ratio and the
sequence-level importance weight, are taken over all its samples before the mini-batch's
first backward: :mod:`learner.episode_means`). A mini-batch whose loss or gradient is not finite on any rank is
skipped on all ranks (counted, never applied).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from asyncrl.config import Config
from asyncrl.wire.types import usable_reward
from learner import fsdp, lora
from learner.advantages import OUTCOME_ESTIMATORS, TOKEN_ESTIMATORS
from learner.collate import MicroBatch, collate, pad_rows
from learner.critic import Critic
from learner.episode_means import episode_means, episode_sums, row_means
from learner.forward import evaluating, response_logprobs
from learner.layout import resolve_layout, sliding_window
from learner.losses import LossConfig, policy_loss, summarize_stats
from learner.metrics import StatSum, mean_of, rollout_metrics, zero_variance_groups
from learner.plan import StepPlan, plan_passes
from learner.policy_weights import gathered_state, load_policy, load_reference
from learner.reductions import AggNorm
from learner.reward_kl import RewardKL, token_rewards
from learner.rollouts import (
    DROP_REASONS,
    Rollout,
    baseline_advantages,
    clean_rollouts,
    drop_reason,
    group_indices,
    token_advantages,
)
from learner.shared_prefix import collate_shared

log = logging.getLogger(__name__)


class Trainer:
    """The policy model under FSDP2, its optimizer and schedule (see the module docstring).

    Args:
        cfg: the run config; reads ``model``,
            ``actor``, ``algorithm``, ``data.max_response_length``, ``trainer.device``.
        model_path: overrides ``model.path``.
        total_steps: learner steps for the decay schedules (default
            ``trainer.total_training_steps``).

    Attributes the loop reads or sets: ``step`` (learner steps done), ``policy_version``
    (stored in checkpoints; the loop owns it), ``rank``, ``world_size``.
    """

    def __init__(
        self, cfg: Config, *, model_path: str | None = None, total_steps: int | None = None
    ):
        self.cfg = cfg
        self.device = torch.device(cfg.trainer.device)
        torch.manual_seed(cfg.trainer.seed)
        self.mesh = fsdp.init_distributed(cfg.trainer.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model_path = model_path or cfg.model.path
        self.model = load_policy(cfg, self.mesh, self.model_path)
        self.loss_cfg = LossConfig.from_config(cfg)
        # The frozen reference for the KL penalty: the initial weights, sharded the same way.
        # With LoRA the base never trains, so the policy with its adapters off is the
        # reference (see _reference_logprobs), without a second copy of the base.
        self.wants_ref = (
            self.loss_cfg.kl_coef > 0 or self.loss_cfg.kl_track or cfg.algorithm.use_kl_in_reward
        )
        self.ref_model = (
            load_reference(cfg, self.mesh, self.model_path)
            if self.wants_ref and not cfg.model.lora_rank
            else None
        )
        self.optimizer = fsdp.build_optimizer(self.model, cfg.actor.optim)
        steps = total_steps if total_steps is not None else cfg.trainer.total_training_steps
        self.scheduler = fsdp.build_scheduler(self.optimizer, cfg.actor.optim, steps)
        self.pad_id = self.model.config.pad_token_id or 0
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        self.layout = self._choose_layout()
        self.packed = self.layout == "packed"
        # PPO with GAE: the value model beside the policy (learner.critic).
        self.critic = (
            Critic(
                cfg, self.mesh, model_path=self.model_path, total_steps=steps, packed=self.packed
            )
            if cfg.algorithm.adv_estimator == "gae"
            else None
        )
        self.reward_kl = RewardKL(cfg, self.world_size) if cfg.algorithm.use_kl_in_reward else None
        self.step = 0
        self.policy_version = 0
        log.info(
            "learner rank %d/%d: %s, loss %s",
            self.rank,
            self.world_size,
            self.model_path,
            self.loss_cfg,
        )

    # ------------------------------------------------------------------ forward
    def _forward(self, model, mb: MicroBatch, *, entropy: bool = False, entropy_grad: bool = True):
        return response_logprobs(
            model, mb.to(self.device), entropy=entropy, entropy_grad=entropy_grad
        )

    def _choose_layout(self) -> str:
        """``actor.sequence_layout`` resolved for this model and device (see
        :func:`learner.layout.resolve_layout`)."""
        # In eval mode: with dropout on, the two layouts' forwards drew different masks,
        # and the probe read that as a model refusing the layout.
        with evaluating(self.model):
            layout = resolve_layout(
                self.cfg.actor.sequence_layout,
                getattr(self.model.config, "_attn_implementation", None),
                self.cfg.trainer.device,
                forward=lambda mb: self._forward(self.model, mb)[0],
                window=sliding_window(self.model.config),
            )
        fsdp.reshard(self.model)  # the probe's forwards had no backward
        return layout

    # ------------------------------------------------------------------ planning
    def _plan(self, rollouts: list[Rollout], adv: torch.Tensor, temperature: float) -> StepPlan:
        """This rank's micro-batches of every mini-batch of the cleaned ``rollouts``, whose
        advantages ``adv`` ``[N]`` come from :func:`~learner.rollouts.baseline_advantages`;
        ``temperature`` for rollouts that do not say what they were sampled at."""
        mbs, norms, passes = plan_passes(
            rollouts,
            self.cfg.actor,
            {"proximal": self.cfg.rollout, "ref": self.cfg.ref},
            world_size=self.world_size,
            rank=self.rank,
            padded=not self.packed,
            shared=self.layout == "shared",
        )
        return StepPlan(rollouts, adv, temperature, mbs, norms, pass_micros=passes)

    def _collate(self, plan: StepPlan, seq_ids: list[int]) -> MicroBatch:
        r, adv, pad, temp = plan.rollouts, plan.advantages, self.pad_id, plan.temperature
        if self.layout == "shared":
            return collate_shared(r, adv, seq_ids, pad_id=pad, temperature=temp)
        return collate(r, adv, seq_ids, packed=self.packed, pad_id=pad, temperature=temp)

    @torch.no_grad()
    def _fixed_logprobs(self, model, plan: StepPlan, which: str) -> dict[int, torch.Tensor]:
        """Per local sequence, logprobs ``[T_i]`` under ``model``, in the micro-batches of
        the no-grad pass ``which`` (proximal or ref)."""
        out: dict[int, torch.Tensor] = {}
        with evaluating(model):
            for micro in plan.micros_for(which):
                mb = self._collate(plan, micro)
                logp, _ = self._forward(model, mb)
                for b, sid in enumerate(mb.seq_ids):  # the whole response (mask may have holes)
                    out[sid] = logp[b, : len(plan.rollouts[sid].response_ids)].cpu()
        fsdp.reshard(model)
        return out

    def _reference_logprobs(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        """Per local sequence, logprobs ``[T_i]`` under the KL reference: the separate
        frozen model, or with LoRA the policy with its adapters off."""
        if self.ref_model is not None:
            return self._fixed_logprobs(self.ref_model, plan, "ref")
        with lora.adapters_off(self.model):
            return self._fixed_logprobs(self.model, plan, "ref")

    # ------------------------------------------------------------------ training
    def train_step(self, rollouts: Sequence[Rollout], temperature: float) -> dict[str, float]:
        """Train on one global batch (identical on every rank); returns metrics (the same
        on every rank). ``temperature`` (``rollout.temperature``) stands in for rollouts
        that do not say what they were sampled at; the others use their own."""
        start = time.monotonic()
        kept, dropped = clean_rollouts(rollouts, self.max_len)
        metrics: dict[str, float] = {f"batch/dropped_{k}": float(dropped[k]) for k in DROP_REASONS}
        metrics.update(rollout_metrics(kept, self.policy_version))
        if not kept:
            log.warning("step %d: no trainable rollout in a batch of %d", self.step, len(rollouts))
            if self.critic is not None:  # both schedules count learner steps, trained or not
                _step_unapplied(self.critic.scheduler)
            warming = self.critic is not None and self._warming()
            return self._finish_step(
                metrics, start, updates=0, skipped=0, actor_schedule=not warming
            )
        # Group baselines over every scored member, trainable or not (see baseline_advantages).
        alg = self.cfg.algorithm
        outcome = alg.adv_estimator in OUTCOME_ESTIMATORS
        # With the KL in the reward the scores wait for the reference's logprobs (below).
        kl_scores = outcome and self.reward_kl is not None
        adv = (  # GAE's per-token advantages come from the critic below
            baseline_advantages(
                rollouts, kept, alg.adv_estimator, norm_by_std=alg.norm_adv_by_std_in_grpo
            )
            if outcome and not kl_scores
            else torch.zeros(len(kept))
        )
        plan = self._plan(kept, adv, temperature)
        scored = [r for r in rollouts if usable_reward(float(r.reward))]
        metrics["batch/zero_variance_groups"] = float(
            zero_variance_groups(
                torch.tensor([float(r.reward) for r in scored]), group_indices(scored)
            )
        )
        t0 = time.monotonic()
        # One optimizer step per batch: the proximal policy *is* the current one before the
        # update, so its logprobs come for free from the training forward (l.detach()).
        # (The KL in the reward needs them before any update.)
        single = self.cfg.actor.ppo_epochs == 1 and len(plan.minibatches) == 1
        single &= not alg.use_kl_in_reward
        proximal = None if single else self._fixed_logprobs(self.model, plan, "proximal")
        ref = self._reference_logprobs(plan) if self.wants_ref else None
        metrics["timing/proximal_s"] = time.monotonic() - t0
        rewards = token_rewards(alg.adv_estimator, kept, self.reward_kl, proximal, ref, metrics)
        if kl_scores:  # veRL's apply_kl_penalty, then the estimator on the summed rewards
            plan.advantages = baseline_advantages(
                rollouts,
                kept,
                alg.adv_estimator,
                norm_by_std=alg.norm_adv_by_std_in_grpo,
                token_rewards=rewards,
            )
        if alg.adv_estimator in TOKEN_ESTIMATORS:  # REINFORCE++: per token, no critic
            plan.token_advantages = token_advantages(
                rollouts, kept, alg.adv_estimator, alg.gamma, rewards
            )
        if self.critic is not None and self._critic_step(plan, rewards, metrics):
            return self._finish_step(metrics, start, updates=0, skipped=0, actor_schedule=False)

        t0 = time.monotonic()
        stats, norms, skipped, tokens, fed = StatSum(), [], 0, 0, 0
        fresh = True  # no update applied yet: the current policy is the proximal one
        for _ in range(self.cfg.actor.ppo_epochs):
            for micros, norm in zip(plan.minibatches, plan.norms, strict=True):
                means = self._episode_means(plan, micros, norm, proximal, fresh)
                gnorm, ok, n_tok, n_fed = self._minibatch(
                    plan, micros, norm, proximal, ref, stats, means
                )
                fresh &= not ok
                norms.append(gnorm)
                skipped += not ok
                tokens += n_tok
                fed += n_fed
        metrics["timing/update_s"] = time.monotonic() - t0
        metrics["perf/tokens_per_s"] = tokens / max(metrics["timing/update_s"], 1e-9)
        # Token slots the model computed per real token (1 when packed): padding's cost.
        metrics["batch/pad_ratio"] = fed / max(tokens, 1)
        metrics["learner/packed"] = float(self.packed)
        metrics["learner/shared_prompts"] = float(self.layout == "shared")
        return self._finish_step(
            metrics, start, updates=len(norms), skipped=skipped, stats=stats, norms=norms
        )

    def _critic_step(self, plan: StepPlan, rewards, metrics: dict[str, float]) -> bool:
        """Values, GAE advantages (into ``plan``) and the critic's update; True while
        ``trainer.critic_warmup`` holds the actor back (the critic trains alone). Counted as
        veRL counts it: the actor first trains at step ``critic_warmup`` (steps from 1), so
        ``N`` gives ``N - 1`` steps of the critic alone, and 0 and 1 none."""
        assert self.critic is not None
        t0 = time.monotonic()
        targets, batch_metrics = self.critic.targets(plan.rollouts, rewards)
        plan.token_advantages = targets.advantages
        metrics.update(batch_metrics)
        metrics.update(self.critic.update(plan.rollouts, targets))
        metrics["timing/critic_s"] = time.monotonic() - t0
        return self._warming()

    def _warming(self) -> bool:
        """Whether this step is one of ``trainer.critic_warmup``'s (the actor held back)."""
        return self.step + 1 < self.cfg.trainer.critic_warmup  # self.step: steps done

    def _episode_means(
        self,
        plan: StepPlan,
        micros: list[list[int]],
        norm: AggNorm,
        proximal: dict[int, torch.Tensor] | None,
        fresh: bool,
    ) -> torch.Tensor | None:
        """``[E, 2]`` on the device: the mean ``l - p`` and ``p - b`` of each split episode
        of the mini-batch (this rank's ``micros``) over all its samples, on every rank (see
        :mod:`learner.episode_means`); None when it has no split episode or the loss no
        sequence-level mean. ``fresh``: no update since the proximal logprobs were taken."""
        cfg = self.loss_cfg
        gspo, seq_w = cfg.loss_mode == "gspo", cfg.importance_level == "sequence"
        # While fresh the current policy is the proximal one: every mean of l - p, a row's
        # own or its episode's, is 0, so GSPO alone needs nothing.
        if norm.episodes is None or not (seq_w or (gspo and not fresh)):
            return None
        mine = [s for m in micros for s in m]
        current: dict[int, torch.Tensor] = {}
        if (gspo and not fresh) or proximal is None:  # l (or, on a single update, p)
            # Only the split samples, at the weights the mini-batch trains at (no grad);
            # every rank runs as many forwards (FSDP's collectives): an empty one a dummy.
            subs = [[s for s in m if s in norm.episodes] for m in micros]
            subs = [m for m in subs if m] if self.world_size == 1 else subs
            sub_plan = replace(plan, pass_micros={"episodes": subs})
            current = self._fixed_logprobs(self.model, sub_plan, "episodes")
        p = current if proximal is None else proximal
        lp = current if gspo and not fresh else p
        sums = episode_sums(plan.rollouts, norm.episodes, mine, p, lp)
        sums = sums.to(self.device)
        if self.world_size > 1:  # each rank summed the samples it holds
            dist.all_reduce(sums)
        return episode_means(sums)

    def _micro_loss(self, plan, micro, norm, proximal, ref, means):
        """Loss and stats of one micro-batch (a dummy one when ``micro`` is empty);
        ``means``: the split episodes' (:meth:`_episode_means`)."""
        mb = self._collate(plan, micro)
        # With entropy_coeff 0 the entropy is a metric only: no graph for it.
        metric_only = self.loss_cfg.entropy_coeff == 0
        logp, ent = self._forward(self.model, mb, entropy=True, entropy_grad=not metric_only)
        assert ent is not None  # asked for

        def stored(per_seq: dict[int, torch.Tensor] | None) -> torch.Tensor:
            # Without stored values (single update, or a dummy) the current logprobs stand
            # in: before the update they *are* the proximal policy's.
            if per_seq is None or not mb.seq_ids:
                return logp.detach()
            return pad_rows([per_seq[s] for s in mb.seq_ids], logp.shape[1]).to(logp.device)

        dev = logp.device
        adv = mb.advantages
        if plan.token_advantages is not None and mb.seq_ids:
            adv = pad_rows([plan.token_advantages[s] for s in mb.seq_ids], logp.shape[1])
        loss, stats = policy_loss(
            logp,
            stored(proximal),
            mb.behaviour.to(dev),
            adv.to(dev),
            mb.mask.to(dev),
            self.loss_cfg,
            entropy=ent,
            ref_logprobs=stored(ref),
            norm=norm.rows(mb.seq_ids),
            episodes=None if means is None else row_means(means, norm.episodes, mb.seq_ids),
        )
        return loss, stats, mb

    def _minibatch(self, plan, micros, norm, proximal, ref, stats, means):
        """Forward/backward every micro-batch of one mini-batch, then one optimizer step
        unless the loss or gradient is not finite on some rank. Returns
        ``(grad norm, applied, real tokens, token slots fed to the model)``."""
        self.optimizer.zero_grad(set_to_none=True)
        finite, tokens, fed = True, 0, 0
        # Each micro-batch's gradients are reduce-scattered at its backward (as veRL's do):
        # skipping that until the last one kept every rank's whole gradient unsharded, in
        # float32, through the mini-batch (4 bytes a parameter per GPU, whatever the ranks).
        for micro in micros:
            loss, st, mb = self._micro_loss(plan, micro, norm, proximal, ref, means)
            finite &= bool(torch.isfinite(loss))
            # FSDP averages gradients over ranks; the normalisers are already global, so
            # scale back up to get the gradient of the global mini-batch loss.
            (loss * self.world_size).backward()
            stats.add(st, real=bool(mb.seq_ids))
            tokens += mb.n_tokens
            fed += mb.input_ids.numel() if mb.seq_ids else 0
        gnorm, ok = fsdp.step_if_finite(
            self.model,
            self.optimizer,
            self.cfg.actor.grad_clip,
            finite,
            world_size=self.world_size,
            device=self.device,
        )
        if not ok:
            log.warning(
                "step %d: non-finite loss or gradient (norm %s); update skipped", self.step, gnorm
            )
        return gnorm, ok, tokens, fed

    def _finish_step(
        self, metrics, start, *, updates, skipped, stats=None, norms=(), actor_schedule=True
    ):
        """Step the schedule (not during critic warmup, where the actor has not started),
        count the step, reduce stats across ranks into metrics."""
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        if actor_schedule:
            _step_unapplied(self.scheduler)
        self.step += 1
        metrics["actor/updates"] = float(updates)
        metrics["actor/skipped_updates"] = float(skipped)
        # A step with no applied update has no norm: left out, as metrics with no value
        # are (a 0 read as a vanished gradient on a dashboard).
        if applied := [n for n in norms if math.isfinite(n)]:
            metrics["actor/grad_norm"] = mean_of(applied)
        if stats is not None:
            total = stats.all_reduce(device=self.device)
            metrics.update(summarize_stats(total, self.loss_cfg.importance_mode))
            names = {"loss": "total", "pg_loss": "pg", "kl_loss": "kl", "entropy_loss": "entropy"}
            for key, name in names.items():
                # Each update's terms sum exactly over its micro-batches and ranks.
                metrics[f"loss/{name}"] = total[key] / max(updates, 1)
        metrics["timing/train_s"] = time.monotonic() - start
        metrics["learner/step"] = float(self.step)
        return metrics

    # ------------------------------------------------------------------ outputs
    def compute_logprobs(
        self, rollouts: Sequence[Rollout], temperature: float
    ) -> list[torch.Tensor | None]:
        """Current-policy logprobs ``[T_i]`` of every rollout's response (None for those
        :func:`~learner.rollouts.clean_rollouts` drops), at each rollout's own temperature
        (``temperature`` for those that do not say). A collective on every rank."""
        kept_pos = [i for i, r in enumerate(rollouts) if _trainable(r, self.max_len)]
        kept = [rollouts[i] for i in kept_pos]
        out: list[torch.Tensor | None] = [None] * len(rollouts)
        if not kept:
            return out
        plan = self._plan(kept, torch.zeros(len(kept)), temperature)  # no advantages needed
        local = self._fixed_logprobs(self.model, plan, "proximal")
        parts: list[dict[int, torch.Tensor]] = [local]
        if self.world_size > 1:
            parts = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(parts, local)
        for part in parts:
            for sid, lp in part.items():
                out[kept_pos[sid]] = lp
        return out

    def full_state_for_push(self) -> dict[str, torch.Tensor]:
        """What the rollout servers load, named as in the HF checkpoint and cast to
        ``model.dtype``: the full weights, or with LoRA the adapters alone
        (``sync.lora: adapter``) or merged into the weights. A collective: call it on every
        rank; only rank 0, which pushes, gets them, the others ``{}``."""
        adapter_only = self.cfg.sync.lora == "adapter"
        return gathered_state(
            self.model, self.cfg.model, adapter_only=adapter_only, keep=self.rank == 0
        )

    def export_state(self) -> dict[str, torch.Tensor]:
        """The whole model for the final HF export (with LoRA: merged in float32), cast to
        ``model.dtype``. A collective; only rank 0, which writes it, gets it."""
        return gathered_state(self.model, self.cfg.model, adapter_only=False, keep=self.rank == 0)

    def save(self, run_dir, extra: dict | None = None):
        """Checkpoint into ``<run_dir>/checkpoints/step_<step>/`` (every rank calls it)."""
        from learner.checkpoint import save_checkpoint

        return save_checkpoint(
            run_dir,
            self.model,
            self.optimizer,
            self.scheduler,
            step=self.step,
            policy_version=self.policy_version,
            extra=self.reward_kl.saved(extra) if self.reward_kl else extra,
            critic=self.critic,
            keep=self.cfg.trainer.max_actor_ckpt_to_keep,
        )

    def load(self, path) -> dict:
        """Restore a checkpoint directory; sets ``step`` and ``policy_version``; returns the
        ``extra`` dict saved with it."""
        from learner.checkpoint import load_checkpoint

        meta = load_checkpoint(path, self.model, self.optimizer, self.scheduler, critic=self.critic)
        self.step, self.policy_version = meta.step, meta.policy_version
        parts = [(self.optimizer, self.scheduler, self.cfg.actor.optim, "actor.optim")]
        if self.critic is not None:
            c = self.critic
            parts.append((c.optimizer, c.scheduler, self.cfg.critic.optim, "critic.optim"))
        # Settings the checkpoint kept are compared by the loop's changed-settings line:
        # said there, not twice.
        said = set(meta.extra.get("settings") or {})
        for optimizer, scheduler, optim_cfg, name in parts:
            for change in fsdp.reapply_optim_config(optimizer, scheduler, optim_cfg, name):
                if self.rank == 0 and change.split("=", 1)[0] not in said:
                    log.warning("resumed with %s: training on with it", change)
        if self.reward_kl is not None:
            said = self.reward_kl.restore(meta.extra)
            if said is not None and self.rank == 0:
                log.info("%s", said)
        return meta.extra


def _trainable(r: Rollout, max_len: int | None) -> bool:
    return drop_reason(r, max_len) is None


def _step_unapplied(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Step a learning-rate schedule, whose optimizer may not have stepped: after a skipped
    update torch warns that it has not; the schedule counts learner steps, skipped or not,
    so that warning does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()
