"""A resume that moves the learning-rate schedule says so in one line. A review finished a
cosine run of 6 steps (its last step at 1.46e-4), raised ``trainer.total_training_steps``
to 12 as the 'run is complete' line advises, and the first resumed step trained at
6.55e-4 with nothing in the log: the decay had started again from half-way. The run still
goes on under the new schedule (as veRL's resume does); the learner's log now gives the
next step's rate under both schedules, what the schedule does now and the settings that
moved it. A longer run under a constant rate moves nothing and says nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from asyncrl.config import load_config, run_dir
from asyncrl.config.inputs import STATE_FILE
from asyncrl.config.resumed import COMPARED, SCHEDULE, schedule_changes, settings_of
from learner import fsdp
from learner.restore import restore, schedule_line
from tests.test_checkpoint import batch

COSINE = ["actor.optim.lr_warmup_steps=2", "actor.optim.lr_scheduler_type=cosine"]


def _rows(tmp_path: Path, n: int) -> str:
    """A training file of ``n`` rows (a derived total counts rows only)."""
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"i": list(range(n))}), path)
    return f"data.train_files=[{path}]"


def _scheduler(optim_cfg, total: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim_cfg.lr)
    return fsdp.build_scheduler(optimizer, optim_cfg, total)


def _checkpoint(cfg, step: int, settings: dict | None, position: int | None = None) -> Path:
    """A checkpoint folder's state file as a save under ``cfg`` writes it after ``step``
    steps: the schedule's state (at ``position``, default ``step``) and ``settings``."""
    scheduler = _scheduler(cfg.actor.optim, cfg.trainer.total_training_steps)
    for _ in range(step if position is None else position):
        scheduler.optimizer.step()
        scheduler.step()
    folder = run_dir(cfg) / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    extra = {} if settings is None else {"settings": settings}
    state = {"step": step, "scheduler": scheduler.state_dict(), "extra": extra}
    (folder / STATE_FILE).write_text(json.dumps(state))
    return folder


def test_the_checkpoint_keeps_the_schedule_settings_and_names_those_that_move_it(tmp_path):
    base = load_config(None, COSINE)
    saved = json.loads(json.dumps(settings_of(base)))  # as the state file keeps them
    assert set(saved) == set(COMPARED) | set(SCHEDULE)
    steps = load_config(None, [*COSINE, "trainer.total_training_steps=120"])
    assert schedule_changes(saved, steps, "actor.optim") == [
        "trainer.total_training_steps 60 -> 120"
    ]
    # Under a constant rate (no warmup by ratio) the run's length moves nothing.
    constant = json.loads(json.dumps(settings_of(load_config(None, []))))
    longer = load_config(None, ["trainer.total_training_steps=120"])
    assert schedule_changes(constant, longer, "actor.optim") == []
    by_ratio = ["actor.optim.lr_warmup_steps_ratio=0.1"]
    saved_ratio = json.loads(json.dumps(settings_of(load_config(None, by_ratio))))
    assert schedule_changes(
        saved_ratio,
        load_config(None, [*by_ratio, "trainer.total_training_steps=120"]),
        "actor.optim",
    ) == ["trainer.total_training_steps 60 -> 120"]
    kind = load_config(None, [*COSINE, "actor.optim.lr_scheduler_type=linear"])
    assert schedule_changes(saved, kind, "actor.optim") == [
        "actor.optim.lr_scheduler_type cosine -> linear"
    ]
    assert schedule_changes(saved, kind, "critic.optim") == []  # the critic's is its own
    # A checkpoint from before the schedule settings were kept: its rates tell.
    old = {k: v for k, v in saved.items() if k in COMPARED}
    assert schedule_changes(old, kind, "actor.optim") == []
    assert schedule_changes(None, kind, "actor.optim") == []


def test_a_derived_total_names_the_epochs_or_batch_size_that_moved_it(tmp_path):
    """With ``trainer.total_training_steps=null`` the total is whole batches times epochs:
    more epochs move a decay, and are named; with a total given they move nothing."""
    derived = [*COSINE, _rows(tmp_path, 48), "trainer.total_training_steps=null"]
    derived += ["data.train_batch_size=16", "trainer.total_epochs=2"]
    saved = json.loads(json.dumps(settings_of(load_config(None, derived))))
    more = load_config(None, [*derived, "trainer.total_epochs=4"])
    assert schedule_changes(saved, more, "actor.optim") == ["trainer.total_epochs 2 -> 4"]
    given = [*derived, "trainer.total_training_steps=6"]
    saved_given = json.loads(json.dumps(settings_of(load_config(None, given))))
    epochs = load_config(None, [*given, "trainer.total_epochs=4"])
    assert schedule_changes(saved_given, epochs, "actor.optim") == []


def test_the_learner_gives_the_next_steps_rate_under_both_schedules(tmp_path, caplog):
    """The review's resume, through :func:`learner.restore.restore` with a stand-in trainer
    over a checkpoint's state file as a save writes it."""
    base = [f"trainer.default_local_dir={tmp_path}", *COSINE, "actor.optim.min_lr_ratio=0.0"]
    first = load_config(None, [*base, "trainer.total_training_steps=6"])
    _checkpoint(first, 6, settings_of(first))

    class Loader:
        rank, step, policy_version = 0, 0, 0

        def load(self, path) -> dict:
            self.step = 6
            return {"settings": json.loads(json.dumps(settings_of(first)))}

    for total, said in ((6, False), (12, True)):
        cfg = load_config(None, [*base, f"trainer.total_training_steps={total}"])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="learner.restore"):
            restore(cfg, Loader(), run_dir(cfg))
        lines = [r.getMessage() for r in caplog.records if "learning-rate schedule" in r.message]
        assert len(lines) == int(said), lines
    [line] = lines
    assert line.startswith(
        "resuming step 6 under a changed learning-rate schedule "
        "(trainer.total_training_steps 6 -> 12): actor.optim.lr for step 7 is 0.000655 under "
        "it, 0 under the checkpoint's (step 6 trained at 0.000146); it now warms up over 2 "
        "steps, then decays (cosine) to 0 after step 12."
    ), line


def test_a_checkpoint_without_schedule_settings_is_judged_by_its_rates(tmp_path):
    """A checkpoint saved before the schedule settings were kept: its saved schedule's rate
    against the config's at the same position. The critic's schedule (GAE) is said too."""
    base = [f"trainer.default_local_dir={tmp_path}", *COSINE, "trainer.total_training_steps=6"]
    cfg = load_config(None, base)
    saved = {k: v for k, v in settings_of(cfg).items() if k in COMPARED}
    folder = _checkpoint(cfg, 4, saved)
    assert schedule_line(cfg, folder, 4, saved) is None  # the same rates
    longer = load_config(None, [*base, "trainer.total_training_steps=12"])
    line = schedule_line(longer, folder, 4, saved)
    assert line is not None and "kept no schedule settings to name" in line
    # Cosine from step 3 (index 2): half-way at index 4 over 4 steps, a fifth over 10.
    assert "actor.optim.lr for step 5 is 0.000905 under it, 0.0005 under the checkpoint's" in line
    assert schedule_line(longer, folder, 4, None) == line  # no settings at all
    gae = ["algorithm.adv_estimator=gae", "critic.enable=true"]
    critic = load_config(None, [*base, *gae, "critic.optim.lr_scheduler_type=linear"])
    kept = settings_of(load_config(None, [*base, *gae]))
    line = schedule_line(critic, folder, 4, kept)
    assert line is not None and "critic.optim.lr_scheduler_type constant -> linear" in line
    assert "critic.optim: it now decays (linear) from 1e-05 to 0 after step 6." in line


def test_a_resumed_schedule_keeps_its_new_rate_for_the_next_save():
    """The rate a save keeps is the one a later resume compares with: after a resume under
    a new schedule it is the new schedule's, even before the next step sets it."""
    before = load_config(None, [*COSINE, "trainer.total_training_steps=6"]).actor.optim
    scheduler = _scheduler(before, 6)
    for _ in range(6):
        scheduler.optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    after = load_config(None, [*COSINE, "trainer.total_training_steps=12"]).actor.optim
    resumed = _scheduler(after, 12)
    resumed.load_state_dict(state)
    fsdp.reapply_optim_config(resumed.optimizer, resumed, after, "actor.optim")
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(6.545e-4, rel=1e-3)
    assert resumed.get_last_lr() == [resumed.optimizer.param_groups[0]["lr"]]


def test_a_real_resume_trains_on_under_the_new_schedule_and_says_so(
    tiny_model, single_rank, tmp_path, caplog
):
    """The review's run end to end: 6 cosine steps, saved as the loop saves them, resumed
    with the total raised to 12. The next step trains at the new schedule's rate (veRL's
    behaviour, kept), and the learner's log has said so before it."""
    from learner.trainer import Trainer

    base = [f"model.path={tiny_model}", "actor.ppo_mini_batch_size=1", *COSINE]
    base.append(f"trainer.default_local_dir={tmp_path}")
    first_cfg = load_config(None, [*base, "trainer.total_training_steps=6"])
    first = Trainer(first_cfg)
    lrs = [first.train_step(batch(s), 0.8)["actor/lr"] for s in range(6)]
    assert lrs[-1] == pytest.approx(1.464e-4, rel=1e-3)
    path = first.save(run_dir(first_cfg), extra={"settings": settings_of(first_cfg)})
    cfg = load_config(None, [*base, "trainer.total_training_steps=12"])
    cfg.trainer.resume_mode, cfg.trainer.resume_from_path = "resume_path", str(path)
    resumed = Trainer(cfg, total_steps=12)
    with caplog.at_level(logging.WARNING, logger="learner.restore"):
        restore(cfg, resumed, run_dir(cfg))
    assert "actor.optim.lr for step 7 is 0.000655 under it, 0 under the checkpoint's" in caplog.text
    assert resumed.train_step(batch(6), 0.8)["actor/lr"] == pytest.approx(6.545e-4, rel=1e-3)
