"""How the text of a veRL command line or config file is read: Hydra's value grammar,
OmegaConf references, ``~`` in paths, DAPO's newer spellings, the keys of unknown groups,
the defaults a veRL script relies on, veRL's older global micro-batch sizes, and its
``default_local_dir``.
"""

from __future__ import annotations

import logging
import re

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.load import run_dir, write_resolved


def test_override_values_read_as_hydra_reads_them():
    """``off``/``yes`` stay text and a date is text (YAML 1.1 reads them as a bool and a
    date); a number given for a text key is that text."""
    cfg = load_config(
        "configs/cpu_demo.yaml",
        ["trainer.project_name=off", "trainer.experiment_name=2025-01-20", "rollout.n=4"],
    )
    assert (cfg.trainer.project_name, cfg.trainer.experiment_name) == ("off", "2025-01-20")
    assert load_config(None, ["trainer.experiment_name=20250120"]).trainer.experiment_name == (
        "20250120"
    )
    assert load_config(None, ["data.shuffle=False"]).data.shuffle is False


def test_omegaconf_references_resolve(tmp_path, monkeypatch):
    """veRL's files and scripts write ``${...}``: a reference in veRL's spelling or ours, a
    sibling, ``oc.select`` and ``oc.env`` resolve; a key left out reads as its default."""
    monkeypatch.setenv("ASYNCRL_TEST_RUN", "night")
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  actor:\n    ppo_epochs: 3\n"
        "critic:\n  ppo_epochs: ${actor_rollout_ref.actor.ppo_epochs}\n"
        "  ppo_mini_batch_size: ${oc.select:critic.nowhere,8}\n"
        "algorithm:\n  adv_estimator: gae\n"
        "trainer:\n  experiment_name: ${oc.env:ASYNCRL_TEST_RUN}\n"
        "  default_local_dir: ck/${trainer.project_name}/${.experiment_name}\n"
    )
    cfg = load_config(path)
    assert (cfg.critic.ppo_epochs, cfg.critic.ppo_mini_batch_size) == (3, 8)
    assert cfg.trainer.default_local_dir == "ck/asyncrl/night"  # project_name: its default
    for value, says in [
        ("${nowhere.key}", "refers to a key this config does not have"),
        ("${eval:1+1}", "resolver 'eval' is not supported"),
        ("${oc.env:ASYNCRL_TEST_UNSET_VAR}", "which is not set"),
        ("${trainer.experiment_name}-x", "refers to itself"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(path, [f"trainer.experiment_name={value}"])
    cfg = load_config(path, ["trainer.experiment_name=${trainer.project_name}-x"])
    assert cfg.trainer.experiment_name == "asyncrl-x"


def test_home_in_path_keys_is_expanded(monkeypatch, tmp_path):
    """veRL's defaults write ``~/data/...``; no shell expands it inside a file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["data.train_files=[~/d/a.parquet,~/d/b.parquet]", "model.path=~/m"])
    assert cfg.data.train_files == [f"{tmp_path}/d/a.parquet", f"{tmp_path}/d/b.parquet"]
    assert cfg.model.path == f"{tmp_path}/m"
    assert load_config(None, ["trainer.project_name=~x"]).trainer.project_name == "~x"


def test_dapo_recipes_reward_kwargs_spelling_of_the_overlong_buffer(tmp_path):
    """veRL's DAPO/GSPO recipes pass the overlong penalty as reward_kwargs; max_resp_len
    must agree with data.max_response_length, from which the penalty counts here."""
    base = [
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
    ]
    cfg = load_config(
        "configs/cpu_demo.yaml",
        [*base, "data.max_response_length=8", "+reward_model.reward_kwargs.max_resp_len=8"],
    )
    ob = cfg.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor) == (True, 4, 0.5)
    with pytest.raises(ConfigError, match="give data.max_response_length the same value"):
        load_config(
            "configs/cpu_demo.yaml",
            [*base, "data.max_response_length=8", "+reward_model.reward_kwargs.max_resp_len=9"],
        )
    path = tmp_path / "dapo.yaml"
    path.write_text(
        "reward_model:\n  reward_kwargs:\n    overlong_buffer_cfg:\n      enable: true\n"
        "      len: 4\n      penalty_factor: 1.0\n"
    )
    assert load_config(path).reward.overlong_buffer.enable


def test_an_unknown_group_names_the_keys_given_under_it():
    with pytest.raises(ConfigError, match=re.escape("(given: my_group.a.b)")):
        load_config(None, ["my_group.a.b=1"])
    # Ray's own settings (veRL's ray_init / ray_kwargs) load, with no effect
    cfg = load_config(None, ["ray_init.num_cpus=8", "+ray_kwargs.ray_init.num_cpus=8"])
    assert cfg == load_config(None)


def test_a_verl_script_relying_on_verl_defaults_is_told_which_differ(caplog):
    """TinyZero's PPO script never sets algorithm.adv_estimator (veRL's default: gae):
    written for veRL from the ground up (no file of ours), the keys it leaves out whose
    default differs here are named in one warning; a config built on our file is not."""
    script = ["actor_rollout_ref.actor.optim.lr=1e-6", "data.train_batch_size=16"]
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        load_config(None, script)
    (line,) = [r.getMessage() for r in caplog.records if "written for veRL" in r.getMessage()]
    assert "algorithm.adv_estimator='grpo' (veRL: 'gae')" in line and "rollout.n=8" in line
    assert "actor.optim.lr" not in line and "train_batch_size" not in line  # given
    assert "trainer.device='cpu' (veRL: 'cuda')" in line  # the fix named first
    assert line.endswith("(e.g. trainer.device=cuda)")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        load_config("configs/cpu_demo.yaml", script)
        load_config(None, ["actor.optim.lr=1e-6"])  # our spelling: our defaults, no warning
    assert not [r for r in caplog.records if "written for veRL" in r.getMessage()]


def test_verl_global_micro_batches_are_divided_by_the_learner_ranks():
    """veRL's older ppo_micro_batch_size / log_prob_micro_batch_size count over all ranks
    (veRL divides them by the data-parallel size); the *_per_gpu keys are per rank."""
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=16",
            "critic.ppo_micro_batch_size=3",
            "trainer.n_gpus_per_node=2",
            "launch.ray.learner_nodes=2",
            "launch.backend=ray",
        ],
    )
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 2
    assert cfg.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 1  # 3 // 4, at least one
    one = load_config(None, ["actor_rollout_ref.actor.ppo_micro_batch_size=8"])
    assert one.actor.ppo_micro_batch_size_per_gpu == 8


def test_references_and_values_in_the_corners(tmp_path, monkeypatch):
    """A run name of digits stays text (YAML 1.1 read 0615 as octal 397); a rank count
    from the environment still divides the global micro-batch; a list referenced before its
    own key resolves whole; oc.env defaults read as OmegaConf reads them."""
    cfg = load_config(None, ["trainer.experiment_name=0615", "trainer.project_name=12:30"])
    assert (cfg.trainer.experiment_name, cfg.trainer.project_name) == ("0615", "12:30")
    # A number for a text key is the text typed: run 1.10 is not run 1.1 (whose folder
    # auto would resume); a number key still reads a number.
    for typed in ("1.10", "2.50", "100_000", "1e3"):
        cfg = load_config(None, [f"trainer.experiment_name={typed}", "actor.optim.lr=1e-5"])
        assert (cfg.trainer.experiment_name, cfg.actor.optim.lr) == (typed, 1e-5)
    monkeypatch.setenv("ASYNCRL_TEST_GPUS", "4")
    cfg = load_config(
        None,
        [
            "trainer.n_gpus_per_node=${oc.env:ASYNCRL_TEST_GPUS}",
            "actor_rollout_ref.actor.ppo_micro_batch_size=32",
        ],
    )
    assert (cfg.trainer.nproc, cfg.actor.ppo_micro_batch_size_per_gpu) == (4, 8)
    path = tmp_path / "c.yaml"
    path.write_text(
        "data:\n  train_files: ${data.val_files}\n"
        "  val_files: ['${trainer.project_name}/v.parquet']\n"
    )
    cfg = load_config(path)
    assert cfg.data.train_files == cfg.data.val_files == ["asyncrl/v.parquet"]
    unset = "ASYNCRL_TEST_UNSET_VAR"
    cfg = load_config(None, [f"trainer.experiment_name=${{oc.env:{unset},'abc'}}"])
    assert cfg.trainer.experiment_name == "abc"
    cfg = load_config(None, [f"trainer.resume_from_path=${{oc.env:{unset},null}}"])
    assert cfg.trainer.resume_from_path is None


def test_verls_default_local_dir_is_the_run_directory_not_a_root(tmp_path):
    """veRL's ``default_local_dir`` is ``checkpoints/${trainer.project_name}/
    ${trainer.experiment_name}``, the run's own folder; appended to again it would nest the
    run twice. A root (ours) still gets project/experiment under it."""
    verl = [
        "trainer.project_name=GRPO",
        "trainer.experiment_name=qwen_gsm8k",
        f"trainer.default_local_dir={tmp_path}/ckpt/${{trainer.project_name}}/${{trainer.experiment_name}}",
    ]
    cfg = load_config(None, verl)
    assert run_dir(cfg) == tmp_path / "ckpt" / "GRPO" / "qwen_gsm8k"
    assert run_dir(load_config(write_resolved(cfg))) == run_dir(cfg)  # a restarted role too
    root = load_config(None, [*verl[:2], f"trainer.default_local_dir={tmp_path}/runs"])
    assert run_dir(root) == tmp_path / "runs" / "GRPO" / "qwen_gsm8k"


def test_a_typo_in_verls_spelling_is_named_as_typed(tmp_path):
    """``actor_rollout_ref.rollout.temprature`` was reported as ``rollout.temprature``, a
    key the user never wrote; now the key and the suggestion keep the user's spelling, on
    the command line and in a file. Our own spelling is reported as ours."""

    def problems(path, overrides) -> list[str]:
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides)
        return e.value.problems

    assert problems(None, ["actor_rollout_ref.rollout.temprature=0.7"]) == [
        "unknown key actor_rollout_ref.rollout.temprature; "
        "did you mean actor_rollout_ref.rollout.temperature?"
    ]
    assert problems(None, ["custom_reward_function.nam=x"]) == [
        "unknown key custom_reward_function.nam; did you mean custom_reward_function.name?"
    ]
    assert problems(None, ["rollout.temprature=0.7"]) == [
        "unknown key rollout.temprature; did you mean rollout.temperature?"
    ]
    verl_file = tmp_path / "ppo.yaml"
    verl_file.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lrr: 1.0e-6\n")
    assert problems(verl_file, []) == [
        "unknown key actor_rollout_ref.actor.optim.lrr; "
        "did you mean actor_rollout_ref.actor.optim.lr?"
    ]
    # A misspelt group under veRL's prefix: named as typed (it was "unknown key
    # actor_rollout_ref; did you mean rollout?", or in a file a top-level "acotr").
    verl_file.write_text("actor_rollout_ref:\n  acotr:\n    optim:\n      lr: 1.0e-6\n")
    for path, overrides in [(verl_file, []), (None, ["actor_rollout_ref.acotr.optim.lr=1"])]:
        assert problems(path, overrides) == [
            "unknown key actor_rollout_ref.acotr; did you mean actor_rollout_ref.actor?"
        ]
    assert problems(None, ["actor_rollout_ref.actor.optimm.lr=1"]) == [
        "unknown key actor_rollout_ref.actor.optimm; did you mean actor_rollout_ref.actor.optim?"
        " (given: actor_rollout_ref.actor.optimm.lr)"
    ]
    assert load_config(None, ["actor_rollout_ref.hybrid_engine=true"]) is not None
