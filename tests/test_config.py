"""Config: defaults, presets, dotted overrides, and every bad-input path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncrl.config import (
    Config,
    ConfigError,
    field_reference,
    load_config,
    parse_override,
    run_dir,
    write_resolved,
)
from asyncrl.config.resolved import absolute_paths
from asyncrl.config.verl_doc import leaves_of

PRESETS = sorted(Path("configs").glob("*.yaml"))


def _problems(path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def test_defaults_are_valid_and_documented():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.rollout.top_p == 1.0 and cfg.rollout.top_k == -1
    assert cfg.model.path == "artifacts/models/tiny"  # the locally built model
    reference = field_reference()
    for group in Config.model_fields:
        assert f"{group}:" in reference
    # Every leaf key appears with its description.
    assert "staleness.max_policy_lag (int, default 1): Oldest data" in reference
    assert "None" not in [line.rsplit(": ", 1)[-1] for line in reference.splitlines()]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_presets_load(preset):
    """Each value a preset sets is the loaded config's (one path read as a list, as in
    veRL; a list as a tuple where the schema keeps one), and every other key its default."""
    sets = leaves_of(yaml.safe_load(preset.read_text()))
    assert len(sets) >= 30, sets  # a preset, not an empty file
    loaded = leaves_of(load_config(preset).model_dump(mode="json"))
    for key, value in sets.items():
        got = loaded.get(key, "(no such key)")
        if isinstance(got, list) and not isinstance(value, list):
            value = [value]
        assert got == value, (key, got, value)
    defaults = leaves_of(Config().model_dump(mode="json"))
    rest = {
        k: v for k, v in loaded.items() if not any(k == s or k.startswith(s + ".") for s in sets)
    }
    assert rest == {k: defaults[k] for k in rest}


@pytest.mark.parametrize(
    ("item", "key", "value"),
    [
        ("rollout.n=16", "rollout.n", 16),
        ("actor.optim.lr=1e-5", "actor.optim.lr", 1e-5),
        ("trainer.val_before_train=false", "trainer.val_before_train", False),
        ("trainer.logger=[console,wandb]", "trainer.logger", ["console", "wandb"]),
        ("trainer.total_training_steps=null", "trainer.total_training_steps", None),
        ("+buffer.policy=uniform", "buffer.policy", "uniform"),
        ("model.path=/models/a:b", "model.path", "/models/a:b"),
        ("actor_rollout_ref.actor.optim.lr=2e-6", "actor.optim.lr", 2e-6),
        ("actor_rollout_ref.rollout.n=4", "rollout.n", 4),
        ("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.type", "adaptive"),
        ("critic.cliprange_value=0.2", "critic.cliprange_value", 0.2),
        ("custom_reward_function.path=r.py", "reward.custom_reward_function.path", "r.py"),
    ],
)
def test_parse_override(item, key, value):
    assert parse_override(item) == (key, value)


def test_overrides_apply_over_yaml(tmp_path):
    cfg = load_config(
        "configs/cpu_demo.yaml",
        ["staleness.max_policy_lag=4", "actor.optim.lr=1e-5", "data.train_files=a.parquet"],
    )
    assert cfg.staleness.max_policy_lag == 4
    assert cfg.actor.optim.lr == 1e-5
    assert cfg.data.train_files == ["a.parquet"]  # one path becomes a list, as in veRL
    assert cfg.rollout.num_servers == 2  # untouched keys keep the file's values


def test_verl_layout_in_yaml(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "actor_rollout_ref": {
                    "actor": {"optim": {"lr": 3e-6}, "kl_loss_type": "low_var_kl"},
                    "rollout": {"n": 5},
                    "model": {"path": "some/model"},
                },
                "custom_reward_function": {"path": "score.py", "name": "my_score"},
            }
        )
    )
    cfg = load_config(path)
    assert cfg.actor.optim.lr == 3e-6
    assert cfg.actor.kl_loss_type == "k3"
    assert cfg.rollout.n == 5 and cfg.model.path == "some/model"
    assert cfg.reward.custom_reward_function.name == "my_score"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "rollout.temprature=0.5",
            "unknown key rollout.temprature; did you mean rollout.temperature?",
        ),
        ("actor.optim.lrr=1", "did you mean actor.optim.lr?"),
        ("stalenes.max_policy_lag=1", "unknown key stalenes; did you mean staleness?"),
        ("zzz=1", "valid keys in the top level: model, data"),
        ("rollout.n=abc", "rollout.n: input should be a valid integer"),
        ("rollout.n=0", "rollout.n: input should be greater than 0"),
        ("rollout.sync_mode=pause", "rollout.sync_mode: input should be 'keep' or 'abort'"),
        ("trainer.logger=[console,neptune]", "trainer.logger.1: input should be"),
        ("staleness.max_policy_lag=-1", "staleness.max_policy_lag: input should be greater"),
        ("data.train_files={a: 1}", "data.train_files: input should be a valid list"),
        # An empty name made the project's folder the run directory.
        ("trainer.experiment_name=", "trainer.experiment_name: string should have at least"),
    ],
)
def test_bad_keys_and_types_name_the_key(override, expected):
    problems = _problems("configs/cpu_demo.yaml", [override])
    assert any(expected in p for p in problems), problems


def test_top_k_off_is_minus_one_or_zero_as_vllm_reads_them():
    """A review: vLLM takes 0 as "off" as it takes -1, and refuses any value below -1 only
    when it builds a request (every validation request then failed with a traceback)."""
    assert load_config(None, ["rollout.top_k=0"]).rollout.top_k == 0
    assert load_config(None, ["rollout.val_kwargs.top_k=0"]).rollout.val_kwargs.top_k == 0
    assert any(
        "rollout.val_kwargs.top_k" in p for p in _problems(None, ["rollout.val_kwargs.top_k=-5"])
    )


GAE = ["algorithm.adv_estimator=gae"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.top_p=0.9"], "set rollout.top_p=1"),
        (["rollout.top_k=50"], "set rollout.top_k=-1"),
        (["rollout.n=1"], "set rollout.n>=2"),
        (["rollout.max_inflight=4"], "raise rollout.max_inflight"),
        (["actor.ppo_mini_batch_size=64"], "exceeds data.train_batch_size"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
        (["buffer.max_reuse=3"], "needs buffer.policy=uniform"),
        (["control.dead_after_s=1", "control.heartbeat_s=2"], "must exceed control.heartbeat_s"),
        (["control.min_servers_to_start=3"], "no task would ever be dealt"),
        (["buffer.capacity_groups=20"], "raise it to >= 864"),
        (["endpoints.batches=5551"], "endpoints.batches=5551 is also endpoints.tasks"),
        (["launch.cpus={rollout: [[1]]}"], "give one list per server"),
        (["launch.cpus={critic: [0]}"], "unknown roles ['critic']"),
        (["launch.cpus={learner: [[0]]}"], "launch.cpus.learner=[[0]] has the wrong shape"),
        (["launch.gpus={rollout: [0, 1]}"], "write e.g. [[1], [2]], one list per server"),
        (["launch.nice={rollout: [19]}"], "give one value per server, or one number for all"),
        (["launch.nice={learner: -5}"], "launch.nice.learner=-5 is outside 0-19"),
        (["launch.nice={learner: [1]}"], "launch.nice.learner=[1] is a list"),
        (["launch.nice={critic: 3}"], "launch.nice has unknown roles ['critic']"),
        (["launch.nice={rollout: 19}", "launch.backend=ray"], "launch.nice applies to the local"),
        (["model.dtype=bfloat16"], "set model.dtype=float32"),
        (["rollout.inline_engine=true", "rollout.sync_mode=abort"], "set rollout.sync_mode=keep"),
        (["trainer.critic_warmup=2"], "set trainer.critic_warmup=0"),
        (GAE + ["critic.ppo_mini_batch_size=64"], "critic.ppo_mini_batch_size=64 exceeds"),
        (GAE + ["trainer.critic_warmup=181"], "lower trainer.critic_warmup"),
        (
            GAE + ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0"],
            "set algorithm.kl_ctrl.kl_coef>0",
        ),
        (  # a review: every endpoint group trained with advantage 0
            [
                "rollout.openai_endpoint.enable=true",
                "rollout.openai_endpoint.group_size=1",
                "trainer.val_before_train=false",
                "trainer.test_freq=-1",
            ],
            "set group_size>=2",
        ),
    ],
)
def test_cross_field_rules_name_the_fix(overrides, expected):
    problems = _problems("configs/cpu_demo.yaml", overrides)
    assert any(expected in p for p in problems), problems


def test_validation_sampling_may_truncate():
    cfg = load_config("configs/cpu_demo.yaml", ["rollout.val_kwargs.top_p=0.9"])
    assert cfg.rollout.val_kwargs.top_p == 0.9


def test_all_problems_reported_at_once():
    problems = _problems(None, ["rollout.top_p=0.5", "rollout.top_k=3"])
    assert len(problems) == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rollout: [1, 2", "is not valid YAML"),
        ("- a\n- b\n", "must hold a mapping of groups"),
        ("rollout: 3\n", "rollout: input should be a valid dictionary"),
    ],
)
def test_bad_files(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert any(expected in p for p in _problems(path)), _problems(path)


def test_missing_file_and_bad_override_syntax(tmp_path):
    assert "not found" in _problems(tmp_path / "nope.yaml")[0]
    assert "is not key=value" in _problems(None, ["rollout.n"])[0]
    assert "is a value, not a group" in _problems("configs/cpu_demo.yaml", ["rollout.n.x=1"])[0]
    assert "empty key" in _problems(None, ["=3"])[0]


def test_empty_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(
        "configs/cpu_demo.yaml",
        [f"trainer.default_local_dir={tmp_path}", "staleness.max_policy_lag=3"],
    )
    written = write_resolved(cfg)
    assert written == run_dir(cfg) / "config.yaml"
    assert run_dir(cfg) == tmp_path / "asyncrl" / "cpu_demo"
    # A role restarted by hand reads the resolved file and gets the same config, with its
    # local paths absolute (it may be started from another directory).
    expected = cfg.model_dump(mode="json")
    absolute_paths(expected)  # tests/test_config_resolved.py checks which paths it changes
    assert load_config(written).model_dump(mode="json") == expected


def test_assignment_is_validated():
    cfg = Config()
    with pytest.raises(ValueError):
        cfg.rollout.n = "many"  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # vLLM raises any temperature in (0, 0.01) to 0.01 while the learner would divide
        # the logits by the configured one: every importance weight would be wrong.
        ("0.005", "set rollout.temperature>=0.01"),
        ("0.00999", "set rollout.temperature>=0.01"),
        # vLLM refuses temperatures above 2: every training request would fail.
        ("2.5", "set rollout.temperature<=2"),
        # Greedy is not a training temperature (the learner divides by it).
        ("0", "rollout.temperature: input should be greater than 0"),
    ],
)
def test_training_temperature_vllm_would_change_is_refused(value, expected):
    problems = _problems("configs/cpu_demo.yaml", [f"rollout.temperature={value}"])
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("value", [0.01, 0.7, 2.0])
def test_training_temperature_vllm_samples_at_is_accepted(value):
    assert (
        load_config("configs/cpu_demo.yaml", [f"rollout.temperature={value}"]).rollout.temperature
        == value
    )


def test_a_validation_temperature_vllm_refuses_is_refused_here():
    problems = _problems("configs/cpu_demo.yaml", ["rollout.val_kwargs.temperature=2.5"])
    assert any("set it to 0 (greedy) or at most 2" in p for p in problems), problems
    greedy = load_config("configs/cpu_demo.yaml", ["rollout.val_kwargs.temperature=0"])
    assert greedy.rollout.val_kwargs.temperature == 0.0


def test_verl_recipe_keys_load_in_yaml_and_overrides(tmp_path):
    """DAPO/GSPO keys as veRL spells them: dual clip, GSPO, filter_groups, overlong."""
    path = tmp_path / "verl_dapo.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "actor_rollout_ref": {
                    "actor": {"clip_ratio_c": 10.0, "policy_loss": {"loss_mode": "gspo"}}
                },
                "algorithm": {
                    "filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 10}
                },
                "reward_model": {
                    "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0}
                },
            }
        )
    )
    cfg = load_config(path)
    assert cfg.actor.clip_ratio_c == 10.0 and cfg.actor.policy_loss.loss_mode == "gspo"
    # GSPO's own clip range when the config leaves it unset; loss_agg_mode keeps veRL's
    # default (it aggregates the KL and entropy terms: GSPO's policy term has its own)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (3e-4, 4e-4)
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.algorithm.filter_groups.max_num_gen_batches == 10
    assert cfg.reward.overlong_buffer.len == 4
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.clip_ratio_low=0.001",
            "reward_model.overlong_buffer.penalty_factor=0.5",
        ],
    )
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.001, 4e-4)
    assert cfg.reward.overlong_buffer.penalty_factor == 0.5
    assert load_config(None).actor.clip_ratio_c == 3.0  # veRL's default: dual clip is on
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        load_config(None, ["actor.clip_ratio_c=1.0"])


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["reward.overlong_buffer.penalty_factor=1"], "overlong_buffer.len=0 with"),
        (
            ["reward.overlong_buffer.len=100", "reward.overlong_buffer.penalty_factor=1"],
            "overlong_buffer.len=100 with data.max_response_length=4",
        ),
        (["reward.overlong_buffer.len=2"], "penalty_factor=0 penalises nothing"),
    ],
)
def test_an_overlong_buffer_that_would_shape_nothing_or_everything_is_refused(overrides, says):
    """veRL divides by a buffer of 0 and asserts one within the limit; a factor of 0 would
    switch the penalty on and apply none."""
    problems = _problems(
        "configs/cpu_demo.yaml", ["reward.overlong_buffer.enable=true", *overrides]
    )
    assert any(says in p for p in problems), problems
    ok = ["reward.overlong_buffer.len=4", "reward.overlong_buffer.penalty_factor=1"]
    buffer = load_config(
        "configs/cpu_demo.yaml", ["reward.overlong_buffer.enable=true", *ok]
    ).reward.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 4, 1.0)


def test_each_gpu_rank_needs_a_listed_gpu_and_each_cpu_rank_a_core():
    gpu = ["trainer.device=cuda", "model.dtype=bfloat16", "launch.cpus=null"]
    two = "launch.gpus={learner:[0,1],rollout:[[2],[3]]}"
    problems = _problems(
        "configs/cpu_demo.yaml",
        [*gpu, "trainer.nproc=2", "launch.gpus={learner:[0],rollout:[[1],[2]]}"],
    )
    assert any("rank 1 would find no device" in p for p in problems), problems
    problems = _problems(
        "configs/cpu_demo.yaml", [*gpu, two, "rollout.tensor_model_parallel_size=2"]
    )
    assert any("launch.gpus.rollout[0]=[2] lists 1 GPU(s); list 2" in p for p in problems)
    assert load_config("configs/cpu_demo.yaml", [*gpu, two, "trainer.nproc=2"]).trainer.nproc == 2
    # On CPU, vLLM binds each tensor-parallel rank to cores of its own: the demo's one core
    # per server crash-looped at every start (a walkthrough).
    problems = _problems("configs/cpu_demo.yaml", ["rollout.tensor_model_parallel_size=2"])
    assert any("launch.cpus.rollout[0]=[0] lists 1 core(s); list 2" in p for p in problems)
    from asyncrl.launch.roles import omp_bind

    assert omp_bind([0, 1, 2, 3], 2) == "0,1|2,3" and omp_bind([5], 1) == "5"


def test_zero_training_steps_are_refused():
    problems = _problems("configs/cpu_demo.yaml", ["trainer.total_training_steps=0"])
    assert any("trainer.total_training_steps" in p for p in problems), problems
