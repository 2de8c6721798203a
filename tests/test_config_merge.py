"""Config: mappings merge as Hydra merges them, in a file (our spelling beside veRL's) and
on the command line; Hydra's ``{k:v}``; empty and non-mapping groups."""

from __future__ import annotations

import logging

import pytest
import yaml

from asyncrl.config import load_config, parse_override
from tests.helpers import config_problems, write_config

# ---------------------------------------------------------------- 1. mappings merge


@pytest.mark.parametrize("key", ["actor.optim", "actor_rollout_ref.actor.optim"])
def test_override_mapping_merges_into_the_files_group(key):
    cfg = load_config("configs/cpu_demo.yaml", [f"{key}={{weight_decay: 0.1}}"])
    assert cfg.actor.optim.weight_decay == 0.1
    assert cfg.actor.optim.lr == 6e-4  # the file's, kept
    assert cfg.actor.optim.lr_warmup_steps == 10


def test_override_mapping_merges_nested_groups():
    cfg = load_config(
        "configs/cpu_demo.yaml", ["actor={optim: {weight_decay: 0.1}, clip_ratio_c: 4.0}"]
    )
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay) == (6e-4, 0.1)
    assert cfg.actor.clip_ratio_c == 4.0
    assert cfg.actor.clip_ratio_high == 0.28  # the file's, kept


@pytest.mark.parametrize("group", ["rollout", "actor_rollout_ref.rollout"])
def test_mapping_on_the_command_line_wins_over_the_files_target(tmp_path, group):
    # Only the keys in the mapping were given on the command line: the file's
    # rollout.max_inflight beside them is the file's, so veRL's mapped key replaces it.
    path = write_config(tmp_path, "rollout:\n  max_inflight: 5\n  n: 4\n")
    cfg = load_config(path, [f"{group}={{max_num_seqs: 6}}"])
    assert (cfg.rollout.max_inflight, cfg.rollout.n) == (6, 4)


def test_a_key_of_a_mapping_given_twice_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.config.load"):
        cfg = load_config(None, ["rollout.n=2", "rollout={n: 3}"])
    assert cfg.rollout.n == 3
    assert "rollout.n is given twice on the command line: the last, 3, wins" in caplog.text


MIXED = """\
actor:
  optim: {lr: 1.0e-5, lr_warmup_steps: 10}
  clip_ratio_c: 10.0
rollout:
  val_kwargs: {temperature: 0.6, n: 16}
actor_rollout_ref:
  actor:
    optim: {weight_decay: 0.1, lr: 1.0e-5}
  rollout:
    val_kwargs: {top_p: 0.9}
"""


def test_file_merges_verl_groups_into_ours_key_by_key(tmp_path):
    cfg = load_config(write_config(tmp_path, MIXED))
    assert cfg.actor.optim.lr == 1e-5  # given in both spellings, at one value
    assert (cfg.actor.optim.weight_decay, cfg.actor.optim.lr_warmup_steps) == (0.1, 10)
    assert cfg.actor.clip_ratio_c == 10.0
    val = cfg.rollout.val_kwargs
    assert (val.temperature, val.n, val.top_p) == (0.6, 16, 0.9)


def test_one_key_in_two_spellings_with_two_values_is_refused(tmp_path):
    text = MIXED.replace("lr: 1.0e-5}\n  rollout", "lr: 3.0e-6}\n  rollout")
    text = text.replace("{top_p: 0.9}", "{top_p: 0.9, n: 4}")
    problems = config_problems(write_config(tmp_path, text))
    assert problems == [
        "actor.optim.lr=1e-05 and actor_rollout_ref.actor.optim.lr=3e-06 are one key in two "
        "spellings, with different values: keep one of them",
        "rollout.val_kwargs.n=16 and actor_rollout_ref.rollout.val_kwargs.n=4 are one key in "
        "two spellings, with different values: keep one of them",
    ]


def test_reward_groups_merge_across_spellings(tmp_path):
    text = yaml.safe_dump(
        {
            "reward": {
                "overlong_buffer": {"enable": True},
                "custom_reward_function": {"name": "mine"},
            },
            "custom_reward_function": {"path": "score.py", "overlong_buffer": {"len": 4}},
            "reward_model": {"overlong_buffer": {"penalty_factor": 1.0}},
        }
    )
    reward = load_config(write_config(tmp_path, text)).reward
    assert (reward.custom_reward_function.path, reward.custom_reward_function.name) == (
        "score.py",
        "mine",
    )
    buffer = reward.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 4, 1.0)
    clash = text.replace("penalty_factor: 1.0", "len: 8")
    assert config_problems(write_config(tmp_path, clash)) == [
        "reward.overlong_buffer.len=4 and reward_model.overlong_buffer.len=8 are one key in "
        "two spellings, with different values: keep one of them"
    ]


# ------------------------------------------------------------ 2. Hydra's {k:v}


def test_hydra_flow_mapping_without_spaces():
    cfg = load_config(
        "configs/cpu_demo.yaml",
        [
            "+actor_rollout_ref.model.override_config={attention_dropout:0.0,embd_pdrop:0.0}",
            "custom_reward_function.reward_kwargs={scale:0.5}",
        ],
    )
    assert cfg.model.override_config == {"attention_dropout": 0.0, "embd_pdrop": 0.0}
    assert cfg.reward.custom_reward_function.reward_kwargs == {"scale": 0.5}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("{url:http://host:80/x}", {"url": "http://host:80/x"}),  # a colon in a value stays
        ("{url:'http://host:80'}", {"url": "http://host:80"}),
        ('{"a:b":1, c:"x:y"}', {"a:b": 1, "c": "x:y"}),  # quoted: as written
        ("{a:'it''s:x',b:1}", {"a": "it's:x", "b": 1}),  # YAML's '' inside single quotes
        (
            "{a:{b:1,c:[1,2]},d:[{e:1},{f:x:y}]}",
            {"a": {"b": 1, "c": [1, 2]}, "d": [{"e": 1}, {"f": "x:y"}]},
        ),
        ("[a:1,{b:2}]", ["a:1", {"b": 2}]),  # an item of a list is a value, not a key
        ("{a: 1, b :2}", {"a": 1, "b": 2}),  # spaced already
        ("{eps:1e-5,l:[1e-3]}", {"eps": 1e-5, "l": [1e-3]}),  # floats as Hydra reads them
    ],
)
def test_hydra_flow_values(text, value):
    assert parse_override(f"k={text}") == ("k", value)


def test_a_quoted_value_is_text():
    assert parse_override("k='{a:1}'") == ("k", "{a:1}")


# ------------------------------------------------- 3. empty and non-mapping groups


@pytest.mark.parametrize(
    ("text", "clip_ratio_c"),
    [
        ("actor:\nactor_rollout_ref:\n  actor:\n    clip_ratio_c: 4.5\n", 4.5),
        ("actor:\n  clip_ratio_c: 4.5\nactor_rollout_ref:\n  actor:\n", 4.5),
        ("actor:\ntrainer:\n  total_training_steps: 5\n", 3.0),  # no veRL group: the same
    ],
)
def test_an_empty_group_is_an_empty_mapping(tmp_path, text, clip_ratio_c):
    assert load_config(write_config(tmp_path, text)).actor.clip_ratio_c == clip_ratio_c


def test_an_empty_reward_group_beside_custom_reward_function(tmp_path):
    path = write_config(tmp_path, "reward:\ncustom_reward_function:\n  name: mine\n")
    assert load_config(path).reward.custom_reward_function.name == "mine"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "custom_reward_function: [a]\n",
            "custom_reward_function must be a mapping of keys, not list",
        ),
        (
            "reward: 5\ncustom_reward_function:\n  path: null\n",
            "reward must be a mapping of keys, not int",
        ),
        (
            "actor: [1]\nactor_rollout_ref:\n  actor: {clip_ratio_c: 3.0}\n",
            "actor must be a mapping of keys, not list",
        ),
        ("actor_rollout_ref: 3\n", "actor_rollout_ref must be a mapping of keys, not int"),
        (
            "actor_rollout_ref:\n  actor: 3\n",
            "actor_rollout_ref.actor must be a mapping of keys, not int",
        ),
        (
            "custom_reward_function:\n  overlong_buffer: on\n",  # `on` is text, as in Hydra
            "custom_reward_function.overlong_buffer must be a mapping of keys, not str",
        ),
        (
            "reward: {custom_reward_function: x}\ncustom_reward_function: {name: a}\n",
            "reward.custom_reward_function must be a mapping of keys, not str",
        ),
    ],
)
def test_a_non_mapping_group_is_refused_in_one_line(tmp_path, text, problem):
    assert config_problems(write_config(tmp_path, text)) == [problem]


# ------------------------------------------------ 4. words that YAML 1.1 reads as booleans


def test_off_and_yes_are_text_for_a_text_key_and_booleans_for_a_bool_key():
    cfg = load_config(
        "configs/cpu_demo.yaml",
        ["trainer.experiment_name=off", "algorithm.filter_groups.enable=yes"],
    )
    assert cfg.trainer.experiment_name == "off"
    assert cfg.algorithm.filter_groups.enable is True
