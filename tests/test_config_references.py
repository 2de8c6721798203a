"""``${...}`` references read the value the run will use: veRL's mapped keys
(``actor_rollout_ref.rollout.response_length``, ``trainer.n_gpus_per_node``) are decided
before references resolve, in both directions, and OmegaConf's empty resolver default is
the empty text."""

from __future__ import annotations

import logging

import pytest

from asyncrl.config import load_config


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR)  # the veRL-defaults warning is not what is tested


def test_a_reference_to_our_key_reads_the_verl_key_that_sets_it(tmp_path):
    """``${data.max_response_length}`` read the file's (or the default) value, while
    veRL's ``response_length`` set another: the run's name said 8, the run used 64."""
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n    response_length: 64\n"
        "trainer:\n  experiment_name: len${data.max_response_length}\n"
    )
    cfg = load_config(path)
    assert (cfg.data.max_response_length, cfg.trainer.experiment_name) == (64, "len64")
    cfg = load_config(
        None, ["trainer.n_gpus_per_node=4", "trainer.experiment_name=g${trainer.nproc}"]
    )
    assert (cfg.trainer.nproc, cfg.trainer.experiment_name) == (4, "g4")
    # the command line's veRL key wins over the file's own key, and so does its reference
    path.write_text(
        "data:\n  max_response_length: 48\ntrainer:\n  experiment_name: r${data.max_response_length}\n"
    )
    cfg = load_config(path, ["actor_rollout_ref.rollout.response_length=16"])
    assert (cfg.data.max_response_length, cfg.trainer.experiment_name) == (16, "r16")
    # a global micro-batch reads divided over the ranks, as the run has it
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=32",
            "trainer.n_gpus_per_node=4",
            "trainer.experiment_name=m${actor.ppo_micro_batch_size_per_gpu}",
        ],
    )
    assert (cfg.actor.ppo_micro_batch_size_per_gpu, cfg.trainer.experiment_name) == (8, "m8")
    # DAPO's max_resp_len refers to the response length the run uses: accepted
    path.write_text(
        "data:\n  max_response_length: 16\n"
        "reward_model:\n  reward_kwargs:\n    max_resp_len: ${data.max_response_length}\n"
    )
    assert (
        load_config(path, ["actor_rollout_ref.rollout.response_length=32"]).data.max_response_length
        == 32
    )


def test_a_reference_to_a_verl_name_reads_our_key():
    """``${trainer.n_gpus_per_node}`` failed ("refers to a key this config does not have")
    when the config set ``trainer.nproc`` or neither; it reads the run's rank count."""
    cfg = load_config(
        None, ["trainer.nproc=4", "trainer.experiment_name=g${trainer.n_gpus_per_node}"]
    )
    assert cfg.trainer.experiment_name == "g4"
    cfg = load_config(None, ["trainer.experiment_name=g${trainer.n_gpus_per_node}"])
    assert cfg.trainer.experiment_name == f"g{cfg.trainer.nproc}"
    cfg = load_config(
        None,
        [
            "data.max_response_length=24",
            "trainer.experiment_name=${actor_rollout_ref.rollout.response_length}",
        ],
    )
    assert cfg.trainer.experiment_name == "24"


def test_references_between_a_verl_key_and_ours_are_no_cycle(tmp_path):
    """veRL's own yaml writes ``response_length: ${oc.select:data.max_response_length,512}``:
    it reads data's own value (given or the default), not itself; and our key written as a
    reference to veRL's reads veRL's value."""
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n"
        "    response_length: ${oc.select:data.max_response_length,512}\n"
    )
    default = load_config(None).data.max_response_length
    assert load_config(path).data.max_response_length == default
    assert load_config(path, ["data.max_response_length=48"]).data.max_response_length == 48
    path.write_text(
        "data:\n  max_response_length: ${actor_rollout_ref.rollout.response_length}\n"
        "actor_rollout_ref:\n  rollout:\n    response_length: 64\n"
    )
    assert load_config(path).data.max_response_length == 64
    cfg = load_config(
        None,
        [
            "data.max_response_length=40",
            "actor_rollout_ref.rollout.response_length=${data.max_response_length}",
        ],
    )
    assert cfg.data.max_response_length == 40
    # veRL's global micro-batch written as the per-GPU one: divided once, and read so
    path.write_text("actor:\n  ppo_micro_batch_size_per_gpu: 8\n")
    cfg = load_config(
        path,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=${actor.ppo_micro_batch_size_per_gpu}",
            "trainer.nproc=2",
            "trainer.experiment_name=m${actor.ppo_micro_batch_size_per_gpu}",
        ],
    )
    assert (cfg.actor.ppo_micro_batch_size_per_gpu, cfg.trainer.experiment_name) == (4, "m4")


def test_a_relative_reference_is_relative_to_its_own_key(tmp_path):
    """OmegaConf reads ``${.x}`` from the group of the key that holds it, also when that key
    is read through another reference (it was read from the referring key's group)."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "trainer:\n  experiment_name: x${data.max_response_length}\n"
        "data:\n  max_prompt_length: 10\n  max_response_length: ${.max_prompt_length}\n"
    )
    assert load_config(path).trainer.experiment_name == "x10"


def test_an_empty_resolver_default_is_the_empty_text(monkeypatch):
    """OmegaConf reads ``${oc.env:X,}`` and ``${oc.env:X,''}`` as ``''``; here they were
    None, which text formats as ``None``."""
    monkeypatch.delenv("ASYNCRL_TEST_UNSET_VAR", raising=False)
    for text, want in [
        ("${oc.env:ASYNCRL_TEST_UNSET_VAR,}", ""),
        ("${oc.env:ASYNCRL_TEST_UNSET_VAR,''}", ""),
        ("a${oc.env:ASYNCRL_TEST_UNSET_VAR,}b", "ab"),
        ("${oc.select:nowhere.key,}", ""),
        ("${oc.env:ASYNCRL_TEST_UNSET_VAR,'1'}", "1"),
        ("${oc.env:ASYNCRL_TEST_UNSET_VAR,null}", None),
    ]:
        cfg = load_config(None, [f"trainer.resume_from_path={text}"])
        assert cfg.trainer.resume_from_path == want, text


def test_a_null_or_text_global_micro_batch_reads_as_the_run_has_it(monkeypatch):
    """A review of the references' fix: veRL's global micro-batch at null sets nothing, so
    a reference to ours reads our own value (it read None), and one given as text (an
    environment variable) is divided over the ranks as a number is (it was not)."""
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=${oc.select:nope,null}",
            "trainer.experiment_name=m${actor.ppo_micro_batch_size_per_gpu}",
        ],
    )
    assert cfg.trainer.experiment_name == f"m{cfg.actor.ppo_micro_batch_size_per_gpu}"
    monkeypatch.setenv("ASYNCRL_TEST_MB", "32")
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size=${oc.env:ASYNCRL_TEST_MB}",
            "trainer.n_gpus_per_node=4",
        ],
    )
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 8
