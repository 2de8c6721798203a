"""Checkpoints: a resumed run replays the same recorded batches exactly like an
uninterrupted one; incomplete checkpoints are never picked; trainer.max_actor_ckpt_to_keep
deletes the older ones; the HF export loads."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from asyncrl.config import Config, ConfigError, load_config
from asyncrl.config.resumed import settings_of
from learner.checkpoint import STATE_FILE
from learner.checkpoint_folders import latest_checkpoint, prune_checkpoints
from learner.export import export_hf
from learner.rollouts import Rollout
from learner.trainer import Trainer

TEMPERATURE = 0.8


def make_cfg(model_dir) -> Config:
    """Two mini-batches per step (Adam's state matters) and warmup + cosine decay (the
    schedule's position matters)."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "actor.ppo_mini_batch_size=1",
            "actor.optim.lr_warmup_steps=2",
            "actor.optim.lr_scheduler_type=cosine",
            "trainer.total_training_steps=6",
        ],
    )


def batch(seed: int) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(256) for _ in range(5)]
        for _ in range(3):
            k = rng.randint(2, 8)
            out.append(
                Rollout(
                    prompt,
                    [rng.randrange(256) for _ in range(k)],
                    [rng.uniform(-6.0, -4.0) for _ in range(k)],
                    float(rng.random()),
                    f"{seed}-{g}",
                    [(seed, k)],
                )
            )
    return out


BATCHES = [batch(s) for s in range(5)]


def run(trainer: Trainer, batches) -> list[dict[str, float]]:
    return [trainer.train_step(b, TEMPERATURE) for b in batches]


def test_resume_replays_exactly(tiny_model, single_rank, tmp_path):
    straight = Trainer(make_cfg(tiny_model))
    expected = run(straight, BATCHES)
    expected_state = straight.full_state_for_push()

    first = Trainer(make_cfg(tiny_model))
    run(first, BATCHES[:2])
    first.policy_version = 7
    saved = first.save(tmp_path, extra={"cursor": {"epoch": 0, "index": 12}})
    assert saved == tmp_path / "checkpoints" / "step_2"
    assert latest_checkpoint(tmp_path) == saved

    resumed = Trainer(make_cfg(tiny_model))
    extra = resumed.load(latest_checkpoint(tmp_path))
    assert extra == {"cursor": {"epoch": 0, "index": 12}}
    assert (resumed.step, resumed.policy_version) == (2, 7)
    got = run(resumed, BATCHES[2:])
    for key in ("loss/total", "actor/lr", "actor/grad_norm"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in expected[2:]], rel=1e-6)
    for k, v in resumed.full_state_for_push().items():
        torch.testing.assert_close(v, expected_state[k], rtol=0, atol=1e-7)
    # Warmup over 2 steps, then cosine decay over the remaining 4: the schedule moved.
    cosine = 0.5 * (1 + math.cos(math.pi / 4))
    lrs = [5e-4, 1e-3, 1e-3, 1e-3 * cosine, 5e-4]
    assert [m["actor/lr"] for m in expected] == pytest.approx(lrs, rel=1e-9)


def test_a_resume_draws_the_dropout_masks_an_unbroken_run_draws(
    tiny_model, single_rank, tmp_path, caplog
):
    """Each rank's random state is in the checkpoint: with dropout on, the steps after a
    resume equal the unbroken run's (a new learner seeded from trainer.seed draws others)."""
    model = tmp_path / "dropout-model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    with caplog.at_level("INFO", logger="learner"):
        unbroken = Trainer(make_cfg(model))
    # The layout probe runs in eval mode: dropout made the two layouts differ, and the
    # probe fell back to padded rows ("does not support the shared layout").
    assert unbroken.layout == "shared" and "does not support" not in caplog.text
    straight = run(unbroken, BATCHES[:4])

    first = Trainer(make_cfg(model))
    run(first, BATCHES[:2])
    saved = first.save(tmp_path / "run")
    assert (saved / "rng_rank0.pt").is_file()
    resumed = Trainer(make_cfg(model))
    resumed.load(saved)
    got = run(resumed, BATCHES[2:4])
    for key in ("loss/total", "actor/grad_norm"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in straight[2:]], rel=1e-6)

    # A checkpoint without the file (an older one) still loads, from the seed, and says so.
    (saved / "rng_rank0.pt").unlink()
    again = Trainer(make_cfg(model))
    caplog.clear()
    with caplog.at_level("INFO", logger="learner.checkpoint"):
        again.load(saved)
    assert (
        "rng_rank0.pt is missing: this rank's random draws start from trainer.seed" in caplog.text
    )
    drifted = run(again, BATCHES[2:4])
    assert [m["loss/total"] for m in drifted] != pytest.approx(
        [m["loss/total"] for m in straight[2:]], rel=1e-6
    )


def test_a_resume_with_a_new_learning_rate_trains_at_it(tiny_model, single_rank, tmp_path, caplog):
    """The optimizer and schedule a checkpoint restores carry the rate it was saved with: a
    resume with actor.optim.lr lowered trained on at the old one, silently. The config's
    rate (and weight decay, betas) now applies, on the schedule's position, and the
    learner says what changed."""
    first = Trainer(make_cfg(tiny_model))
    run(first, BATCHES[:3])  # past the warmup: the cosine factor at step 3
    first.save(tmp_path)
    cfg = make_cfg(tiny_model)
    cfg.actor.optim.lr, cfg.actor.optim.weight_decay = 1e-4, 0.05
    resumed = Trainer(cfg)
    with caplog.at_level("WARNING", logger="learner.trainer"):
        resumed.load(latest_checkpoint(tmp_path))
    [step4] = run(resumed, BATCHES[3:4])
    cosine = 0.5 * (1 + math.cos(math.pi / 4))
    assert step4["actor/lr"] == pytest.approx(1e-4 * cosine, rel=1e-9)  # was 1e-3 * cosine
    group = resumed.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.05 and group["initial_lr"] == 1e-4
    assert "actor.optim.lr=0.0001 (the checkpoint's was 0.001)" in caplog.text
    assert "actor.optim.weight_decay=0.05" in caplog.text and "betas" not in caplog.text

    # A checkpoint that kept its settings: the loop's changed-settings line names the lr,
    # so the trainer does not say it again (the weight decay is not among those settings).
    caplog.clear()
    first.save(tmp_path, extra={"settings": settings_of(make_cfg(tiny_model))})
    with caplog.at_level("WARNING", logger="learner.trainer"):
        Trainer(cfg).load(latest_checkpoint(tmp_path))
    assert "actor.optim.lr" not in caplog.text and "actor.optim.weight_decay=0.05" in caplog.text


def test_a_checkpoint_before_the_first_update_leaves_it_unchanged(
    tiny_model, single_rank, tmp_path
):
    """Saving builds a never-stepped optimizer's state by a zero step (Adam's count would
    start at 1): the first update must be the same with and without that checkpoint, and
    after loading it (the actor during trainer.critic_warmup is saved so)."""
    straight = Trainer(make_cfg(tiny_model))
    run(straight, BATCHES[:1])
    expected = straight.full_state_for_push()
    saved = Trainer(make_cfg(tiny_model))
    path = saved.save(tmp_path)
    assert json.loads((path / STATE_FILE).read_text())["never_stepped"] == ["actor"]
    resumed = Trainer(make_cfg(tiny_model))
    resumed.load(path)
    for trainer in (saved, resumed):
        run(trainer, BATCHES[:1])
        for k, v in trainer.full_state_for_push().items():
            torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-7)


def test_latest_ignores_incomplete_and_resave_replaces(tiny_model, single_rank, tmp_path):
    assert latest_checkpoint(tmp_path) is None
    trainer = Trainer(make_cfg(tiny_model))
    trainer.step = 3
    trainer.save(tmp_path)
    (tmp_path / "checkpoints" / "step_9.tmp").mkdir()  # a crash mid-save
    (tmp_path / "checkpoints" / "step_8").mkdir()  # no state file: incomplete
    assert latest_checkpoint(tmp_path).name == "step_3"
    trainer.policy_version = 4
    path = trainer.save(tmp_path)  # the same step again
    assert json.loads((path / STATE_FILE).read_text())["policy_version"] == 4
    assert not (tmp_path / "checkpoints" / "step_3.tmp").exists()
    with pytest.raises(TypeError):
        trainer.save(tmp_path, extra={"not json": object()})
    assert latest_checkpoint(tmp_path).name == "step_3"


def test_a_checkpoint_is_on_disk_before_its_rename_makes_it_complete(
    tiny_model, single_rank, tmp_path, monkeypatch
):
    """A review: nothing was flushed, so after a node's crash (not a kill) a step_N could
    exist with empty files, which auto-resume would pick and refuse. The rank's RNG file,
    the state file and the folder are synced while it is still ``.tmp``, then the rename
    itself, before older checkpoints are pruned."""
    from learner import checkpoint as ckpt

    synced: list[tuple[str, bool]] = []  # (name, whether step_2 exists yet)
    final = tmp_path / "checkpoints" / "step_2"
    real = ckpt.fsync_path
    monkeypatch.setattr(
        ckpt, "fsync_path", lambda p: (synced.append((p.name, final.exists())), real(p))[1]
    )
    trainer = Trainer(make_cfg(tiny_model))
    trainer.step = 2
    trainer.save(tmp_path)
    assert synced == [
        ("rng_rank0.pt", False),
        (STATE_FILE, False),
        ("step_2.tmp", False),
        ("checkpoints", True),
    ], synced


def test_a_resave_killed_between_its_renames_keeps_the_checkpoint(
    tiny_model, single_rank, tmp_path, monkeypatch, caplog
):
    """Re-saving step 4 (a finished run relaunched saves its last step again) renames
    step_4 to step_4.old, then step_4.tmp to step_4: killed between the two, the run
    resumes from step_4.old, not from step 2 (and says so), and the next save of step 4
    replaces it."""
    trainer = Trainer(make_cfg(tiny_model))
    for step, version in ((2, 1), (4, 2)):
        trainer.step, trainer.policy_version = step, version
        trainer.save(tmp_path)
    rename = Path.rename

    def killed(self: Path, target):
        if self.name == "step_4.tmp":
            raise KeyboardInterrupt("killed between the renames")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.save(tmp_path)
    monkeypatch.setattr(Path, "rename", rename)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4.old", "step_4.tmp"]
    with caplog.at_level("WARNING", logger="learner.checkpoint_folders"):
        found = latest_checkpoint(tmp_path)
    assert found == root / "step_4.old"
    assert "resuming from" in caplog.text and f"skipped {root / 'step_4.tmp'}" in caplog.text
    resumed = Trainer(make_cfg(tiny_model))
    resumed.load(found)
    assert (resumed.step, resumed.policy_version) == (4, 2)
    resumed.save(tmp_path)  # the final save of the relaunched run
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4"]
    assert latest_checkpoint(tmp_path) == root / "step_4"


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_max_actor_ckpt_to_keep_deletes_the_older_steps(tiny_model, single_rank, tmp_path):
    """veRL's trainer.max_actor_ckpt_to_keep: each save keeps the newest N checkpoints and
    deletes the older steps (a leftover .tmp of one too); a rewind's abandoned branch is
    never touched. Left at null (veRL's default), every checkpoint is kept."""
    trainer = Trainer(make_cfg(tiny_model))
    steps = (2, 4, 6, 8)
    for step in steps:  # the default: all kept
        trainer.step = step
        trainer.save(tmp_path / "all")
    assert _names(tmp_path / "all" / "checkpoints") == [f"step_{s}" for s in steps]

    trainer.cfg.trainer.max_actor_ckpt_to_keep = 2
    root = tmp_path / "checkpoints"
    abandoned = root / "abandoned_after_step_1" / "step_5"  # a rewind's left-behind branch
    abandoned.mkdir(parents=True)
    (abandoned / STATE_FILE).write_text("{}")
    (root / "step_1.tmp").mkdir()  # a save cut short
    seen = []
    for step in steps:
        trainer.step = step
        saved = trainer.save(tmp_path)
        assert (saved / STATE_FILE).is_file()
        seen.append([n for n in _names(root) if n.startswith("step_")])
    assert seen == [
        ["step_1.tmp", "step_2"],
        ["step_1.tmp", "step_2", "step_4"],
        ["step_4", "step_6"],
        ["step_6", "step_8"],
    ]
    assert _names(root) == ["abandoned_after_step_1", "step_6", "step_8"]
    assert (abandoned / STATE_FILE).is_file()
    assert latest_checkpoint(tmp_path) == root / "step_8"
    resumed = Trainer(make_cfg(tiny_model))
    resumed.load(root / "step_6")  # the older one kept is whole
    assert resumed.step == 6


def test_pruning_keeps_all_at_zero_and_warns_when_a_deletion_fails(tmp_path, monkeypatch, caplog):
    """0 or less keeps all, as in veRL (a count that is no integer is a config error); a
    folder that cannot be deleted is a warning (the run goes on), and it no longer reads as
    a checkpoint."""
    for bad in ("true", "2.5"):
        with pytest.raises(ConfigError, match="trainer.max_actor_ckpt_to_keep"):
            load_config(None, [f"trainer.max_actor_ckpt_to_keep={bad}"])
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / STATE_FILE).write_text("{}")
    for keep in (None, 0, -1):
        assert prune_checkpoints(root / "step_3", keep) == []
    assert _names(root) == ["step_1", "step_2", "step_3"]

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("learner.checkpoint_folders.shutil.rmtree", refused)
    with caplog.at_level("WARNING", logger="learner.checkpoint_folders"):
        assert prune_checkpoints(root / "step_3", 1) == []
    assert "could not delete the old checkpoint" in caplog.text and "step_2" in caplog.text
    assert latest_checkpoint(tmp_path) == root / "step_3"
    assert not (root / "step_1" / STATE_FILE).exists()


def test_export_loads_in_transformers(tiny_model, single_rank, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = Trainer(make_cfg(tiny_model))
    run(trainer, BATCHES[:1])
    state = trainer.full_state_for_push()
    out = export_hf(tmp_path / "final", state, tiny_model, step=1)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, p in hf.named_parameters():
        assert torch.equal(p.detach(), state[name]), name
    assert AutoTokenizer.from_pretrained(str(out)).encode("3+4=") == [18, 10, 19, 28]
