"""What a learner start resumes from, by ``trainer.resume_mode``, when a launcher restarts it
with ``resume_mode=auto``: the checkpoints ``auto`` finds must be this run's. A start that
does not resume from the run directory's checkpoints moves them aside (an earlier run's
step 60 must not be picked over this run's step 20), and ``auto`` before this run's first
checkpoint falls back to ``resume_from_path`` (not the base model).

The decision is :meth:`LearnerLoop._restore` on a real run directory; the trainer is a
stand-in that records what it was asked to load."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config
from learner.checkpoint import STATE_FILE
from learner.loop import LearnerLoop


class LoadRecorder:
    rank, step, policy_version = 0, 0, 0

    def __init__(self) -> None:
        self.loaded: list[Path] = []

    def load(self, path: str | Path) -> dict:
        self.loaded.append(Path(path))
        return {}


def _checkpoint(root: Path, step: int) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text("{}")
    return d


def _restore(run: Path, *overrides: str) -> tuple[LoadRecorder, object]:
    loop = object.__new__(LearnerLoop)  # the decision only: no model, no control plane
    loop.cfg = load_config(None, list(overrides))
    loop.run_dir = run
    loop.trainer = LoadRecorder()  # type: ignore[assignment]
    return loop.trainer, loop._restore()  # type: ignore[return-value]


def test_disable_moves_an_earlier_runs_checkpoints_aside(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", 60)
    trainer, restored = _restore(run, "trainer.resume_mode=disable")
    assert trainer.loaded == [] and restored.path is None  # type: ignore[attr-defined]
    assert not (run / "checkpoints").exists()
    assert (run / "checkpoints.1" / "step_60" / STATE_FILE).is_file()  # kept, apart
    # This run checkpoints step 20 and crashes; the launcher restarts it with auto.
    ours = _checkpoint(run / "checkpoints", 20)
    trainer, _ = _restore(run, "trainer.resume_mode=auto")
    assert trainer.loaded == [ours]


def test_auto_before_the_first_checkpoint_resumes_where_the_first_start_did(tmp_path):
    run, given = tmp_path / "run", _checkpoint(tmp_path / "elsewhere", 7)
    _checkpoint(run / "checkpoints", 60)  # an earlier run's, in the same directory
    first = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={given}"]
    trainer, _ = _restore(run, *first)
    assert trainer.loaded == [given] and (run / "checkpoints.1").is_dir()
    # Killed before its first checkpoint: restarted with auto, it loads the given one again.
    trainer, _ = _restore(run, *first, "trainer.resume_mode=auto")
    assert trainer.loaded == [given]


@pytest.mark.parametrize("mode", ["auto", "resume_path"])
def test_resuming_from_the_run_directory_moves_nothing(tmp_path, mode):
    run = tmp_path / "run"
    old, new = _checkpoint(run / "checkpoints", 10), _checkpoint(run / "checkpoints", 20)
    extra = [f"trainer.resume_from_path={old}"] if mode == "resume_path" else []
    trainer, _ = _restore(run, f"trainer.resume_mode={mode}", *extra)
    assert trainer.loaded == [old if mode == "resume_path" else new]
    assert not (run / "checkpoints.1").exists()
