"""Config files read as the command line reads its values (Hydra's YAML), and the refusals
of a file or a ``~key`` that cannot be what the user meant: each through the real loader."""

from __future__ import annotations

import pytest

from asyncrl.cli import parse_role_args
from asyncrl.config import load_config
from tests.helpers import config_problems, write_config


def test_file_reads_exponents_as_floats_like_the_command_line(tmp_path):
    path = write_config(
        tmp_path,
        "model:\n  override_config: {rope_theta: 1e6, rms_norm_eps: 1e-6}\n"
        "actor:\n  optim:\n    lr: 5e-7\n"
        "custom_reward_function:\n  reward_kwargs: {scale: 1e-3, tag: '1e-3'}\n",
    )
    cfg = load_config(path)
    assert cfg.model.override_config == {"rope_theta": 1e6, "rms_norm_eps": 1e-6}
    assert cfg.actor.optim.lr == 5e-7
    assert cfg.reward.custom_reward_function.reward_kwargs == {"scale": 1e-3, "tag": "1e-3"}
    line = load_config(None, ["model.override_config={rope_theta: 1e6, rms_norm_eps: 1e-6}"])
    assert line.model.override_config == cfg.model.override_config


@pytest.mark.parametrize("written", ["2025-01-20", "0615", "1.10", "off", "20250120"])
def test_file_text_key_is_read_as_written(tmp_path, written):
    """A date, a leading zero, a version, ``off``, a number: the run's name as typed, as the
    command line reads it (YAML 1.1 reads a date, octal 397, 1.1 and false)."""
    assert load_config(None, [f"trainer.experiment_name={written}"]).trainer.experiment_name == (
        written
    )
    path = write_config(tmp_path, f"trainer:\n  experiment_name: {written}\n")
    assert load_config(path).trainer.experiment_name == written


@pytest.mark.parametrize(("written", "read"), [("off", False), ("yes", True), ("True", True)])
def test_file_boolean_key_reads_words_as_hydra_does(tmp_path, written, read):
    path = write_config(tmp_path, f"algorithm:\n  filter_groups:\n    enable: {written}\n")
    assert load_config(path).algorithm.filter_groups.enable is read


def test_file_integer_key_reads_decimal(tmp_path):
    path = write_config(tmp_path, "rollout:\n  n: 012\n")
    assert load_config(path).rollout.n == 12  # not octal 10


@pytest.mark.parametrize(
    ("text", "key", "line", "first"),
    [
        ("rollout:\n  n: 4\n  n: 2\n", "rollout.n", 3, 2),
        ("rollout:\n  n: 4\ntrainer:\n  nproc: 1\nrollout:\n  temperature: 0.7\n", "rollout", 5, 1),
    ],
)
def test_file_key_given_twice_is_refused(tmp_path, text, key, line, first):
    """YAML keeps the last of two keys silently: a group written twice lost its first
    block. Refused, as OmegaConf refuses it, in one line naming the key and both lines."""
    path = write_config(tmp_path, text)
    (problem,) = config_problems(path)
    assert f"{path} line {line}: {key} is given twice (first at line {first})" in problem
    assert "\n" not in problem


def test_override_key_given_twice_is_refused():
    (problem,) = config_problems(None, ["actor.optim={lr: 1e-5, lr: 2e-5}"])
    assert "gives lr twice" in problem


@pytest.mark.parametrize(
    ("override", "read"),
    [
        ('trainer.experiment_name="1e-5"', "1e-5"),
        ("trainer.experiment_name='2e3'", "2e3"),
        ("trainer.experiment_name=2e3", "2e3"),  # unquoted, for a text key: as typed
    ],
)
def test_quoted_exponent_override_is_text(override, read):
    assert load_config(None, [override]).trainer.experiment_name == read


def test_quoted_exponent_in_a_mapping_is_text():
    cfg = load_config(None, ["custom_reward_function.reward_kwargs={tag: '1e-3', scale: 1e-3}"])
    assert cfg.reward.custom_reward_function.reward_kwargs == {"tag": "1e-3", "scale": 1e-3}


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("~rollout.temprature", "did you mean ~rollout.temperature?"),
        ("~trainer.loger", "did you mean ~trainer.logger?"),
        ("~actor_rollout_ref.actor.optim.lrr", "did you mean ~actor.optim.lr?"),
    ],
)
def test_delete_of_a_key_that_does_not_exist_is_refused(override, hint):
    (problem,) = config_problems(None, [override])
    assert f"could not delete {override[1:]}, it does not exist; {hint}" in problem


@pytest.mark.parametrize(
    "override",
    [
        "~trainer.logger",
        "~rollout.val_kwargs",
        "~actor_rollout_ref.actor.optim.lr",
        "~actor_rollout_ref.actor.fsdp_config.param_offload",
        "~model.override_config.x",
    ],
)
def test_delete_of_a_known_key_loads(override):
    load_config(None, [override])


def test_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("trainer:\n  experiment_name: café\n".encode("latin-1"))
    (problem,) = config_problems(path)
    assert problem == f"{path} is not UTF-8 text (line 2: byte 0xe9); save it as UTF-8"


def test_directory_given_as_config_is_refused(tmp_path):
    write_config(tmp_path, "rollout:\n  n: 4\n", "a.yaml")
    (problem,) = config_problems(tmp_path)
    assert problem.startswith(f"config {tmp_path} is a directory; pass a YAML file")
    assert f"{tmp_path / 'a.yaml'}" in problem


def test_no_arguments_asks_for_a_config(capsys):
    with pytest.raises(SystemExit) as info:
        parse_role_args("asyncrl-launch", "", None, [])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "give a config file (e.g. configs/cpu_demo.yaml) or key=value overrides" in err
    assert "arguments are required" not in err  # argparse named both, overrides too


def test_delete_with_a_value_deletes_only_that_value(tmp_path):
    """Hydra's ``~key=value`` deletes the key only when it holds that value, else refuses:
    it deleted the key whatever the value, and a stale recipe line went unnoticed."""
    path = write_config(tmp_path, "actor_rollout_ref:\n  actor:\n    clip_ratio_high: 0.31\n")
    key = "actor_rollout_ref.actor.clip_ratio_high"
    default = load_config(None, []).actor.clip_ratio_high
    assert load_config(path, [f"~{key}=0.31"]).actor.clip_ratio_high == default != 0.31
    (problem,) = config_problems(path, [f"~{key}=0.3"])
    assert f"~{key}=0.3: {key} is 0.31, not 0.3; write ~{key} to delete it" in problem


def test_a_command_line_may_start_with_a_delete(tmp_path):
    """``~key`` first on a command line of overrides alone is an override, not the config
    file (it was: "config file ~trainer.logger not found")."""
    cfg, args = parse_role_args("asyncrl-launch", "", None, ["~trainer.logger", "rollout.n=4"])
    assert args.config is None and cfg.rollout.n == 4


def test_hydras_config_flags_say_to_pass_the_yaml(capsys):
    """veRL's recipe scripts pass ``--config-path``/``--config-name``: one line says what to
    do instead of argparse's "unrecognized arguments"."""
    with pytest.raises(SystemExit) as info:
        parse_role_args(
            "asyncrl-launch", "", None, ["--config-path=config", "--config-name=ppo", "rollout.n=4"]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Hydra's config search is not used here; pass the recipe's YAML" in err, err


def test_a_whole_verl_group_on_the_command_line_is_read_as_in_a_file(tmp_path):
    """``actor_rollout_ref={rollout: {n: 4}}`` merges as Hydra merges it, as the file's
    group does (it was refused: "unknown key actor_rollout_ref.rollout.n"); a misspelt
    group inside it is still named."""
    path = write_config(tmp_path, "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 2.0e-6\n")
    cfg = load_config(path, ["actor_rollout_ref={rollout: {n: 4}, actor: {ppo_epochs: 2}}"])
    assert (cfg.rollout.n, cfg.actor.ppo_epochs, cfg.actor.optim.lr) == (4, 2, 2e-6)
    (problem,) = config_problems(None, ["actor_rollout_ref={rollot: {n: 4}}"])
    assert "did you mean actor_rollout_ref.rollout?" in problem, problem
