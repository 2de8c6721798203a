"""A resume that changes a setting since its checkpoint (a batch size, the group size, the
learning rate, the model) goes on under the new value and says so in one line: in the
launcher's output before any role starts, and in the learner's log at the load. A review
found a resume after changing ``data.train_batch_size``, ``rollout.n`` or ``model.path``
said nothing."""

from __future__ import annotations

import json
import logging

from asyncrl.config import load_config, run_dir
from asyncrl.config.inputs import STATE_FILE
from asyncrl.config.resumed import (
    COMPARED,
    SCHEDULE,
    changed_line,
    changed_settings,
    launch_line,
    settings_of,
)


def _save_state(cfg, step: int, settings: dict | None) -> None:
    folder = run_dir(cfg) / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    extra = {} if settings is None else {"settings": settings}
    (folder / STATE_FILE).write_text(json.dumps({"step": step, "extra": extra}))


def test_the_changed_settings_are_named_with_both_values(tmp_path):
    before = load_config(None, [f"trainer.default_local_dir={tmp_path}"])
    saved = json.loads(json.dumps(settings_of(before)))  # as the state file keeps them
    assert set(saved) == set(COMPARED) | set(SCHEDULE)  # the schedule's: tests/test_resume_schedule
    assert changed_settings(saved, before) == []
    after = load_config(
        None,
        [
            f"trainer.default_local_dir={tmp_path}",
            "data.train_batch_size=32",
            "actor_rollout_ref.rollout.n=4",  # veRL's spelling of rollout.n
            "trainer.total_training_steps=500",  # extending a run is not a change
        ],
    )
    changes = changed_settings(saved, after)
    assert changes == [
        f"data.train_batch_size {before.data.train_batch_size} -> 32",
        f"rollout.n {before.rollout.n} -> 4",
    ]
    line = changed_line(changes, 40)
    assert line is not None and line.startswith("resuming step 40 with settings changed")
    assert "trainer.resume_mode=disable" in line
    assert changed_settings(None, after) == []  # a checkpoint from before they were kept
    assert changed_line([], 40) is None


def test_the_launcher_says_it_before_any_role_starts(tmp_path):
    base = [f"trainer.default_local_dir={tmp_path}"]
    cfg = load_config(None, base)
    assert launch_line(cfg) is None  # nothing to resume
    _save_state(cfg, 10, None)
    assert launch_line(cfg) is None  # a checkpoint that kept no settings
    _save_state(cfg, 20, settings_of(cfg))
    assert launch_line(cfg) is None
    moved = load_config(None, [*base, "model.path=elsewhere/tiny"])
    assert launch_line(moved) == changed_line(
        [f"model.path {cfg.model.path} -> elsewhere/tiny"], 20
    )
    assert launch_line(load_config(None, [*base, "trainer.resume_mode=disable"])) is None


def test_the_learner_says_it_when_it_loads_the_checkpoint(tmp_path, caplog):
    """Through :func:`learner.restore.restore`, with a stand-in trainer whose load returns
    the settings a real save keeps (``LearnerLoop._save`` writes ``settings_of``)."""
    from learner.restore import restore

    base = [f"trainer.default_local_dir={tmp_path}"]
    saved = settings_of(load_config(None, base))
    _save_state(load_config(None, base), 5, saved)

    class Loader:
        rank, step, policy_version = 0, 0, 0

        def load(self, path) -> dict:
            self.step = 5
            return {"settings": saved}

    for overrides, said in ((base, False), ([*base, "actor.optim.lr=3e-6"], True)):
        cfg = load_config(None, overrides)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="learner.restore"):
            restore(cfg, Loader(), run_dir(cfg))
        lines = [r.getMessage() for r in caplog.records if "settings changed" in r.message]
        assert bool(lines) == said, lines
        if said:
            assert f"actor.optim.lr {saved['actor.optim.lr']} -> 3e-06" in lines[0]


def test_a_fixed_kl_coefficient_is_the_configs_after_a_resume():
    """A review resumed a run saved at ``kl_ctrl.kl_coef=0.05`` (fixed) with 0.2 and kept
    training at 0.05: the checkpoint's coefficient overrode the config. Only an adaptive
    coefficient, which the run moved, is resumed (and said, when it is not the config's)."""
    from learner.checkpoint import REWARD_KL_KEY
    from learner.reward_kl import RewardKL

    def reward_kl(*overrides: str) -> RewardKL:
        base = ["algorithm.use_kl_in_reward=true", "algorithm.adv_estimator=reinforce_plus_plus"]
        return RewardKL(load_config(None, [*base, *overrides]), world_size=1)

    fixed = reward_kl("algorithm.kl_ctrl.kl_coef=0.2")
    assert fixed.restore({REWARD_KL_KEY: 0.05}) is None and fixed.ctrl.value == 0.2
    adaptive = reward_kl("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.2")
    said = adaptive.restore({REWARD_KL_KEY: 0.0513})
    assert adaptive.ctrl.value == 0.0513
    assert said is not None and "resumes at 0.0513" in said and "kl_coef=0.2" in said
    assert reward_kl("algorithm.kl_ctrl.type=adaptive").restore({}) is None  # none saved
    # A review: a run saved under a fixed coefficient, resumed adaptive, started the
    # controller at the old fixed value and said the run had moved it. It had not.
    saved = reward_kl("algorithm.kl_ctrl.kl_coef=0.001").saved({})
    switched = reward_kl("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05")
    assert switched.restore(saved) is None and switched.ctrl.value == 0.05
    moved = adaptive.saved({})
    again = reward_kl("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.2")
    assert again.restore(moved) is not None and again.ctrl.value == 0.0513
