"""The buffer capacity rule follows when the learner acknowledges batches: at checkpoints
(``trainer.save_freq > 0``: the buffer holds the batches between two of them), or once
trained (``save_freq <= 0``: one batch). Either way, plus the groups admission lets the servers
produce meanwhile (``(max_policy_lag + 1) * sync_every`` batches)."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


def _capacity_problems(save_freq: int, capacity: int, sync_every: int = 1) -> list[str]:
    try:  # through load_config, as a user's config goes: every rule applies
        load_config(
            None,
            [
                "data.train_batch_size=4",
                "actor.ppo_mini_batch_size=4",
                "staleness.max_policy_lag=1",
                f"trainer.save_freq={save_freq}",
                f"buffer.capacity_groups={capacity}",
                f"staleness.sync_every={sync_every}",
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
    assert (
        "raise it to >= 12 (train_batch_size * (1 + (max_policy_lag + 1) * sync_every))" in problem
    )
    assert "save_freq" not in problem  # lowering it would not help
    # A buffer smaller than one batch never releases one: refused, not left to hang.
    assert _capacity_problems(save_freq, 3)


def test_with_checkpoints_the_batches_between_two_of_them():
    assert _capacity_problems(5, 4 * (5 + 1 + 1)) == []
    (problem,) = _capacity_problems(5, 4 * (5 + 1 + 1) - 1)
    assert (
        "raise it to >= 28 (train_batch_size * (save_freq + (max_policy_lag + 1) * sync_every))"
        in problem
    )
    assert "or lower trainer.save_freq" in problem


def test_a_version_of_several_steps_widens_the_window():
    """A push every sync_every steps: admission lets (max_policy_lag + 1) * sync_every
    batches out ahead of the current weights."""
    assert _capacity_problems(5, 4 * (5 + 2 * 3), sync_every=3) == []
    (problem,) = _capacity_problems(5, 4 * (5 + 2 * 3) - 1, sync_every=3)
    assert "raise it to >= 44" in problem


def test_a_buffer_of_the_rules_size_never_strands_the_last_groups():
    """The fault model's schedules (benchmarks/fault_model.py) with their faults taken out
    and the buffer at the rule's size: with a push every 2-3 steps, the rule without
    sync_every left the buffer full of training groups at the end of 23 of 46 of them, and
    the groups behind them (the final validation round's) unread. None now."""
    import dataclasses

    from asyncrl.config.rules import capacity_needed
    from benchmarks.fault_model import run, schedule_for
    from benchmarks.fault_world import config_for

    faults = {"lose", "dup", "delay", "kill_l", "start_l", "kill_b", "crash_s", "start_s"}
    faults |= {"mute", "unmute"}
    checked = 0
    for seed in range(120):
        sim = config_for(seed)
        # External slots open at the end are their own matter (still out, as the model
        # counts them once the faults that end them are gone).
        if sim.sync_every < 2 or sim.max_policy_lag < 1 or sim.slots:
            continue
        cfg = load_config(
            None,
            [
                f"data.train_batch_size={sim.batch}",
                f"actor.ppo_mini_batch_size={sim.batch}",
                f"staleness.max_policy_lag={sim.max_policy_lag}",
                f"staleness.sync_every={sim.sync_every}",
                f"trainer.save_freq={sim.save_freq}",
            ],
        )
        keep = [i for i, e in enumerate(schedule_for(seed)) if e[0] not in faults]
        out = run(seed, keep=keep, cfg=dataclasses.replace(sim, capacity=capacity_needed(cfg)))
        assert not out.invariants(), (seed, out.violations[:3])
        checked += 1
    assert checked >= 40


def test_verl_default_save_freq_loads_with_a_buffer_smaller_than_the_run():
    """veRL's save_freq=-1 (no checkpoint before the end): the buffer need not hold the
    run's groups (60 steps x 16 here), only one batch and the admission window."""
    from asyncrl.config.rules import capacity_needed

    cfg = load_config(None, ["trainer.save_freq=-1", "buffer.capacity_groups=64"])
    assert cfg.buffer.capacity_groups == 64
    assert capacity_needed(cfg) == 16 * (1 + (1 + 1) * 1)  # batch * (1 + (lag + 1) * sync)
    assert cfg.trainer.total_training_steps * cfg.data.train_batch_size == 960
    with pytest.raises(ConfigError, match="raise it to >= 48"):
        load_config(None, ["trainer.save_freq=-1", "buffer.capacity_groups=47"])
    # with our default save_freq (20), the same 64 groups are too few: the -1 is what lets it
    with pytest.raises(ConfigError, match="raise it to >= 352"):
        load_config(None, ["buffer.capacity_groups=64"])


def test_a_capacity_left_at_its_default_is_sized_for_the_run():
    """veRL's scripts train 1024 prompts a step and checkpoint every 20 or 100 steps: the
    buffer left at its default holds what that needs; one given by the user is checked."""
    cfg = load_config(None, ["data.train_batch_size=1024", "trainer.save_freq=20"])
    assert cfg.buffer.capacity_groups == 1024 * (20 + 1 + 1)  # sync_every=1
    assert load_config(None, ["trainer.save_freq=-1"]).buffer.capacity_groups == 1024
    with pytest.raises(ConfigError, match="raise it to >= 22528"):
        load_config(
            None,
            ["data.train_batch_size=1024", "trainer.save_freq=20", "buffer.capacity_groups=2048"],
        )
