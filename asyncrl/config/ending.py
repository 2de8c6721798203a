"""How a run ended: ``complete.json`` in its run directory, written once the learner's
ending is done (the last checkpoint, the export, the final validation), and what a start
makes of it. A run whose last checkpoint is where it ended whole, with nothing left to
train under the config started again (:func:`finished_step`), says so and starts nothing;
one cut short in its ending is finished by the learner.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from asyncrl.config.inputs import scan_checkpoints, total_training_steps
from asyncrl.config.load import run_dir
from asyncrl.config.schema import Config

#: What a learner writes in the run directory once its run has ended whole (final checkpoint,
#: export, final validation): ``{"step": n}``, with ``"data_spent_at_epochs"`` when it
#: ended where its data ran out. A run whose last checkpoint is step ``n`` without it was
#: cut short in its ending, which the next start finishes.
COMPLETE_FILE = "complete.json"


def finished_step(cfg: Config) -> int | None:
    """The step of the run's last checkpoint when a start would resume a complete run
    (``resume_mode=auto``, its ending done there and nothing left to train: see
    :func:`ended_whole`), else None."""
    step = resumed_step(cfg)
    return step if step is not None and ended_whole(cfg, run_dir(cfg), step) else None


def resumed_checkpoint(cfg: Config) -> tuple[int, Path] | None:
    """The step and folder of the run's last complete checkpoint that ``resume_mode=auto``
    resumes, or None (another mode, or no checkpoint yet)."""
    if cfg.trainer.resume_mode != "auto":
        return None
    found, _ = scan_checkpoints(run_dir(cfg) / "checkpoints")
    return (max(found), found[max(found)]) if found else None


def resumed_step(cfg: Config) -> int | None:
    """The step of :func:`resumed_checkpoint`, or None."""
    resumed = resumed_checkpoint(cfg)
    return None if resumed is None else resumed[0]


def starts_new_run(mode: str, path: str | Path | None, run: Path) -> bool:
    """Whether a start under ``trainer.resume_mode`` ``mode`` that resumes ``path`` (None:
    nothing) begins a new run in the run directory ``run``, or a new branch of one, whose
    records start afresh: it resumes nothing, or (outside ``auto``) a checkpoint that is
    not one of ``run``'s own. ``auto`` resuming ``resume_from_path`` before this run's
    first checkpoint continues the run that began from it."""
    if path is None:
        return True
    ours = (run / "checkpoints").resolve()
    return mode != "auto" and ours not in Path(path).resolve().parents


def new_run(cfg: Config) -> bool:
    """:func:`starts_new_run` for the checkpoint a start under ``cfg`` would resume, as the
    learner finds it: what a launcher knows before any role starts."""
    t = cfg.trainer
    path: str | Path | None = None
    if t.resume_mode == "auto":
        resumed = resumed_checkpoint(cfg)
        path = resumed[1] if resumed is not None else t.resume_from_path
    elif t.resume_mode == "resume_path":
        path = t.resume_from_path
    return starts_new_run(t.resume_mode, path, run_dir(cfg))


def ended_whole(cfg: Config, run: Path, step: int) -> bool:
    """Whether a run whose last checkpoint is at ``step`` ended whole there (its export and
    final validation done, :data:`COMPLETE_FILE`) with nothing left to train under
    ``cfg``: at its ``total_training_steps``, or where its training data was spent, with
    no more ``trainer.total_epochs`` asked for now."""
    ended = _ending(run)
    if ended is None or ended.get("step") != step:
        return False
    if step >= total_training_steps(cfg):
        return True
    spent = ended.get("data_spent_at_epochs")
    return spent is not None and cfg.trainer.total_epochs <= spent


def _ending(run: Path) -> dict[str, Any] | None:
    try:
        ended = json.loads((run / COMPLETE_FILE).read_text())
    except (OSError, ValueError):  # none, or a torn write: not ended
        return None
    return ended if isinstance(ended, dict) and isinstance(ended.get("step"), int) else None


def ended_at(run: Path) -> int | None:
    """The step the run in ``run`` last ended whole at (its :data:`COMPLETE_FILE`), if any."""
    ended = _ending(run)
    return None if ended is None else ended["step"]


def data_spent_at(run: Path) -> int | None:
    """The ``trainer.total_epochs`` the run in ``run`` spent its data at when it ended (None:
    it ended at its step total, or has not ended)."""
    ended = _ending(run)
    return None if ended is None else ended.get("data_spent_at_epochs")


def mark_ended(run: Path, step: int, data_spent_at_epochs: int | None = None) -> None:
    """Record that the run ended whole at ``step`` (written whole or not at all), where its
    training data was spent with ``data_spent_at_epochs`` epochs (None: at its total)."""
    record: dict[str, Any] = {"step": step}
    if data_spent_at_epochs is not None:
        record["data_spent_at_epochs"] = data_spent_at_epochs
    tmp = run / f"{COMPLETE_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())  # after a node's crash, an empty mark would read as no end
    tmp.replace(run / COMPLETE_FILE)


def complete_line(step: int, total: int, data_spent_at_epochs: int | None = None) -> str:
    """What a start of a complete run says (the launcher, and a learner started by hand)."""
    if data_spent_at_epochs is not None and step < total:
        return (
            f"this run is complete: its training data was spent at step {step} "
            f"(trainer.total_epochs={data_spent_at_epochs}): nothing to train. To train on, "
            "raise trainer.total_epochs; to train again, give it a new "
            "trainer.experiment_name, or trainer.resume_mode=disable to start over here (its "
            "checkpoints are kept aside)"
        )
    where = f"step {step} of {total}" if step == total else f"step {step}, past {total}"
    return (
        f"this run is complete (its last checkpoint is at {where}): nothing to train. To "
        "train on, raise trainer.total_training_steps; to train again, give it a new "
        "trainer.experiment_name, or trainer.resume_mode=disable to start over here (its "
        "checkpoints are kept aside)"
    )
