"""veRL's trainer config, key by key: the table (asyncrl/config/verl_table.py) covers every
leaf of the veRL version it names, and each row does through the loader what it says."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from asyncrl.config import Config, ConfigError, load_config
from asyncrl.config.verl_doc import leaves_of, markdown, verl_leaves
from asyncrl.config.verl_key import our_key
from asyncrl.config.verl_table import VERL_KEYS
from learner.plan import plan_step
from learner.trainer import Trainer
from tests.trainer_helpers import synthetic_batch

LEAVES = verl_leaves()
# Keys veRL keeps outside ppo_trainer.yaml that the table also holds: DAPO's recipe keys
# and the older names its example scripts still pass.
OUTSIDE = {
    "algorithm.filter_groups.enable",
    "algorithm.filter_groups.metric",
    "algorithm.filter_groups.max_num_gen_batches",
    "reward_model.overlong_buffer.enable",
    "reward_model.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor",
    "reward_model.overlong_buffer.log",
    "actor_rollout_ref.actor.fsdp_config.grad_offload",
    "actor_rollout_ref.actor.use_token_level_loss",
    "data.gen_batch_size",
    "custom_reward_function.overlong_buffer.enable",
    "custom_reward_function.overlong_buffer.len",
    "custom_reward_function.overlong_buffer.penalty_factor",
    "custom_reward_function.overlong_buffer.log",
    "custom_reward_function.reward_kwargs",  # newer veRL: arguments bound to the scorer
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable",
    "reward_model.reward_kwargs.overlong_buffer_cfg.len",
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log",
    "reward_model.reward_kwargs.max_resp_len",
    "critic.model.fsdp_config.grad_offload",
    "ray_init.num_cpus",
    "ray_init.timeline_json_file",
}
BASE = load_config(None).model_dump(mode="json")


def test_the_table_covers_every_leaf_of_verl_ppo_trainer_yaml():
    # the leaves of the veRL version the file names, global_profiler's and ray_kwargs' too
    assert len(LEAVES) == 355
    assert sum(k.startswith("global_profiler.") for k in LEAVES) == 19
    missing = sorted(set(LEAVES) - set(VERL_KEYS))
    assert not missing, f"veRL keys with no row: {missing}"
    assert set(VERL_KEYS) - set(LEAVES) == OUTSIDE


def test_the_markdown_table_is_generated_from_the_code():
    path = Path("asyncrl/config/VERL_KEYS.md")
    assert path.read_text() == markdown(), "regenerate: python -m asyncrl.config.verl_doc markdown"
    readme = Path("README.md").read_text()
    for kind in ("implemented", "mapped", "no_effect", "refused"):
        n = sum(rule.kind == kind for rule in VERL_KEYS.values())
        assert f"| {kind} | {n} |" in readme, f"README's count of {kind} keys"


def _value(key: str) -> Any:
    rule = VERL_KEYS[key]
    if rule.example is not ...:
        return rule.example
    return LEAVES.get(key)


def _override(key: str, value: Any) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def _at(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _same(ours: Any, verl: Any) -> bool:
    if isinstance(ours, (list, tuple)) and isinstance(verl, str):
        return list(ours) == [verl]
    if isinstance(ours, (list, tuple)):
        return list(ours) == list(verl)
    if ours is None or verl is None:
        return ours == verl
    return ours == verl or (isinstance(ours, float) and float(verl) == ours)


def _changed(cfg: Config) -> dict[str, Any]:
    """Top-level groups that differ from the built-in defaults."""
    now = cfg.model_dump(mode="json")
    return {k: v for k, v in now.items() if v != BASE[k]}


# What each row that converts veRL's value gives our keys, worked out by hand (the loader
# calls the row's own convert, so comparing against it would check nothing): veRL's value
# (the table's example, or veRL's default) and {our key: the value it must become}.
CONVERTED: dict[str, tuple[Any, dict[str, Any]]] = {
    "actor_rollout_ref.actor.clip_ratio": (
        0.3,
        {"actor.clip_ratio_low": 0.3, "actor.clip_ratio_high": 0.3},
    ),
    "actor_rollout_ref.actor.fsdp_config.offload_policy": (
        True,
        {"actor.fsdp_config.param_offload": True, "actor.fsdp_config.optimizer_offload": True},
    ),
    "actor_rollout_ref.actor.kl_loss_type": ("mse", {"actor.kl_loss_type": "k2"}),
    "actor_rollout_ref.actor.optim.min_lr_ratio": (0.1, {"actor.optim.min_lr_ratio": 0.1}),
    "actor_rollout_ref.actor.optim.warmup_style": (
        "cosine",
        {"actor.optim.lr_scheduler_type": "cosine"},
    ),
    # a global micro-batch over one learner rank
    "actor_rollout_ref.actor.ppo_micro_batch_size": (
        8,
        {"actor.ppo_micro_batch_size_per_gpu": 8},
    ),
    "actor_rollout_ref.actor.use_remove_padding": (False, {"actor.sequence_layout": "padded"}),
    "actor_rollout_ref.actor.use_token_level_loss": (
        False,
        {"actor.loss_agg_mode": "seq-mean-token-mean"},
    ),
    "actor_rollout_ref.model.use_remove_padding": (False, {"actor.sequence_layout": "padded"}),
    "actor_rollout_ref.nccl_timeout": (600, {"sync.timeout_s": 600.0}),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": (
        8,
        {"ref.log_prob_micro_batch_size_per_gpu": 8},
    ),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (
        8,
        {"rollout.log_prob_micro_batch_size_per_gpu": 8},
    ),
    "actor_rollout_ref.rollout.max_num_seqs": (64, {"rollout.max_inflight": 64}),
    "actor_rollout_ref.rollout.prompt_length": (32, {"data.max_prompt_length": 32}),
    "actor_rollout_ref.rollout.response_length": (4, {"data.max_response_length": 4}),
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": (64, {"sync.bucket_mb": 64.0}),
    "algorithm.kl_penalty": ("low_var_kl", {"algorithm.kl_penalty": "k3"}),
    "critic.optim.min_lr_ratio": (0.1, {"critic.optim.min_lr_ratio": 0.1}),
    "critic.optim.warmup_style": ("cosine", {"critic.optim.lr_scheduler_type": "cosine"}),
    "critic.ppo_micro_batch_size": (8, {"critic.ppo_micro_batch_size_per_gpu": 8}),
    "trainer.n_gpus_per_node": (2, {"trainer.nproc": 2}),
    "trainer.nnodes": (2, {"launch.ray.learner_nodes": 2}),
    "trainer.rollout_data_dir": ("rollouts", {"buffer.log_rollouts": True}),
    "reward_model.reward_manager": ("prime", {"reward.reward_manager": "prime"}),
}
# Implemented keys whose example is valid only beside other keys (our spelling).
WITH = {
    "algorithm.use_kl_in_reward": ["algorithm.adv_estimator=gae"],
    "trainer.critic_warmup": ["algorithm.adv_estimator=gae"],
    # alone, in this project's spelling, the epochs cap the default steps, said in a note
    "trainer.total_epochs": ["trainer.total_training_steps=60"],
    # veRL validates greedily unless do_sample is given: a sampled temperature needs it
    "actor_rollout_ref.rollout.val_kwargs.temperature": [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true"
    ],
    **{
        f"{where}.enable": [
            "reward.overlong_buffer.len=4",
            "reward.overlong_buffer.penalty_factor=1.0",
        ]
        for where in (
            "custom_reward_function.overlong_buffer",
            "reward_model.overlong_buffer",
            "reward_model.reward_kwargs.overlong_buffer_cfg",
        )
    },
}
# Implemented keys our schema takes at one value only (veRL's default, ours too): a value
# the test can set to see the key arrive is one the schema must refuse, by our key's name.
ONE_VALUE = {
    "actor_rollout_ref.rollout.multi_turn.format": "qwen",
    "actor_rollout_ref.rollout.top_k": 20,  # training samples the full distribution
    "actor_rollout_ref.rollout.top_p": 0.9,
}
DEFAULTS = load_config(None)


def test_the_hand_worked_conversions_cover_every_converting_row():
    converting = {k for k, r in VERL_KEYS.items() if r.kind == "mapped" or r.convert}
    assert set(CONVERTED) == converting
    assert set(WITH) | set(ONE_VALUE) <= {
        k for k, r in VERL_KEYS.items() if r.kind == "implemented"
    }


@pytest.mark.parametrize("key", sorted(VERL_KEYS))
def test_each_row_does_what_the_table_says(key, caplog):
    rule, value = VERL_KEYS[key], _value(key)
    with caplog.at_level(logging.INFO, logger="asyncrl.config.load"):
        cfg = load_config(None, [_override(key, value), *WITH.get(key, [])])
    notes = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    if key in CONVERTED:
        given, expected = CONVERTED[key]
        assert value == given, f"the table's example of {key} is not the one worked out here"
    elif rule.kind == "implemented":
        expected = {our_key(key): value}
    if key in ONE_VALUE:  # the only value ours takes: a different one must reach the schema
        assert _same(_at(DEFAULTS, our_key(key)), value), key
        with pytest.raises(ConfigError) as err:
            load_config(None, [_override(key, ONE_VALUE[key])])
        named = (key, our_key(key))  # the schema's lines name it as written
        assert any(p.startswith(named) for p in err.value.problems), err.value.problems
    elif rule.kind in ("implemented", "mapped"):
        for target, want in expected.items():
            # the value set must not be ours by default, or a key the loader dropped would pass
            assert not _same(_at(DEFAULTS, target), want), f"{key}: give the row an example"
            assert _same(_at(cfg, target), want), (key, target, _at(cfg, target), want)
    if rule.kind == "implemented":
        assert not notes
    elif rule.kind == "mapped":
        assert len(notes) == len(rule.target)
    else:  # no effect, or a refused key at a value it allows: nothing changes, one note
        assert _changed(cfg) == {}, key
        assert len(notes) == 1
        assert (rule.reason if rule.kind == "no_effect" else "is accepted") in notes[0]
    if rule.kind == "refused":
        with pytest.raises(ConfigError) as err:
            load_config(None, [_override(key, rule.bad), *rule.bad_with])
        (line,) = err.value.problems
        assert line.startswith(f"{key}=") and rule.reason in line


def test_a_null_min_lr_ratio_reads_as_zero(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("critic:\n  optim:\n    min_lr_ratio: null\n")
    assert load_config(path).critic.optim.min_lr_ratio == 0.0


def test_a_mapped_key_gives_way_to_ours():
    cfg = load_config(
        None, ["actor_rollout_ref.actor.clip_ratio=0.3", "actor.clip_ratio_high=0.28"]
    )
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.3, 0.28)


def test_verls_bfloat16_rollout_dtype_loads_on_the_cpu_with_a_note(caplog):
    """Found by a review: veRL's rollout.dtype=bfloat16 (in every veRL-layout YAML) was
    refused on the CPU with "set model.dtype instead", and model.dtype=bfloat16 is refused
    on the CPU: a circle. On the CPU, which runs float32, it now has no effect, said so."""
    import logging

    with caplog.at_level(logging.INFO, logger="asyncrl.config"):
        cfg = load_config(None, ["actor_rollout_ref.rollout.dtype=bfloat16"])
    assert cfg.model.dtype == "float32"
    assert "rollout.dtype='bfloat16' is accepted: no effect on the CPU" in caplog.text
    with pytest.raises(ConfigError, match="set model.dtype instead"):  # it contradicts
        load_config(None, ["actor_rollout_ref.rollout.dtype=bfloat16", "model.dtype=float32"])


def test_refusals_that_read_the_rest_of_the_config():
    load_config(None, ["actor_rollout_ref.rollout.dtype=float32"])  # model.dtype's default
    with pytest.raises(ConfigError, match="set model.dtype instead"):
        load_config(None, ["actor_rollout_ref.rollout.dtype=bfloat16", "trainer.device=cuda"])
    cuda = ["trainer.device=cuda", "model.dtype=bfloat16"]  # the fix, on CUDA
    assert load_config(None, ["actor_rollout_ref.rollout.dtype=bfloat16", *cuda]).model.dtype == (
        "bfloat16"
    )
    # veRL validates greedily with do_sample=false; here the temperature decides
    load_config(None, ["actor_rollout_ref.rollout.val_kwargs.do_sample=false"])
    with pytest.raises(ConfigError, match="val_kwargs.temperature decides"):
        load_config(
            None,
            [
                "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
                "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
            ],
        )


def test_a_verl_validation_temperature_without_do_sample_is_refused(tmp_path):
    """veRL's val_kwargs.do_sample defaults to false, and veRL then validates greedily
    whatever val_kwargs.temperature says: a veRL command line or file giving only the
    temperature validated by sampling here, without a word."""
    verl = ["actor_rollout_ref.rollout.val_kwargs.temperature=0.6"]
    line = (
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6 without "
        "actor_rollout_ref.rollout.val_kwargs.do_sample (veRL's default: false) is not "
        "supported here: veRL validates greedily when do_sample is false whatever the "
        "temperature; here val_kwargs.temperature decides: set it to 0 (greedy) or "
        "do_sample=true"
    )
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*verl, "actor_rollout_ref.rollout.val_kwargs.n=4"])
    assert refused.value.problems == [line]
    path = tmp_path / "verl.yaml"
    path.write_text(
        yaml.safe_dump({"actor_rollout_ref": {"rollout": {"val_kwargs": {"temperature": 0.6}}}})
    )
    with pytest.raises(ConfigError) as in_a_file:
        load_config(path)
    assert in_a_file.value.problems == [line]
    sampled = load_config(None, [*verl, "actor_rollout_ref.rollout.val_kwargs.do_sample=true"])
    assert sampled.rollout.val_kwargs.temperature == 0.6
    greedy = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.temperature=0"])
    assert greedy.rollout.val_kwargs.temperature == 0
    # Our spelling keeps our meaning: the temperature decides (the demo's files sample).
    ours = load_config("configs/cpu_demo.yaml", ["rollout.val_kwargs.temperature=0.6"])
    assert ours.rollout.val_kwargs.temperature == 0.6


def test_a_yaml_file_in_verl_layout_loads(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "actor_rollout_ref": {
                    "hybrid_engine": True,
                    "nccl_timeout": 300,
                    "actor": {"clip_ratio": 0.25, "strategy": "fsdp2"},
                    "rollout": {"name": "vllm", "n": 4},
                },
                "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
            }
        )
    )
    cfg = load_config(path)
    assert cfg.sync.timeout_s == 300 and cfg.rollout.n == 4 and cfg.trainer.nproc == 2
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == 0.25


def test_nnodes_over_one_needs_the_ray_launcher(tmp_path, tiny_model, arithmetic_data, capsys):
    from asyncrl.launch.local import main

    assert load_config(None, ["trainer.nnodes=2"]).launch.ray.learner_nodes == 2
    argv = ["configs/cpu_demo.yaml", "trainer.nnodes=2", f"trainer.default_local_dir={tmp_path}"]
    argv += [f"model.path={tiny_model}", f"data.train_files={arithmetic_data}/train.parquet"]
    argv += [f"data.val_files={arithmetic_data}/val.parquet"]
    assert main(argv) == 2
    assert "a learner over several nodes needs --ray" in capsys.readouterr().err


def test_warmup_ratio_counts_the_runs_steps():
    cfg = load_config(
        None, ["actor.optim.lr_warmup_steps_ratio=0.1", "trainer.total_training_steps=50"]
    )
    assert cfg.actor.optim.warmup_steps(50) == 5
    assert load_config(None, ["actor.optim.lr_warmup_steps=3"]).actor.optim.warmup_steps(50) == 3
    with pytest.raises(ValueError, match="needs trainer.total_training_steps"):
        cfg.actor.optim.warmup_steps(None)


def test_leaves_of_resolves_verl_interpolations():
    """Resolved as veRL resolves them; a key written as one interpolation stays one leaf."""
    tree = {
        "actor": {"_target_": "x", "use_dynamic_bsz": True, "ppo_max_token_len": 100},
        "ref": {
            "dyn": "${oc.select:actor.use_dynamic_bsz,false}",
            "missing": "${oc.select:nowhere.key,7}",
            "max_len": "${actor.ppo_max_token_len}",
            "save": ["model"],
            "load": "${.save}",
            "empty": {},
            "tools": {"nsys": {"_target_": "y", "discrete": False}},
            "same_tools": "${oc.select:ref.tools,null}",
        },
    }
    assert leaves_of(tree) == {
        "actor.use_dynamic_bsz": True,
        "actor.ppo_max_token_len": 100,
        "ref.dyn": True,
        "ref.missing": 7,
        "ref.max_len": 100,
        "ref.save": ["model"],
        "ref.load": ["model"],
        "ref.empty": {},
        "ref.tools.nsys.discrete": False,
        # written as one interpolation, one key (not the group's keys again): veRL's
        # rollout.profiler.tool_config
        "ref.same_tools": {"nsys": {"discrete": False}},
    }


# ---------------------------------------------------------------- the no-grad passes' budget
@pytest.mark.parametrize("world", [1, 2])
def test_a_no_grad_pass_covers_the_training_shard_with_its_own_budget(world):
    batch = synthetic_batch(0, groups=4, n=4)[:-1]

    def ids(plan: list[list[list[int]]]) -> list[int]:
        return sorted(s for mini in plan for micro in mini for s in micro)

    for rank in range(world):
        train, _ = plan_step(batch, 2, world_size=world, rank=rank, padded=True, max_seqs=2)
        big, _ = plan_step(batch, 2, world_size=world, rank=rank, padded=True, max_tokens=400)
        assert ids(big) == ids(train)
        assert sum(len(mini) for mini in big) < sum(len(mini) for mini in train)


def test_no_grad_pass_budgets_give_the_same_logprobs(tiny_model, single_rank):
    base = [
        f"model.path={tiny_model}",
        "actor.ppo_mini_batch_size=2",
        "actor.use_dynamic_bsz=false",
        "actor.ppo_micro_batch_size_per_gpu=2",
    ]
    passes = ["rollout.log_prob_micro_batch_size_per_gpu=16", "ref.log_prob_use_dynamic_bsz=true"]
    batch = synthetic_batch(1, groups=4, n=4)[:-1]
    got = {}
    for extra in ([], passes):
        trainer = Trainer(load_config(None, base + extra))
        plan = trainer._plan(batch, torch.zeros(len(batch)), 1.0)
        got[bool(extra)] = (plan, trainer._fixed_logprobs(trainer.model, plan, "proximal"))
        got[bool(extra)] += (trainer._fixed_logprobs(trainer.model, plan, "ref"),)
    (plain, prox, ref), (own, prox2, ref2) = got[False], got[True]
    assert not plain.pass_micros and set(own.pass_micros or {}) == {"proximal", "ref"}
    assert len(own.micros_for("proximal")) < len(plain.micros_for("proximal"))
    assert prox.keys() == prox2.keys() == ref2.keys()
    for sid in prox:  # other batch shapes sum in another order: float32 rounding only
        torch.testing.assert_close(prox2[sid], prox[sid], rtol=0, atol=1e-5)
        torch.testing.assert_close(ref2[sid], ref[sid], rtol=0, atol=1e-5)


def test_override_config_reaches_the_learner_and_the_engine(tiny_model, single_rank):
    from learner import fsdp
    from rollout_servers.engine_config import engine_args

    overrides = {"attention_dropout": 0.25, "resid_pdrop": 0.0}  # Qwen2 has no resid_pdrop
    cfg = load_config(None, [f"model.path={tiny_model}", "+model.override_config.resid_pdrop=0."])
    assert cfg.model.override_config == {"resid_pdrop": 0.0}
    mesh = fsdp.init_distributed("cpu")
    model = fsdp.load_sharded_model(str(tiny_model), mesh, config_overrides=overrides)
    assert model.config.attention_dropout == 0.25 and model.config.resid_pdrop == 0.0
    assert engine_args(str(tiny_model), hf_overrides=overrides).hf_overrides == overrides
    assert engine_args(str(tiny_model)).hf_overrides == {}


def test_verls_vectorised_estimators_read_as_the_plain_ones():
    """A review: veRL's grpo_vectorized and rloo_vectorized (the same formulas, computed
    without a loop) were refused as unknown estimators."""
    for theirs, ours in (("grpo_vectorized", "grpo"), ("rloo_vectorized", "rloo")):
        cfg = load_config(None, [f"algorithm.adv_estimator={theirs}"])
        assert cfg.algorithm.adv_estimator == ours
