"""Config advisories (``asyncrl/config/advisories.py``): settings that run but likely not
as meant are named in one line each; a resolved config.yaml (every key set) stays quiet.
"""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config, write_resolved
from asyncrl.config.advisories import config_advisories

GAE = ["algorithm.adv_estimator=gae"]


def test_gspo_with_a_token_level_clip_range_is_warned_about():
    """The demo config sets clip 0.2 / 0.28: switching GSPO on there keeps them (the config
    says so), and the learner warns; with the range unset, GSPO's own is used."""
    gspo = "actor.policy_loss.loss_mode=gspo"
    lines = config_advisories(load_config("configs/cpu_demo.yaml", [gspo]))
    assert len(lines) == 1 and "clip_ratio_low=0.2 / clip_ratio_high=0.28" in lines[0]
    assert config_advisories(load_config(None, [gspo])) == []
    assert config_advisories(load_config("configs/cpu_demo.yaml")) == []


def test_a_loss_agg_mode_given_with_gspo_is_said_to_leave_its_policy_term_alone():
    """DAPO's scripts set token-mean; with GSPO it aggregates the KL and entropy terms
    only (GSPO's policy term is seq-mean-token-mean, as in veRL), which is said once."""
    gspo = "actor.policy_loss.loss_mode=gspo"
    [line] = config_advisories(load_config(None, [gspo, "actor.loss_agg_mode=token-mean"]))
    assert "KL and entropy terms only" in line and "always seq-mean-token-mean" in line
    assert (
        config_advisories(load_config(None, [gspo, "actor.loss_agg_mode=seq-mean-token-mean"]))
        == []
    )
    assert config_advisories(load_config(None, ["actor.loss_agg_mode=token-mean"])) == []


def test_a_short_last_mini_batch_and_unused_critic_keys_are_warned_about(tmp_path):
    """veRL splits a batch its mini-batch size does not divide (a short last one), so the
    config loads and says so; critic keys under GRPO train nothing and are named. A
    resolved config.yaml (every key set, at its value) stays quiet."""
    [line] = config_advisories(
        load_config("configs/cpu_demo.yaml", ["actor.ppo_mini_batch_size=6"])
    )
    assert "each step's last mini-batch has 4 prompts" in line
    critic = ["critic.optim.lr=3e-5", "critic.ppo_epochs=2"]
    [line] = config_advisories(load_config("configs/cpu_demo.yaml", critic))
    assert "critic.optim, critic.ppo_epochs set" in line and "adv_estimator=gae" in line
    cfg = load_config("configs/cpu_demo.yaml", [*GAE, *critic])
    assert config_advisories(cfg) == []
    assert config_advisories(load_config(str(write_resolved(cfg, tmp_path)))) == []


def test_a_launch_that_would_put_a_server_on_a_learner_gpu_is_refused():
    """The weight push is an NCCL broadcast, which puts no two ranks on one GPU: a launch
    without launch.gpus (every role on GPU 0; it was a warning calling that fine on one
    GPU) or with a server on a learner's GPU is refused, with the mapping to write."""
    from asyncrl.config.machine import gpu_sharing_problem

    cuda = ["trainer.device=cuda", "trainer.nproc=2", "rollout.num_servers=2"]
    problem = gpu_sharing_problem(load_config(None, cuda))
    assert problem is not None and "every role would start on GPU 0" in problem
    assert "launch.gpus={learner: [0, 1], rollout: [[2], [3]]}" in problem
    shared = load_config(None, [*cuda, "launch.gpus={learner: [0, 1], rollout: [[2], [1]]}"])
    assert gpu_sharing_problem(shared) == (
        "launch.gpus.rollout[1]=[1] shares GPU [1] with launch.gpus.learner=[0, 1]: NCCL "
        "cannot push weights between two processes on one GPU; give each role GPUs of its own"
    )
    # A role left out sees every GPU: the learner's ranks take 0, 1, ...; a server GPU 0.
    only_learner = load_config(None, [*cuda, "launch.gpus={learner: [0, 1]}"])
    assert "launch.gpus.rollout[0]=[0] shares GPU [0]" in (gpu_sharing_problem(only_learner) or "")
    only_servers = load_config(None, [*cuda, "launch.gpus={rollout: [[1], [2]]}"])
    assert "launch.gpus.rollout[0]=[1] shares GPU [1]" in (gpu_sharing_problem(only_servers) or "")
    assert gpu_sharing_problem(load_config("configs/qwen2.5-0.5b_countdown.yaml")) is None
    assert gpu_sharing_problem(load_config("configs/gpu_smoke.yaml")) is None
    assert gpu_sharing_problem(load_config(None, [])) is None  # the CPU: gloo, no GPUs
    assert config_advisories(load_config(None, cuda)) == []  # said once, as a refusal
    with pytest.raises(ConfigError, match=r"veRL's trainer.n_gpus_per_node sets it"):
        load_config(
            None,
            ["trainer.device=cuda", "trainer.n_gpus_per_node=2", "launch.gpus={learner: [0]}"],
        )


def test_a_micro_batch_size_that_dynamic_batching_ignores_is_warned_about(tmp_path):
    """veRL sizes micro-batches by sequences unless use_dynamic_bsz is set; here dynamic
    batching is the default, so a veRL config's micro-batch size alone would do nothing."""
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"
    [line] = config_advisories(load_config("configs/cpu_demo.yaml", [micro]))
    assert "ppo_micro_batch_size_per_gpu=4 is unused" in line
    assert "actor.use_dynamic_bsz=false" in line
    for chosen in ("false", "true"):  # either way the user chose
        bsz = f"actor_rollout_ref.actor.use_dynamic_bsz={chosen}"
        assert config_advisories(load_config("configs/cpu_demo.yaml", [micro, bsz])) == []
    # a role reading the launcher's resolved config.yaml (every key set, and a list of
    # those the user wrote) warns as the launcher does
    cfg = load_config("configs/cpu_demo.yaml", [micro, f"trainer.default_local_dir={tmp_path}"])
    assert config_advisories(load_config(str(write_resolved(cfg)))) == config_advisories(cfg)
    # The critic's and the logprob passes' sizes inherit the actor's dynamic batching too
    # (they went unused without a word): each is named with its own switch.
    others = [
        "critic.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    ]
    lines = config_advisories(load_config("configs/cpu_demo_ppo.yaml", others))
    assert [line.split("=")[0] for line in lines] == [
        "critic.ppo_micro_batch_size_per_gpu",
        "rollout.log_prob_micro_batch_size_per_gpu",
        "ref.log_prob_micro_batch_size_per_gpu",
    ]
    assert "set rollout.log_prob_use_dynamic_bsz=false" in lines[1]
    own = [*others, "critic.use_dynamic_bsz=false", "rollout.log_prob_use_dynamic_bsz=false"]
    own.append("ref.log_prob_use_dynamic_bsz=false")
    assert config_advisories(load_config("configs/cpu_demo_ppo.yaml", own)) == []


def test_merged_lora_pushes_in_16_bits_are_warned_about():
    """A review: merged weights rounded to bf16 lose most of a small adapter update, so the
    servers sample from a policy behind the learner's; the adapter itself does not."""
    cuda = ["trainer.device=cuda", "launch.gpus={learner: [0], rollout: [[1], [2]]}"]
    bf16 = [*cuda, "model.dtype=bfloat16", "model.lora_rank=8", "sync.lora=merged"]
    [line] = config_advisories(load_config(None, bf16))
    assert line.startswith("sync.lora=merged with model.dtype=bfloat16") and "adapter" in line
    assert config_advisories(load_config(None, [*bf16[:-1], "sync.lora=adapter"])) == []
    assert config_advisories(load_config(None, ["model.lora_rank=8", "sync.lora=merged"])) == []


def test_the_group_filter_where_it_does_nothing_or_not_its_job_is_warned_about():
    """Found by a review: DAPO's filter with rollout.n=1 (PPO's usual setting) never filters,
    and with GAE it drops groups whose advantages are not zero; both were accepted without a
    word."""
    on = "algorithm.filter_groups.enable=true"
    # Both that apply are said (a review: the first alone was).
    [one, both] = config_advisories(load_config(None, [on, "rollout.n=1", *GAE]))
    assert "rollout.n=1" in one and "nothing is filtered" in one and "group-relative" in both
    # An endpoint's groups have their own size, and are filtered (a review: the line said
    # nothing was filtered).
    endpoint = ["rollout.openai_endpoint.enable=true", "rollout.openai_endpoint.group_size=4"]
    rpp = "algorithm.adv_estimator=reinforce_plus_plus"  # one sample a prompt, no critic
    assert config_advisories(load_config(None, [on, "rollout.n=1", rpp, *endpoint])) == []
    [alone] = config_advisories(load_config(None, [on, "rollout.n=1", rpp]))
    assert "nothing is filtered" in alone
    [gae] = config_advisories(load_config(None, [on, "rollout.n=4", *GAE]))
    assert "adv_estimator=gae" in gae and "group-relative" in gae
    assert config_advisories(load_config(None, [on, "rollout.n=4"])) == []


def test_keys_a_recipe_overrides_are_said_to_be_unused():
    """GSPO has no dual clip (veRL's neither), and Dr. GRPO fixes its aggregation: a
    ``clip_ratio_c`` or ``loss_agg_mode`` given with them loads and is named unused."""
    gspo = "actor.policy_loss.loss_mode=gspo"
    lines = config_advisories(load_config(None, [gspo, "actor.clip_ratio_c=10"]))
    assert any("clip_ratio_c=10.0" in x and "unused" in x for x in lines)
    assert not any("clip_ratio_c" in x for x in config_advisories(load_config(None, [gspo])))
    dr = "algorithm.adv_estimator=dr_grpo"
    [line] = config_advisories(load_config(None, [dr, "actor.loss_agg_mode=token-mean"]))
    assert "always seq-mean-token-sum-norm" in line
    assert config_advisories(load_config(None, [dr])) == []
    assert config_advisories(load_config(None, ["actor.clip_ratio_c=10"])) == []


@pytest.mark.parametrize("group", ["rollout", "ref"])
def test_a_logprob_pass_with_no_size_is_refused_at_load(group):
    """Sized by sequences with no count to give or inherit, the pass made every step
    fail once the servers were up; veRL refuses it at its config check."""
    null = "actor.ppo_micro_batch_size_per_gpu=null"
    off = f"{group}.log_prob_use_dynamic_bsz=false"
    with pytest.raises(ConfigError, match=f"give {group}.log_prob_micro_batch_size_per_gpu"):
        load_config(None, [null, off])
    load_config(None, [null, off, f"{group}.log_prob_micro_batch_size_per_gpu=4"])
    load_config(None, [null])  # dynamic: sized by tokens


def test_multi_turn_without_tools_is_warned_about():
    """veRL's multi-turn switch with no tool config ran episodes whose every call got
    "Error: no tools here", without a word at start."""
    [line] = config_advisories(load_config(None, ["rollout.multi_turn.enable=true"]))
    assert "episodes have no tools" in line and "tool_config_path" in line
    tools = "rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml"
    assert config_advisories(load_config(None, ["rollout.multi_turn.enable=true", tools])) == []


def test_sync_mode_abort_with_pushed_adapters_is_said_to_be_unused():
    lora = ["model.lora_rank=4", "rollout.sync_mode=abort"]
    lines = config_advisories(load_config(None, [*lora, "rollout.inline_engine=false"]))
    assert any("rollout.sync_mode=abort with sync.lora=adapter is unused" in x for x in lines)
    merged = [*lora, "rollout.inline_engine=false", "sync.lora=merged", "model.dtype=float32"]
    assert not any("sync_mode" in x for x in config_advisories(load_config(None, merged)))


def test_the_gpu_line_says_rollout_gpus_come_on_top_and_fits_the_machine():
    """trainer.n_gpus_per_node counts the learner's GPUs alone here: a script written for
    one 8-GPU node was offered launch.gpus ids up to 9 (15 with 8 servers) on that node."""
    from asyncrl.config.machine import gpu_sharing_problem

    node = ["trainer.device=cuda", "trainer.n_gpus_per_node=8", "rollout.num_servers=2"]
    cfg = load_config(None, node)
    line = gpu_sharing_problem(cfg, gpus_here=8) or ""
    assert "rollout GPUs come on top of the learner's here" in line
    assert "10 in all, and this machine has 8: lower trainer.n_gpus_per_node, or " in line
    assert "launch.gpus={" not in line and "[8]" not in line  # no ids the machine lacks
    roomy = gpu_sharing_problem(cfg, gpus_here=16) or ""
    assert "launch.gpus={learner: [0, 1, 2, 3, 4, 5, 6, 7], rollout: [[8], [9]]}" in roomy
    assert "rollout GPUs come on top of the learner's here" in roomy
    # a count unknown (0: no CUDA seen) gives the mapping, as before
    assert "rollout: [[8], [9]]" in (gpu_sharing_problem(cfg, gpus_here=0) or "")


def test_a_kl_coefficient_no_penalty_reads_is_warned_about(tmp_path):
    """TinyZero's PPO script gives algorithm.kl_ctrl.kl_coef=0.001 and no use_kl_in_reward:
    its veRL put the KL in the reward whenever use_kl_loss was off; here the key decides
    (off by default, as in today's veRL), and the coefficient did nothing, silently."""
    tinyzero = [*GAE, "algorithm.kl_ctrl.kl_coef=0.001"]
    [line] = config_advisories(load_config(None, tinyzero))
    assert line.startswith("algorithm.kl_ctrl.kl_coef=0.001 has no effect")
    assert "set algorithm.use_kl_in_reward=true" in line and "TinyZero-era veRL" in line
    [grpo] = config_advisories(load_config(None, ["algorithm.kl_ctrl.kl_coef=0.01"]))
    assert "set actor.use_kl_loss=true" in grpo  # or the KL in the loss
    quiet = [
        [*tinyzero, "algorithm.use_kl_in_reward=true"],
        [*tinyzero, "actor.use_kl_loss=true"],
        [*GAE, "algorithm.kl_ctrl.kl_coef=0.0"],  # DAPO's scripts: off, and said so
        GAE,
    ]
    for overrides in quiet:
        assert config_advisories(load_config(None, overrides)) == [], overrides
    # a role reading the launcher's resolved config.yaml warns as the launcher does
    cfg = load_config(None, [*tinyzero, f"trainer.default_local_dir={tmp_path}"])
    assert config_advisories(load_config(str(write_resolved(cfg)))) == config_advisories(cfg)
    assert config_advisories(cfg)


def test_the_filters_own_keys_where_they_do_nothing_or_differ_from_veRL():
    """data.gen_batch_size is only the filter bound's unit: without the filter it does
    nothing (it was logged so while it had no effect at all). veRL's seq_final_reward has
    the KL in the reward in it; the servers filter before the learner computes the KL."""
    (line,) = config_advisories(load_config(None, ["data.gen_batch_size=48"]))
    assert line.startswith("data.gen_batch_size=48 has no effect with algorithm.filter_groups")
    on = ["algorithm.filter_groups.enable=true", "data.gen_batch_size=48"]
    assert config_advisories(load_config(None, on)) == []
    kl = [*on, "algorithm.use_kl_in_reward=true", "algorithm.filter_groups.metric="]
    (line,) = config_advisories(load_config(None, [*kl[:-1], f"{kl[-1]}seq_final_reward"]))
    assert "a rollout server filters before the learner computes the penalty" in line
    assert config_advisories(load_config(None, [*kl[:-1], f"{kl[-1]}seq_reward"])) == []


def test_a_16_bit_lora_runs_merged_export_says_what_it_lacks():
    """A review: ``final/`` of a bf16 LoRA run stores the merge rounded to bf16 (much of a
    small update lost), while the servers served the base with the adapter beside it."""
    from learner.export import merged_export_note

    cuda = ["trainer.device=cuda", "launch.gpus={learner: [0], rollout: [[1], [2]]}"]
    bf16 = [*cuda, "model.dtype=bfloat16", "model.lora_rank=8"]
    note = merged_export_note(load_config(None, bf16))
    assert note is not None and "final_adapter/" in note and "bfloat16" in note
    assert merged_export_note(load_config(None, [*bf16, "sync.lora=merged"])) is None
    assert merged_export_note(load_config(None, ["model.lora_rank=8"])) is None  # float32
    assert merged_export_note(load_config(None, cuda + ["model.dtype=bfloat16"])) is None
