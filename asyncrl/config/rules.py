"""Cross-field rules: checked after the schema, each failure names the fix.

Pure function of a validated :class:`Config`; returns every problem at once so a user fixes
a config in one pass instead of one error per launch.
"""

from __future__ import annotations

from asyncrl.config.placement_rules import placement_problems
from asyncrl.config.policy import GROUP_ESTIMATORS
from asyncrl.config.schema import Config

# The training temperatures vLLM samples at as asked (vllm.sampling_params: _MAX_TEMP is the
# floor it raises lower values to; _verify_args refuses values above 2).
MIN_TRAIN_TEMPERATURE = 0.01
MAX_TRAIN_TEMPERATURE = 2.0


def cross_field_problems(cfg: Config) -> list[str]:
    """Return one line per broken rule (empty when the config is consistent)."""
    return [
        *_sampling_problems(cfg),
        *_group_problems(cfg),
        *_overlong_problems(cfg),
        *_batch_problems(cfg),
        *_control_problems(cfg),
        *_critic_problems(cfg),
        *_reward_kl_problems(cfg),
        *_lora_problems(cfg),
        *placement_problems(cfg),
    ]


def _sampling_problems(cfg: Config) -> list[str]:
    """How training and validation requests sample: what vLLM does with them must be what the
    learner recomputes."""
    problems: list[str] = []
    ro = cfg.rollout
    # The learner recomputes logprobs of the full distribution after temperature; a
    # truncated sampling distribution would bias every importance weight.
    if ro.top_p < 1.0:
        problems.append(
            f"rollout.top_p={ro.top_p}: training rollouts must sample the full distribution "
            "(the learner's logprobs would not match the behaviour policy); set "
            "rollout.top_p=1 and use rollout.val_kwargs.top_p for validation sampling"
        )
    if ro.top_k not in (-1, 0):  # both mean off to vLLM
        problems.append(
            f"rollout.top_k={ro.top_k}: training rollouts must sample the full distribution; "
            "set rollout.top_k=-1 and use rollout.val_kwargs.top_k for validation sampling"
        )
    # vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01 with only a log line:
    # the run would not sample at the temperature it names, and logprobs recomputed at the
    # configured one would not match the behaviour policy. Above 2 vLLM refuses the request.
    if ro.temperature < MIN_TRAIN_TEMPERATURE:
        problems.append(
            f"rollout.temperature={ro.temperature}: vLLM samples at no less than "
            f"{MIN_TRAIN_TEMPERATURE} (it raises lower values silently), so logprobs "
            f"recomputed at this temperature would not match the behaviour policy; set "
            f"rollout.temperature>={MIN_TRAIN_TEMPERATURE}"
        )
    elif ro.temperature > MAX_TRAIN_TEMPERATURE:
        problems.append(
            f"rollout.temperature={ro.temperature}: vLLM refuses temperatures above "
            f"{MAX_TRAIN_TEMPERATURE:g}, so every training request would fail; set "
            f"rollout.temperature<={MAX_TRAIN_TEMPERATURE:g}"
        )
    if ro.val_kwargs.temperature > MAX_TRAIN_TEMPERATURE:
        problems.append(
            f"rollout.val_kwargs.temperature={ro.val_kwargs.temperature}: vLLM refuses "
            f"temperatures above {MAX_TRAIN_TEMPERATURE:g}, so every validation request would "
            f"fail; set it to 0 (greedy) or at most {MAX_TRAIN_TEMPERATURE:g}"
        )
    if ro.inline_engine is True and ro.sync_mode != "keep":
        problems.append(
            f"rollout.inline_engine=true with rollout.sync_mode={ro.sync_mode}: the inline "
            "engine keeps requests in flight at a push; set rollout.sync_mode=keep or "
            "rollout.inline_engine=false"
        )
    return problems


def _group_problems(cfg: Config) -> list[str]:
    """Groups of samples of one prompt (or one endpoint group): what makes their advantages
    and the groups themselves possible."""
    problems: list[str] = []
    ro, grouped = cfg.rollout, cfg.algorithm.adv_estimator in GROUP_ESTIMATORS
    if grouped and ro.n < 2:
        problems.append(
            f"rollout.n={ro.n}: {cfg.algorithm.adv_estimator} compares samples of the same "
            "prompt, and a group of one has nothing to compare with (veRL would train on its "
            "raw score as its advantage); set rollout.n>=2 (or algorithm.adv_estimator=gae)"
        )
    size = ro.openai_endpoint.group_size
    if ro.openai_endpoint.enable and grouped and size is not None and size < 2:
        problems.append(
            f"rollout.openai_endpoint.group_size={size}: {cfg.algorithm.adv_estimator} "
            "compares the sessions of a group, so every endpoint group would train with "
            "advantage 0; set group_size>=2 (or leave it unset for rollout.n)"
        )
    reward_range = ro.openai_endpoint.reward_range
    if reward_range is not None and not reward_range[0] <= reward_range[1]:
        problems.append(
            f"rollout.openai_endpoint.reward_range={list(reward_range)}: its low end is above "
            "its high end; write it as [low, high]"
        )
    validating = cfg.trainer.val_before_train or cfg.trainer.test_freq > 0
    if ro.openai_endpoint.enable and not ro.openai_endpoint.take_tasks and validating:
        # Validation rounds are dataset tasks: with no server taking tasks, none would end.
        problems.append(
            "rollout.openai_endpoint.take_tasks=false: no rollout server runs the dataset's "
            "validation tasks, so a validation round would never end; set "
            "trainer.val_before_train=false trainer.test_freq=-1 (or take_tasks=true)"
        )
    fg = cfg.algorithm.filter_groups
    if fg.skip_uninformative and not fg.enable:
        problems.append(
            "algorithm.filter_groups.skip_uninformative=true skips prompts the group filter "
            "dropped, but the filter is off; set algorithm.filter_groups.enable=true (or "
            "skip_uninformative=false)"
        )
    if ro.max_inflight < ro.n:
        problems.append(
            f"rollout.max_inflight={ro.max_inflight} is below rollout.n={ro.n}: a group could "
            "never run at once; raise rollout.max_inflight"
        )
    return problems


def _batch_problems(cfg: Config) -> list[str]:
    """Batches, their mini- and micro-batches, and the buffer that holds them."""
    problems: list[str] = []
    actor, data = cfg.actor, cfg.data
    if actor.ppo_mini_batch_size > data.train_batch_size:  # veRL's own check
        problems.append(
            f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} exceeds "
            f"data.train_batch_size={data.train_batch_size} (both count prompts); lower it"
        )
    if cfg.buffer.max_reuse > 1 and cfg.buffer.policy == "fifo":
        problems.append(
            f"buffer.max_reuse={cfg.buffer.max_reuse} needs buffer.policy=uniform "
            "(fifo uses each group once)"
        )
    needed = capacity_needed(cfg)
    if cfg.buffer.capacity_groups < needed:
        if cfg.trainer.save_freq > 0:
            held = "the unacknowledged batches between checkpoints"
            fix = "(save_freq + (max_policy_lag + 1) * sync_every)) or lower trainer.save_freq"
        else:
            held = "the batch in training and the groups admitted meanwhile"
            fix = "(1 + (max_policy_lag + 1) * sync_every))"
        problems.append(
            f"buffer.capacity_groups={cfg.buffer.capacity_groups} cannot hold {held}; "
            f"raise it to >= {needed} (train_batch_size * {fix}"
        )
    if actor.ppo_micro_batch_size_per_gpu is None and not actor.use_dynamic_bsz:
        problems.append(
            "actor.ppo_micro_batch_size_per_gpu is null and actor.use_dynamic_bsz is off: "
            "give one (sequences per micro-batch, or tokens with use_dynamic_bsz=true)"
        )
    else:
        problems += _logprob_pass_problems(cfg)
    return problems


def _control_problems(cfg: Config) -> list[str]:
    """The admission window, the coordinator's servers and a resume."""
    problems: list[str] = []
    ro = cfg.rollout
    st = cfg.staleness
    if st.min_policy_lag > st.max_policy_lag:
        problems.append(
            f"staleness.min_policy_lag={st.min_policy_lag} is above staleness.max_policy_lag="
            f"{st.max_policy_lag}: the adaptive controller's range is [min, max]"
        )
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        problems.append(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>"
        )
    if cfg.control.min_servers_to_start > ro.num_servers:
        problems.append(
            f"control.min_servers_to_start={cfg.control.min_servers_to_start} exceeds "
            f"rollout.num_servers={ro.num_servers}: no task would ever be dealt; lower it to "
            f"<= {ro.num_servers}"
        )
    if cfg.control.dead_after_s <= cfg.control.heartbeat_s:
        problems.append(
            f"control.dead_after_s={cfg.control.dead_after_s} must exceed "
            f"control.heartbeat_s={cfg.control.heartbeat_s}, or live servers are declared dead"
        )
    return problems


def _logprob_pass_problems(cfg: Config) -> list[str]:
    """A logprob pass (the proximal policy's, the reference's) sized by sequences, with no
    count of its own and none to inherit: the learner plans every pass at every step, so
    each step would fail once the servers are up (veRL refuses it at its config check)."""
    actor, out = cfg.actor, []
    for group, lp in (("rollout", cfg.rollout), ("ref", cfg.ref)):
        seqs, tokens = lp.budget(
            actor.ppo_micro_batch_size_per_gpu,
            actor.use_dynamic_bsz,
            actor.ppo_max_token_len_per_gpu,
        )
        if seqs is None and tokens is None:
            out.append(
                f"{group}.log_prob_use_dynamic_bsz=false with no "
                f"{group}.log_prob_micro_batch_size_per_gpu (and actor.ppo_micro_batch_size_"
                f"per_gpu null): give {group}.log_prob_micro_batch_size_per_gpu, or set "
                f"{group}.log_prob_use_dynamic_bsz=true"
            )
    return out


def capacity_needed(cfg: Config) -> int:
    """The fewest groups ``buffer.capacity_groups`` may hold.

    Released batches stay until a checkpoint acknowledges them (docs/DESIGN.md section 4), beside
    the (max_policy_lag + 1) * sync_every batches admission lets the servers produce
    meanwhile (a version is sync_every steps: a smaller buffer fills with training groups at
    the end of a run, and the final validation groups behind them are never read). With
    save_freq <= 0 (no intermediate checkpoint) the learner acknowledges each batch once
    trained: one batch is held, and a buffer smaller than that never releases one."""
    window = (cfg.staleness.max_policy_lag + 1) * cfg.staleness.sync_every
    return cfg.data.train_batch_size * (max(cfg.trainer.save_freq, 1) + window)


def _overlong_problems(cfg: Config) -> list[str]:
    """DAPO's overlong penalty falls over the last ``len`` tokens before the limit: a buffer
    of 0 or no factor penalises nothing (veRL divides by the 0), and one longer than the
    limit penalises every response (veRL asserts against it)."""
    ob, limit = cfg.reward.overlong_buffer, cfg.data.max_response_length
    if not ob.enable:
        return []
    problems = []
    if not 0 < ob.len <= limit:
        problems.append(
            f"reward.overlong_buffer.len={ob.len} with data.max_response_length={limit}: the "
            "penalty falls over the last len tokens before the limit; set it between 1 and "
            f"{limit} (or reward.overlong_buffer.enable=false)"
        )
    if ob.penalty_factor <= 0:
        problems.append(
            "reward.overlong_buffer.penalty_factor=0 penalises nothing; set it above 0 (DAPO "
            "uses 1.0) or reward.overlong_buffer.enable=false"
        )
    return problems


def _lora_problems(cfg: Config) -> list[str]:
    """LoRA keys: targets are ``all-linear`` or a list of layer names."""
    m = cfg.model
    if isinstance(m.target_modules, str) and m.target_modules != "all-linear":
        # peft reads a string as a regex; proposing it in a list would match nothing
        pattern = any(c in m.target_modules for c in "*[]()|^$\\?+")
        example = "[q_proj,v_proj]" if pattern else f"[{m.target_modules}]"
        return [
            f"model.target_modules={m.target_modules!r}: use all-linear or a list of layer "
            f"names, e.g. {example}"
            + (" (a regex, as peft reads a string, is not read here)" if pattern else "")
        ]
    if isinstance(m.target_modules, list) and not m.target_modules:
        return ["model.target_modules is an empty list: name layers or use all-linear"]
    if m.lora_rank > 512 and cfg.sync.lora == "adapter":  # vLLM 0.32's largest LoRA rank
        return [
            f"model.lora_rank={m.lora_rank} is above the largest rank vLLM serves (512): "
            "lower it, or push merged weights (sync.lora=merged)"
        ]
    return []


def _critic_problems(cfg: Config) -> list[str]:
    """PPO with a critic: its keys only mean something with ``adv_estimator: gae``."""
    alg, out = cfg.algorithm, []
    warmup, total = cfg.trainer.critic_warmup, cfg.trainer.total_training_steps
    if alg.adv_estimator != "gae":
        if warmup > 0:
            out.append(
                f"trainer.critic_warmup={warmup} needs a critic, which only "
                "algorithm.adv_estimator=gae has; set trainer.critic_warmup=0"
            )
        return out
    mini = cfg.critic.ppo_mini_batch_size
    if mini is not None and mini > cfg.data.train_batch_size:
        out.append(
            f"critic.ppo_mini_batch_size={mini} exceeds "
            f"data.train_batch_size={cfg.data.train_batch_size} (both count prompts); lower it"
        )
    c, a = cfg.critic, cfg.actor
    dynamic = a.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
    if not dynamic and (c.ppo_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu) is None:
        out.append(
            "critic.ppo_micro_batch_size_per_gpu (and the actor's) is null with dynamic batch "
            "size off: give critic.ppo_micro_batch_size_per_gpu or critic.use_dynamic_bsz=true"
        )
    if total is not None and warmup > total:  # the actor first trains at step critic_warmup
        out.append(
            f"trainer.critic_warmup={warmup} is past trainer.total_training_steps={total}: "
            "the actor would never train; lower trainer.critic_warmup"
        )
    return out


def _reward_kl_problems(cfg: Config) -> list[str]:
    """``algorithm.use_kl_in_reward``: a coefficient. Every estimator takes the penalty, as in
    veRL (the group estimators through each response's summed token rewards)."""
    alg, out = cfg.algorithm, []
    if not alg.use_kl_in_reward:
        return out
    if alg.kl_ctrl.kl_coef == 0:
        out.append(
            "algorithm.use_kl_in_reward=true with algorithm.kl_ctrl.kl_coef=0 penalises "
            "nothing; set algorithm.kl_ctrl.kl_coef>0 or algorithm.use_kl_in_reward=false"
        )
    return out
