"""Slips the loader refuses, each in one line naming the key as typed: a key of none of
veRL's groups under one that is none of ours, and a boolean given for a number."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


def _problems(path, overrides) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return e.value.problems


def test_an_unknown_key_under_a_verl_group_is_named_as_typed(tmp_path):
    """The schema named the veRL group, with our keys beside it: "unknown key
    actor_rollout_ref.actor.checkpoint; valid keys in actor: ...", or "unknown key
    reward_model; did you mean reward?", never the key the user wrote."""
    assert _problems(None, ["actor_rollout_ref.actor.checkpoint.save_contnts=[model]"]) == [
        "unknown key actor_rollout_ref.actor.checkpoint.save_contnts; "
        "did you mean actor_rollout_ref.actor.checkpoint.save_contents?"
    ]
    assert _problems(None, ["reward_model.sandbox_fusion.bogus=1"]) == [
        "unknown key reward_model.sandbox_fusion.bogus; veRL's reward_model.sandbox_fusion "
        "holds max_concurrent, memory_limit_mb, url"
    ]
    assert _problems(None, ["reward_model.enabel=false"]) == [
        "unknown key reward_model.enabel; did you mean reward_model.enable?"
    ]
    # in a file, with another problem the schema names beside it
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n    trace:\n      backnd: weave\n"
        "    val_kwargs:\n      tmp: 1\n"
    )
    assert _problems(path, []) == [
        "unknown key actor_rollout_ref.rollout.trace.backnd; "
        "did you mean actor_rollout_ref.rollout.trace.backend?",
        "unknown key actor_rollout_ref.rollout.val_kwargs.tmp; "
        "did you mean actor_rollout_ref.rollout.val_kwargs.top_p?",
    ]
    # veRL's own keys there still load, and reward_kwargs keeps its own explanation
    assert load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[model]"])
    assert (
        "custom_reward_function.reward_kwargs"
        in _problems(None, ["reward_model.reward_kwargs.alpha=2"])[0]
    )


@pytest.mark.parametrize(
    "override",
    [
        "rollout.n=true",
        "rollout.n=false",
        "actor.optim.lr=true",
        "trainer.total_training_steps=true",
    ],
)
def test_a_boolean_for_a_number_is_refused(override):
    """``rollout.n=true`` ran with n=1 (pydantic reads true as 1); OmegaConf refuses it."""
    key = override.split("=")[0]
    got = override.split("=")[1].capitalize()
    assert _problems(None, [override, "algorithm.adv_estimator=gae"]) == [
        f"{key}: true or false is not a number; give a number (got {got})"
    ]


def test_a_number_for_a_switch_and_text_for_a_number_still_read():
    cfg = load_config(None, ["data.shuffle=0", "rollout.n=4", "trainer.total_training_steps=null"])
    assert (cfg.data.shuffle, cfg.rollout.n, cfg.trainer.total_training_steps) == (False, 4, None)


def test_an_endpoint_serving_a_network_without_authentication_is_refused_at_load():
    """Found by a review: ``rollout.openai_endpoint.host`` off loopback without
    ``endpoints.insecure`` was refused by the rollout server after its engine had loaded
    (minutes on a GPU), and the engine and reward workers were left to the exit. It is
    refused with the config now, as ``endpoints.host`` is."""
    base = ["rollout.openai_endpoint.enable=true", "rollout.openai_endpoint.host=0.0.0.0"]
    with pytest.raises(ConfigError, match="rollout.openai_endpoint.host=0.0.0.0 serves a network"):
        load_config(None, base)
    assert load_config(None, [*base, "endpoints.insecure=true"]).endpoints.insecure
    local = ["rollout.openai_endpoint.enable=true", "rollout.openai_endpoint.host=127.0.0.1"]
    assert load_config(None, local).rollout.openai_endpoint.enable
    assert load_config(None, ["rollout.openai_endpoint.host=0.0.0.0"])  # off: not served
