"""What one learner step does, in order (:meth:`learner.loop.LearnerLoop._one_step`): the
step's metrics record is written before its checkpoint. A learner that died between a
checkpoint and its record lost the record for good (the resume starts after the step); the
other way round the step is trained again, and its second record supersedes the first."""

from __future__ import annotations

from types import SimpleNamespace

from asyncrl.config import load_config
from learner import loop as loop_module
from learner.health import HealthMonitor
from learner.loop import LearnerLoop


def test_a_steps_record_is_written_before_its_checkpoint(tmp_path, monkeypatch):
    events: list[tuple[str, int]] = []

    class Trainer:  # the loop's view of learner.trainer.Trainer
        rank, world_size, step, policy_version = 0, 1, 0, 0

        def train_step(self, rollouts: list, temperature: float) -> dict[str, float]:
            self.step += 1
            return {"loss/pg": 0.0}

    class Control:  # the loop's view of rank 0's control plane, recorded
        def steer_lag(self, step: int, metrics: dict) -> None:
            pass

        def after_step(self, step: int, metrics: dict, version: int) -> None:
            events.append(("record", step))

    cfg = load_config(None, ["trainer.save_freq=2", "staleness.sync_every=100"])
    loop = object.__new__(LearnerLoop)
    loop.cfg, loop.trainer, loop.control, loop.total = cfg, Trainer(), Control(), 10
    loop.run_dir, loop._marked = tmp_path, set()
    loop.health = HealthMonitor(cfg.trainer.health)
    batch = SimpleNamespace(metrics={}, trajectories=[])
    monkeypatch.setattr(loop, "_next_batch", lambda: batch)
    monkeypatch.setattr(loop, "_account", lambda batch, rollouts: None)
    monkeypatch.setattr(loop, "_save", lambda final=False: events.append(("checkpoint", 2)))
    monkeypatch.setattr(loop_module, "to_rollouts", lambda batch: [])
    for _ in range(3):
        assert loop._one_step()
    assert events == [("record", 1), ("record", 2), ("checkpoint", 2), ("record", 3)]
