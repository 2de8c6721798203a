"""The buffer capacity rule follows when the learner acknowledges batches: at checkpoints
(``trainer.save_freq > 0``: the buffer holds the batches between two of them), or once
trained (``save_freq <= 0``: one batch). Either way, plus the groups admission lets the servers
produce meanwhile (``max_policy_lag + 1`` batches)."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


def _capacity_problems(save_freq: int, capacity: int) -> list[str]:
    try:  # through load_config, as a user's config goes: every rule applies
        load_config(
            None,
            [
                "data.train_batch_size=4",
                "actor.ppo_mini_batch_size=4",
                "staleness.max_policy_lag=1",
                f"trainer.save_freq={save_freq}",
                f"buffer.capacity_groups={capacity}",
            ],
        )
    except ConfigError as e:
        return [p for p in e.problems if p.startswith("buffer.capacity_groups")]
    return []


@pytest.mark.parametrize("save_freq", [-1, 0])
def test_without_intermediate_checkpoints_one_batch_plus_the_admission_window(save_freq):
    # 4 * (1 + 1 + 1): the batch in training and max_policy_lag + 1 admitted batches. Far
    # below what a run of many steps trains on: nothing waits for the end of the run.
    assert _capacity_problems(save_freq, 12) == []
    (problem,) = _capacity_problems(save_freq, 11)
    assert "raise it to >= 12 (train_batch_size * (max_policy_lag + 2))" in problem
    assert "save_freq" not in problem  # lowering it would not help
    # A buffer smaller than one batch never releases one: refused, not left to hang.
    assert _capacity_problems(save_freq, 3)


def test_with_checkpoints_the_batches_between_two_of_them():
    assert _capacity_problems(5, 4 * (5 + 1 + 1)) == []
    (problem,) = _capacity_problems(5, 4 * (5 + 1 + 1) - 1)
    assert "raise it to >= 28 (train_batch_size * (save_freq + max_policy_lag + 1))" in problem
    assert "or lower trainer.save_freq" in problem


def test_verl_default_save_freq_loads_with_a_buffer_smaller_than_the_run():
    cfg = load_config(None, ["trainer.save_freq=-1", "buffer.capacity_groups=64"])
    assert cfg.buffer.capacity_groups < cfg.trainer.total_training_steps * cfg.data.train_batch_size


def test_a_capacity_left_at_its_default_is_sized_for_the_run():
    """veRL's scripts train 1024 prompts a step and checkpoint every 20 or 100 steps: the
    buffer left at its default holds what that needs; one given by the user is checked."""
    cfg = load_config(None, ["data.train_batch_size=1024", "trainer.save_freq=20"])
    assert cfg.buffer.capacity_groups == 1024 * (20 + 1 + 1)
    assert load_config(None, ["trainer.save_freq=-1"]).buffer.capacity_groups == 1024
    with pytest.raises(ConfigError, match="raise it to >= 22528"):
        load_config(
            None,
            ["data.train_batch_size=1024", "trainer.save_freq=20", "buffer.capacity_groups=2048"],
        )
