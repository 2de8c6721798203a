"""A veRL user's command line as written: the overrides of veRL's GRPO example
(``examples/grpo_trainer/run_qwen2-7b.sh``, paths and sizes swapped for the demo's) load,
every key takes effect or is said to have none, and the demo runs with them."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest

from asyncrl.config import ConfigError, load_config
from rollout_servers.groups import PromptTooLong, fit_prompt

# run_qwen2-7b.sh's 36 overrides, in its order; model, data, sizes and GPU counts swapped
# for the CPU demo's (the shell strips the quotes of 'error' and ['console','wandb']).
VERL_GRPO = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=DATA/train.parquet",
    "data.val_files=DATA/val.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=32",
    "data.max_response_length=4",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=MODEL",
    "actor_rollout_ref.actor.optim.lr=6e-4",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.critic_warmup=0",
    "trainer.logger=[console,jsonl]",
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]


def _verl_grpo(model: str = "MODEL", data: str = "DATA") -> list[str]:
    return [o.replace("MODEL", model).replace("DATA", data) for o in VERL_GRPO]


def test_verl_grpo_example_loads_and_says_what_has_no_effect(caplog, tmp_path):
    (tmp_path / "DATA").mkdir()
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        cfg = load_config("configs/cpu_demo.yaml", _verl_grpo())
    notes = [r.getMessage() for r in caplog.records]
    assert cfg.data.filter_overlong_prompts and cfg.data.truncation == "error"
    assert cfg.actor.sequence_layout == "auto"  # use_remove_padding=True
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "k3"
    assert cfg.trainer.project_name == "verl_grpo_example_gsm8k"
    assert cfg.rollout.log_prob_micro_batch_size_per_gpu == 40  # the proximal pass
    assert cfg.ref.log_prob_micro_batch_size_per_gpu == 40
    assert cfg.trainer.nproc == 1 and cfg.launch.ray.learner_nodes == 1
    (line,) = [n for n in notes if "ref.fsdp_config.param_offload=" in n]
    assert "has no effect here: " in line, line
    for key, target in (
        ("trainer.n_gpus_per_node", "trainer.nproc"),
        ("trainer.nnodes", "launch.ray.learner_nodes"),
    ):
        (line,) = [n for n in notes if f"veRL's {key}=" in n]
        assert target in line, line  # mapped, or given in the demo's YAML too (ours wins)
    assert any("rollout.name='vllm' is accepted" in n for n in notes), notes
    assert any("use_remove_padding=True -> actor.sequence_layout" in n for n in notes), notes


# examples/ppo_trainer/run_deepseek7b_llm.sh (PPO with a critic), sizes swapped the same way.
VERL_PPO = [
    "algorithm.adv_estimator=gae",
    "data.train_files=DATA/train.parquet",
    "data.val_files=DATA/val.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=32",
    "data.max_response_length=4",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=MODEL",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "critic.optim.lr=1e-5",
    "critic.model.use_remove_padding=False",
    "critic.model.path=MODEL",
    "critic.model.enable_gradient_checkpointing=True",
    "critic.ppo_micro_batch_size_per_gpu=32",
    "critic.model.fsdp_config.param_offload=False",
    "critic.model.fsdp_config.optimizer_offload=False",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=['console']",
    "trainer.project_name='verl_example_gsm8k'",
    "trainer.experiment_name='deepseek_llm_7b_function_rm'",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.total_training_steps=2",
    "trainer.use_legacy_worker_impl=False",
    "trainer.total_epochs=15",
]

# recipe/dapo/test_dapo_7b.sh with its shell variables expanded, sizes swapped (its 512
# prompts per batch, 3x generation batch, 16 samples, 2k+2k tokens and 4 nodes).
VERL_DAPO = [
    "data.train_files=DATA/train.parquet",
    "data.val_files=DATA/val.parquet",
    "data.prompt_key=prompt",
    "data.truncation='left'",
    "data.max_prompt_length=32",
    "data.max_response_length=4",
    "data.gen_batch_size=48",
    "data.train_batch_size=16",
    "data.truncation='left'",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "algorithm.adv_estimator=grpo",
    "algorithm.kl_ctrl.kl_coef=0.0",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=36",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=36",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=36",
    "actor_rollout_ref.model.path=MODEL",
    "+actor_rollout_ref.model.override_config.attention_dropout=0.",
    "+actor_rollout_ref.model.override_config.embd_pdrop=0.",
    "+actor_rollout_ref.model.override_config.resid_pdrop=0.",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
    "actor_rollout_ref.actor.optim.weight_decay=0.1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size=null",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.grad_clip=1.0",
    "actor_rollout_ref.actor.use_token_level_loss=True",
    "actor_rollout_ref.actor.use_token_level_loss=True",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size=null",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.max_num_batched_tokens=36",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.rollout.val_kwargs.top_p=1.0",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size=null",
    "actor_rollout_ref.ref.fsdp_config.param_offload=False",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
    "reward_model.reward_manager=dapo",
    "custom_reward_function.overlong_buffer.enable=True",
    "custom_reward_function.overlong_buffer.len=2",
    "custom_reward_function.overlong_buffer.penalty_factor=1.0",
    "trainer.logger=['console','wandb']",
    "trainer.project_name=DAPO",
    "trainer.experiment_name=DAPO-Qwen2.5-7B-Math-Test",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "+trainer.val_before_train=True",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
    "trainer.total_epochs=1",
    "trainer.default_local_dir=CKPTS",
    "trainer.resume_mode=disable",
]


def test_verl_ppo_and_dapo_examples_load(tmp_path):
    ppo = load_config("configs/cpu_demo.yaml", [o.replace("MODEL", "m") for o in VERL_PPO])
    assert ppo.algorithm.adv_estimator == "gae" and ppo.critic.model.path == "m"
    assert ppo.critic.ppo_micro_batch_size_per_gpu == 32
    assert ppo.rollout.log_prob_micro_batch_size_per_gpu == 32
    assert ppo.trainer.project_name == "verl_example_gsm8k"  # the shell's quotes, kept
    dapo = load_config("configs/cpu_demo.yaml", [o.replace("MODEL", "m") for o in VERL_DAPO])
    assert dapo.algorithm.filter_groups.enable and dapo.reward.overlong_buffer.len == 2
    assert dapo.model.override_config == {
        "attention_dropout": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
    }
    assert dapo.actor.loss_agg_mode == "token-mean" and dapo.actor.optim.lr_warmup_steps == 10
    # DAPO's ppo_micro_batch_size=null is veRL's unset: it leaves ours as it was
    assert "ppo_micro_batch_size_per_gpu" not in dapo.actor.model_fields_set
    assert dapo.actor.use_dynamic_bsz
    assert dapo.ref.log_prob_max_token_len_per_gpu == 36
    assert dapo.rollout.val_kwargs.temperature == 1.0 and dapo.trainer.resume_mode == "disable"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("actor_rollout_ref.rollout.name=sglang", "the rollout servers run vLLM only"),
        ("actor_rollout_ref.model.exclude_modules=[o_proj]", "excluding layers is not built"),
        ("critic.model.lora_rank=8", "the critic has no LoRA"),
        ("reward_model.reward_kwargs.alpha=2", "as custom_reward_function.reward_kwargs"),
    ],
)
def test_what_would_change_results_silently_is_refused(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, [override])


def test_hydra_grammar_add_force_and_delete(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 4\n  temperature: 0.7\n")
    cfg = load_config(path, ["~rollout.temperature", "++rollout.n=6", "+data.seed=3"])
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.n == 6 and cfg.data.seed == 3
    quoted = load_config(None, ["data.truncation='error'", 'trainer.logger=["console","jsonl"]'])
    assert quoted.data.truncation == "error" and quoted.trainer.logger == ["console", "jsonl"]
    lora = tmp_path / "lora.yaml"
    lora.write_text("model:\n  lora_rank: 8\n")
    assert load_config(lora).model.lora_rank == 8
    # veRL's spelling on the command line turns the file's LoRA off (0: no LoRA)
    assert load_config(lora, ["actor_rollout_ref.model.lora_rank=0"]).model.lora_rank == 0


def test_a_mapped_key_on_the_command_line_wins_over_the_file(tmp_path):
    """veRL's spelling of a key this config file sets under our name: the command line
    wins, as any override does; from the same place, our name wins."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  max_response_length: 4\nactor:\n  clip_ratio_low: 0.2\n"
        "  clip_ratio_high: 0.28\ntrainer:\n  nproc: 1\n"
    )
    cfg = load_config(
        path,
        [
            "actor_rollout_ref.rollout.response_length=16",
            "actor_rollout_ref.actor.clip_ratio=0.1",
            "trainer.n_gpus_per_node=2",
        ],
    )
    assert cfg.data.max_response_length == 16 and cfg.trainer.nproc == 2
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.1, 0.1)
    # Both on the command line, in either order: ours wins.
    for order in ((0, 1), (1, 0)):
        both = ["actor_rollout_ref.rollout.response_length=16", "data.max_response_length=8"]
        assert load_config(path, [both[i] for i in order]).data.max_response_length == 8
    # In the file under veRL's name, and ours on the command line: the command line's.
    verl_file = tmp_path / "v.yaml"
    verl_file.write_text("actor_rollout_ref:\n  rollout:\n    response_length: 16\n")
    assert load_config(verl_file, ["data.max_response_length=8"]).data.max_response_length == 8
    # Both in one file: ours wins.
    verl_file.write_text(
        "data:\n  max_response_length: 8\nactor_rollout_ref:\n  rollout:\n    response_length: 16\n"
    )
    assert load_config(verl_file).data.max_response_length == 8


@pytest.mark.parametrize("value", ["null", "half", "[0.5]"])
def test_a_refused_key_whose_value_its_check_cannot_read_is_refused_in_one_line(value):
    """Found by a review: a non-number num_cycles raised a TypeError or ValueError out of
    the table's check, a traceback instead of the refusal's one line."""
    with pytest.raises(ConfigError, match="num_cycles=.* is not supported here"):
        load_config(None, [f"actor_rollout_ref.actor.optim.num_cycles={value}"])


def test_dapos_max_resp_len_at_the_default_response_length_is_accepted():
    """Found by a review: with data.max_response_length left at its default, the same
    value for reward_kwargs.max_resp_len was refused (it was compared with nothing)."""
    from asyncrl.config.data import DataConfig

    default = DataConfig.model_fields["max_response_length"].default
    cfg = load_config(None, [f"+reward_model.reward_kwargs.max_resp_len={default}"])
    assert cfg.data.max_response_length == default
    with pytest.raises(ConfigError, match="max_resp_len=99 is not supported here"):
        load_config(None, ["+reward_model.reward_kwargs.max_resp_len=99"])


def test_an_error_names_the_key_whose_value_was_taken():
    """Found by a review: ``trainer.nproc=0`` won over ``trainer.n_gpus_per_node=2``, and
    the refusal named n_gpus_per_node, whose value was never used. A veRL key whose value
    its target took is still named as typed."""
    both = ["trainer.n_gpus_per_node=2", "trainer.nproc=0"]
    with pytest.raises(ConfigError) as e:
        load_config("configs/cpu_demo.yaml", both)
    assert e.value.problems == ["trainer.nproc: input should be greater than 0 (got 0)"]
    with pytest.raises(ConfigError) as e:
        load_config("configs/cpu_demo.yaml", ["actor_rollout_ref.rollout.max_num_seqs=0"])
    assert e.value.problems[0].startswith("actor_rollout_ref.rollout.max_num_seqs: ")


def test_a_target_verl_writes_at_null_takes_the_mapped_keys_value(tmp_path):
    """Found by a review: veRL's own yaml writes ``ppo_micro_batch_size_per_gpu: null``
    beside ``ppo_micro_batch_size: 8`` (and the clip range's ends at null beside
    ``clip_ratio``), and reads the null as not given. The null won here: the global
    micro-batch was dropped, and with dynamic batching off the config was refused."""
    path = tmp_path / "v.yaml"
    path.write_text(
        "actor_rollout_ref:\n"
        "  actor: {ppo_micro_batch_size: 8, ppo_micro_batch_size_per_gpu: null,\n"
        "          use_dynamic_bsz: false, clip_ratio: 0.3, clip_ratio_low: 0.2,\n"
        "          clip_ratio_high: null}\n"
        "  ref: {log_prob_micro_batch_size: 8, log_prob_micro_batch_size_per_gpu: null}\n"
        "  rollout: {name: vllm, log_prob_micro_batch_size: 8,\n"
        "            log_prob_micro_batch_size_per_gpu: null}\n"
        "trainer: {n_gpus_per_node: 2}\n"
    )
    cfg = load_config(path)
    assert cfg.trainer.nproc == 2 and cfg.actor.ppo_micro_batch_size_per_gpu == 4  # 8 / 2
    # veRL: clip_ratio_low if not None else clip_ratio, each end on its own
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.3)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("left", [3, 4, 5, 6]), ("right", [1, 2, 3, 4]), ("middle", [1, 2, 5, 6])],
)
def test_truncation_modes(mode, expected):
    assert fit_prompt([1, 2, 3, 4, 5, 6], 4, mode) == expected
    assert fit_prompt([1, 2], 4, mode) == [1, 2]


def test_truncation_error_names_the_fix():
    with pytest.raises(PromptTooLong, match="data.filter_overlong_prompts=True"):
        fit_prompt([1, 2, 3], 2, "error")


# DAPO's and GSPO's switches as veRL's recipes spell them (issue: veRL's recipes).
VERL_RECIPE = [
    "actor_rollout_ref.actor.clip_ratio_c=10.0",
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    "actor_rollout_ref.actor.clip_ratio_low=0.0003",
    "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "reward_model.overlong_buffer.enable=True",
    "reward_model.overlong_buffer.len=2",
    "reward_model.overlong_buffer.penalty_factor=1.0",
]


@pytest.mark.slow
def test_verl_grpo_example_with_dapo_and_gspo_keys_runs_the_demo(
    tmp_path, demo_model, arithmetic_data
):
    """run_qwen2-7b.sh's overrides, plus dual clip, GSPO, DAPO's filter and overlong
    penalty in veRL's spelling, run the demo for 10 steps."""
    cmd = [
        sys.executable, "-m", "asyncrl.launch", "configs/cpu_demo.yaml",
        *_verl_grpo(str(demo_model), str(arithmetic_data)), *VERL_RECIPE,
        f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=10",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "verl_grpo_example_gsm8k" / "qwen2_7b_function_rm"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/pg" in r]
    assert len(steps) == 10 and all(math.isfinite(r["loss/pg"]) for r in steps)
    assert all(r["loss/kl"] >= 0.0 for r in steps)  # use_kl_loss: the reference is there
    assert all(r["actor/pg_clipfrac_dual"] == 0.0 for r in steps)  # GSPO has no dual clip
    # the demo's first groups: about a quarter right, so some alike groups are filtered
    assert records[-1]["accounting/train/dropped/filtered"] > 0
    assert records[-1]["accounting/train/unaccounted"] == 0
    resolved = (run / "config.yaml").read_text()
    assert "loss_mode: gspo" in resolved and "clip_ratio_c: 10.0" in resolved
    said = proc.stdout + proc.stderr  # the launcher reads the command line, once
    assert said.count("veRL's trainer.n_gpus_per_node=1 ") == 1, said[-3000:]
    assert said.count("ref.fsdp_config.param_offload=True has no effect here") == 1


def test_a_key_given_twice_with_two_values_says_which_wins(caplog):
    """veRL's spelling and ours of one key, or one key twice, with different values: one is
    lost, and the user is told which (a walkthrough lost one silently)."""
    with caplog.at_level("WARNING", logger="asyncrl.config"):
        cfg = load_config(
            "configs/cpu_demo.yaml",
            ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor.ppo_mini_batch_size=4"],
        )
    assert cfg.actor.ppo_mini_batch_size == 4
    assert (
        "actor.ppo_mini_batch_size is given twice on the command line: the last, 4" in caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncrl.config"):
        cfg = load_config(
            "configs/cpu_demo.yaml",
            ["actor_rollout_ref.rollout.response_length=16", "data.max_response_length=4"],
        )
    assert cfg.data.max_response_length == 4
    assert "response_length=16 not applied: data.max_response_length is given too, and wins" in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncrl.config"):  # the same value: nothing lost
        load_config("configs/cpu_demo.yaml", ["rollout.n=8", "rollout.n=8"])
    assert "given twice" not in caplog.text


#: veRL keys this project implements with another default that does not change what a
#: run trains: paths and names, memory and speed settings, and defaults that resolve to
#: veRL's own (None for "the actor's", "model.path", 0 for veRL's null floor).
NOT_RESULTS = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "memory",
    "actor_rollout_ref.actor.use_dynamic_bsz": "memory and speed (token-balanced micro-batches)",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "None: the actor's",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "None: the actor's",
    "actor_rollout_ref.rollout.enforce_eager": "speed",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "speed (1 fits the tiny models)",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "None: the actor's",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "None: the actor's",
    "actor_rollout_ref.model.path": "a path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "memory",
    "data.train_files": "a path",
    "data.val_files": "a path",
    "critic.optim.min_lr_ratio": "0, veRL's null",
    "critic.model.path": "None: model.path, as veRL interpolates",
    "critic.model.enable_gradient_checkpointing": "memory",
    "critic.ppo_mini_batch_size": "None: the actor's, as veRL interpolates",
    "critic.ppo_epochs": "None: the actor's, as veRL interpolates",
    "critic.loss_agg_mode": "None: the actor's, as veRL interpolates",
    "critic.use_dynamic_bsz": "None: the actor's",
    "critic.ppo_max_token_len_per_gpu": "None: from the actor's",
    "trainer.project_name": "a name",
    "trainer.experiment_name": "a name",
    "trainer.logger": "where metrics go",
    "trainer.default_local_dir": "a path",
}


def test_every_default_that_differs_from_verls_is_warned_or_harmless():
    """A veRL script that leaves a key out relies on veRL's default: each implemented key
    whose default here differs either is warned at load (``RESULT_DEFAULTS``) or is listed
    above as not changing what trains. Before, the critic's weight decay was 0 against
    veRL's 0.01, and a PPO script that left it out trained another critic silently."""
    from asyncrl.config.load import _defaults
    from asyncrl.config.verl_compat import RESULT_DEFAULTS
    from asyncrl.config.verl_doc import verl_leaves
    from asyncrl.config.verl_key import lookup, our_key
    from asyncrl.config.verl_table import VERL_KEYS

    verl, ours, silent = verl_leaves(), _defaults(), []
    for key, rule in VERL_KEYS.items():
        if rule.kind != "implemented" or key not in verl:
            continue
        found, here = lookup(ours, our_key(key))
        theirs = rule.convert(verl[key]) if rule.convert and verl[key] is not None else verl[key]
        same = here == theirs or (
            isinstance(here, int | float) and isinstance(theirs, int | float) and here == theirs
        )
        if found and not same and key not in RESULT_DEFAULTS and key not in NOT_RESULTS:
            silent.append(f"{key}: {here!r} here, {verl[key]!r} in veRL")
    assert silent == [], silent
    assert not set(NOT_RESULTS) & set(RESULT_DEFAULTS)


def test_defaults_switches_and_sizes_read_as_the_keys_they_set(monkeypatch):
    """Found by a review: a resolver's default was read by plain YAML (``0615`` octal 397,
    ``off`` a boolean), veRL's global micro-batch of 0 or below became 1 unrefused, and a
    mapped veRL switch read by Python's truth (the text ``off`` turned token-level loss on)."""
    monkeypatch.delenv("ASYNCRL_TEST_UNSET", raising=False)
    for default in ("0615", "off", "8"):
        override = f"trainer.experiment_name=${{oc.env:ASYNCRL_TEST_UNSET,{default}}}"
        assert load_config(None, [override]).trainer.experiment_name == default
    select = "trainer.experiment_name=${oc.select:trainer.nope,0615}"
    assert load_config(None, [select]).trainer.experiment_name == "0615"
    for size in (0, -4):
        with pytest.raises(ConfigError, match="ppo_micro_batch_size"):
            load_config(None, [f"actor_rollout_ref.actor.ppo_micro_batch_size={size}"])
    token_level = "actor_rollout_ref.actor.use_token_level_loss"
    for text, mode in (("off", "seq-mean-token-mean"), ("yes", "token-mean")):
        cfg = load_config(None, [f"{token_level}={text}"])
        assert cfg.actor.loss_agg_mode == mode, text
    with pytest.raises(ConfigError, match="use_token_level_loss: .*'maybe'"):
        load_config(None, [f"{token_level}=maybe"])
