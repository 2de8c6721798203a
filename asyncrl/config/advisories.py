"""Settings that run but likely not as meant (:func:`config_advisories`): one line each,
naming the fix, which the learner logs as warnings and a launcher shows on its console.
The config is valid (what cannot run is :func:`asyncrl.config.rules.cross_field_problems`'s
business).
"""

from __future__ import annotations

from pydantic import BaseModel

from asyncrl.config.recipes import DR_GRPO_AGG, GSPO_AGG
from asyncrl.config.schema import Config

#: A clip range wider than this is a token-level one: GSPO's sequence ratio (a geometric
#: mean over the response) seldom leaves it.
GSPO_WIDE_CLIP = 0.01


def config_advisories(cfg: Config) -> list[str]:
    """Settings that run but likely not as meant: one line each, which the learner logs as
    warnings (a launcher shows them on its console); the config is valid."""
    out = []
    actor = cfg.actor
    if (
        actor.policy_loss.loss_mode == "gspo"
        and max(actor.clip_ratio_low, actor.clip_ratio_high) > GSPO_WIDE_CLIP
    ):
        out.append(
            f"actor.policy_loss.loss_mode=gspo with actor.clip_ratio_low={actor.clip_ratio_low}"
            f" / clip_ratio_high={actor.clip_ratio_high}: a token-level range, which GSPO's "
            "sequence ratio seldom leaves; GSPO clips at 3e-4 / 4e-4 (used when the config "
            "leaves both unset)"
        )
    # Only a config the user wrote says which keys were given (a resolved config.yaml sets
    # them all): veRL's use_dynamic_bsz is off by default, ours is on.
    given = actor.model_fields_set
    if (
        actor.policy_loss.loss_mode == "gspo"
        and "loss_agg_mode" in given
        and actor.loss_agg_mode != GSPO_AGG
    ):
        out.append(
            f"actor.loss_agg_mode={actor.loss_agg_mode} with actor.policy_loss.loss_mode=gspo "
            f"aggregates the KL and entropy terms only: GSPO's policy term is always {GSPO_AGG}"
            " (as in veRL)"
        )
    if (
        actor.policy_loss.loss_mode == "gspo"
        and "clip_ratio_c" in given
        and actor.clip_ratio_c != type(actor)().clip_ratio_c
    ):
        out.append(
            f"actor.clip_ratio_c={actor.clip_ratio_c} with actor.policy_loss.loss_mode=gspo is "
            "unused: GSPO has no dual clip (as in veRL); it applies to loss_mode=vanilla"
        )
    if (
        cfg.algorithm.adv_estimator == "dr_grpo"
        and "loss_agg_mode" in given
        and actor.loss_agg_mode != DR_GRPO_AGG
    ):
        out.append(
            f"actor.loss_agg_mode={actor.loss_agg_mode} with algorithm.adv_estimator=dr_grpo "
            f"is unused: Dr. GRPO's loss is always {DR_GRPO_AGG}"
        )
    out += _unused_micro_batches(cfg)
    mt = cfg.rollout.multi_turn
    if mt.enable and not mt.tool_config_path:
        out.append(
            "rollout.multi_turn.enable=true with no rollout.multi_turn.tool_config_path: "
            "episodes have no tools (the prompt lists none, and every call is answered "
            '"Error: no tools here"); set it to a tool config (configs/tools/calculator.yaml)'
        )
    crf = cfg.reward.custom_reward_function
    if crf.reward_kwargs and not crf.path:
        out.append(
            f"reward.custom_reward_function.reward_kwargs={crf.reward_kwargs} is unused: "
            "they are given to a custom scorer (as in veRL), and custom_reward_function.path "
            "is unset; set it to the file of the function that takes them"
        )
    if cfg.model.lora_rank and cfg.sync.lora == "merged" and cfg.model.dtype != "float32":
        # The learner adds the adapter's full-precision update to the base weights; merged
        # and rounded to 16 bits, most of a small update rounds away (a review measured 42%
        # of its elements lost after 3 steps at lr 1e-4 in a bf16 simulation).
        out.append(
            f"sync.lora=merged with model.dtype={cfg.model.dtype}: the servers get the merged "
            "weights rounded to 16 bits, where small adapter updates round away and the servers "
            "sample from a policy behind the learner's; sync.lora=adapter sends the adapter "
            "itself"
        )
    if cfg.model.lora_rank and cfg.sync.lora == "adapter" and cfg.rollout.sync_mode == "abort":
        # Pushed adapters are served beside the ones in use: nothing is paused or aborted.
        out.append(
            "rollout.sync_mode=abort with sync.lora=adapter is unused: a request finishes on "
            "the adapter it started with while that one is among the newest kept (no pause, "
            "no abort); set sync.lora=merged to abort requests at a push"
        )
    return out + _batch_advisories(cfg) + _filter_advisories(cfg) + _unused_kl_coef(cfg)


def _written(section: BaseModel) -> set[str]:
    """The keys of ``section`` the user's config gives; none for a resolved config.yaml,
    which gives them all (a section written key by key in full reads the same way)."""
    given = set(section.model_fields_set)
    return set() if given >= set(type(section).model_fields) else given


def _unused_kl_coef(cfg: Config) -> list[str]:
    """``algorithm.kl_ctrl.kl_coef`` given, with no KL penalty on: TinyZero's PPO script
    gives it and no ``use_kl_in_reward`` (its veRL put the KL in the reward whenever
    ``actor.use_kl_loss`` was off); here that key decides, off by default as in veRL."""
    alg = cfg.algorithm
    if (
        "kl_coef" not in _written(alg.kl_ctrl)
        or not alg.kl_ctrl.kl_coef
        or alg.use_kl_in_reward
        or cfg.actor.use_kl_loss
    ):
        return []
    fix = (
        "set algorithm.use_kl_in_reward=true for the KL penalty in the reward (as TinyZero-era "
        "veRL applied it whenever use_kl_loss was false; with any algorithm.adv_estimator), "
        "or set actor.use_kl_loss=true (with actor.kl_loss_coef) for a KL term in the loss"
    )
    return [
        f"algorithm.kl_ctrl.kl_coef={alg.kl_ctrl.kl_coef} has no effect: neither "
        f"algorithm.use_kl_in_reward nor actor.use_kl_loss is on, so no KL penalty is applied; "
        f"{fix}"
    ]


def _filter_advisories(cfg: Config) -> list[str]:
    """DAPO's group filter where it does nothing, or not what it is for."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        if cfg.data.gen_batch_size is not None:
            return [
                f"data.gen_batch_size={cfg.data.gen_batch_size} has no effect with "
                "algorithm.filter_groups.enable off: it is only the unit of "
                "filter_groups.max_num_gen_batches here (prompts are dealt continuously)"
            ]
        return []
    out = []  # every one that applies (the first alone was said)
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        out.append(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward: "
            "veRL's seq_final_reward has the KL penalty in it, but a rollout server filters "
            "before the learner computes the penalty, so the score without it decides here; "
            "metric=seq_reward says so"
        )
    oe = cfg.rollout.openai_endpoint
    # An endpoint's groups have their own size, and are filtered alike.
    endpoint_groups = oe.enable and (oe.group_size or cfg.rollout.n) >= 2
    if cfg.rollout.n < 2 and not endpoint_groups:
        out.append(
            "algorithm.filter_groups.enable with rollout.n=1: a group of one sample is never "
            "uniform, so nothing is filtered; the filter needs rollout.n >= 2"
        )
    if cfg.algorithm.adv_estimator == "gae":
        out.append(
            "algorithm.filter_groups.enable with algorithm.adv_estimator=gae: the filter drops "
            "groups whose samples scored alike, whose GAE advantages are not zero (the critic "
            "never learns their values); it is meant for group-relative estimators (grpo)"
        )
    return out


def _batch_advisories(cfg: Config) -> list[str]:
    """A mini-batch size that leaves a short last mini-batch (veRL splits the same way),
    and critic keys a run without a critic ignores."""
    out = []
    batch = cfg.data.train_batch_size
    minis = [("actor", cfg.actor.ppo_mini_batch_size)]
    if cfg.algorithm.adv_estimator == "gae":
        minis.append(("critic", cfg.critic.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size))
    for role, mini in minis:
        if batch % mini:
            out.append(
                f"{role}.ppo_mini_batch_size={mini} does not divide data.train_batch_size="
                f"{batch}: each step's last mini-batch has {batch % mini} prompts (an "
                "optimizer step on fewer samples)"
            )
    # Keys set away from their defaults (a resolved config.yaml sets every key, unchanged).
    plain = type(cfg.critic)()
    given = sorted(
        k for k in cfg.critic.model_fields_set if getattr(cfg.critic, k) != getattr(plain, k)
    )
    if cfg.algorithm.adv_estimator != "gae" and given:
        out.append(
            f"critic.{', critic.'.join(given)} set, but algorithm.adv_estimator="
            f"{cfg.algorithm.adv_estimator} trains no critic: they are unused; set "
            "algorithm.adv_estimator=gae for PPO with a critic"
        )
    return out


def _unused_micro_batches(cfg: Config) -> list[str]:
    """veRL's micro-batch sizes in sequences, given while ``actor.use_dynamic_bsz`` is at
    this project's default (on; off in veRL): the actor's, the critic's and the two logprob
    passes' inherit it, so each is sized by tokens and its sequence count goes unused."""
    actor = cfg.actor
    if "use_dynamic_bsz" in actor.model_fields_set or not actor.use_dynamic_bsz:
        return []
    tokens = actor.ppo_max_token_len_per_gpu
    passes = [
        ("actor", actor, "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", tokens),
        ("critic", cfg.critic, "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", tokens),
        (
            "rollout",
            cfg.rollout,
            "log_prob_micro_batch_size_per_gpu",
            "log_prob_use_dynamic_bsz",
            tokens,
        ),
        ("ref", cfg.ref, "log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz", tokens),
    ]
    out = []
    for group, section, micro, flag, max_tokens in passes:
        if micro not in section.model_fields_set or (
            group != "actor" and getattr(section, flag) is not None
        ):
            continue
        token_key = micro.replace("micro_batch_size", "max_token_len")
        out.append(
            f"{group}.{micro}={getattr(section, micro)} is unused: actor.use_dynamic_bsz is on "
            f"by default here (off in veRL), so these micro-batches hold up to "
            f"{getattr(section, token_key) or max_tokens} tokens ({group}.{token_key}); "
            f"set {'actor.use_dynamic_bsz' if group == 'actor' else f'{group}.{flag}'}=false "
            "to use the sequence count"
        )
    return out
