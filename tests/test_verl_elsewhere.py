"""veRL keys of other veRL versions than the table's get their own fix, not difflib's
nearest name (which pointed ``multi_turn.max_turns`` at ``max_user_turns`` and
``tis_imp_ratio_cap`` at ``clip_ratio_c``); a validator's message keeps its words' case and
names the key as the user wrote it."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.verl_elsewhere import ELSEWHERE

BASE = ["actor_rollout_ref.actor.ppo_mini_batch_size=8"]


@pytest.mark.parametrize(
    ("given", "fix", "not_said"),
    [
        (
            "actor_rollout_ref.rollout.multi_turn.max_turns=5",
            "use actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
            "max_user_turns",
        ),
        (
            "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
            "algorithm.importance.mode=tis with algorithm.importance.cap=",
            "clip_ratio_c",
        ),
        (
            "actor_rollout_ref.rollout.quantization=fp8",
            "quantized rollout is not built here: remove the key",
            "gpu_memory_utilization",
        ),
        (
            "actor_rollout_ref.actor.use_gpg_loss=true",
            "GPG's loss is not built here",
            "use_kl_loss",
        ),
        (
            "actor_rollout_ref.actor.optim.clip_grad=1.0",
            "name of actor_rollout_ref.actor.grad_clip",
            "valid keys in",
        ),
        (  # a review: at veRL's default it read "did you mean data.train_files?"
            "data.train_max_samples=-1",
            "remove the key (at its default, -1, veRL reads every row, as here)",
            "did you mean",
        ),
    ],
)
def test_another_verl_versions_key_is_refused_with_its_own_fix(given, fix, not_said):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, given])
    (line,) = err.value.problems
    key = given.split("=")[0]
    assert line.startswith(f"unknown key {key}; ") and fix in line, line
    assert not_said not in line, line


def test_every_key_of_another_version_is_unknown_here():
    """A key the table (or the schema) knows must not be in the list: its fix would hide
    what the key does here."""
    for key in ELSEWHERE:
        with pytest.raises(ConfigError, match="unknown key"):
            load_config(None, [f"{key}=1"])


def test_a_validators_message_keeps_its_case_and_the_users_spelling():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, "reward_model.reward_manager=batch"])
    (line,) = err.value.problems
    assert line.startswith("reward_model.reward_manager: batch-level managers are not built")
    assert "extra_info=None" in line and "value error" not in line.lower(), line
