"""Which checkpoint a learner start resumes from, and what it moves out of the way.

A launcher restarts a learner with ``trainer.resume_mode=auto``, so what ``auto`` finds
must be this run's, even for a start that dies while its model loads: before the model
loads (:func:`clear_the_way`), a start that does not resume from the run directory's
checkpoints (``disable``, or ``resume_path`` elsewhere) moves them aside, and ``auto`` with none
of this run's yet falls back to ``resume_from_path`` (the first start's weights, not the
base model's; a restart of a start under ``disable``, which loaded nothing, clears it:
:func:`asyncrl.launch.roles.learner_restart_args`). A ``resume_path`` to an earlier step of this run (a rewind) moves the steps
after it aside, out of ``auto``'s reach. A resume whose config moves the learning-rate
schedule (a raised ``trainer.total_training_steps`` under a decay) says how, in one line.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config import Config, ConfigError
from asyncrl.config.ending import COMPLETE_FILE, starts_new_run
from asyncrl.config.inputs import STATE_FILE, STEP_ENTRY, resume_problem, total_training_steps
from asyncrl.config.resumed import (
    changed_line,
    changed_settings,
    kept_schedule,
    optim_of,
    schedule_changes,
    schedule_settings,
    with_saved,
)
from asyncrl.config.verl_checkpoints import auto_line, latest_verl_step
from learner.checkpoint_folders import latest_checkpoint, set_aside, set_aside_checkpoints
from learner.control_peer import Restored
from learner.export import EXPORT_MARK

log = logging.getLogger(__name__)

#: Said when a rewind's checkpoint did not load after the steps after it were moved.
REWOUND_BUT_FAILED = (
    "the rewind did not load, but its later steps were already moved aside (under "
    "{run}/checkpoints/abandoned_after_step_*): move them back into checkpoints/ to go on "
    "with that branch"
)


class Loads(Protocol):
    """What :func:`restore` needs of the trainer (:class:`learner.trainer.Trainer`): its
    rank, the step and version a load sets, and the load itself."""

    rank: int
    step: int
    policy_version: int

    def load(self, path: Any) -> dict[str, Any]: ...


@dataclass
class Start:
    """What :func:`restore` found: the state for the control plane, whether this start
    begins a new run here or a new branch of it (its metrics start afresh), and the
    health alarms' saved history."""

    restored: Restored
    new_run: bool
    health: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cleared:
    """What :func:`clear_the_way` decided: the checkpoint to load (None: none), whether
    the start begins a new run or branch here, and whether a rewind moved later steps."""

    path: str | Path | None
    new_run: bool
    rewound: bool = False


def clear_the_way(cfg: Config, run_dir: Path, rank: int) -> Cleared:
    """Choose the checkpoint a start under ``cfg`` resumes and, on rank 0, move what a
    restart must not find: an earlier run's checkpoints (a new run here), the steps after a
    rewind's, an earlier ending (``complete.json``) and the final exports' marks. Done
    before the model loads: a learner that dies while it loads is restarted with ``auto``
    (:func:`asyncrl.launch.roles.learner_restart_args`), which must find this start's
    checkpoint, not the one it was told to leave. Raises :class:`ConfigError` for a path
    that is no checkpoint, before anything moves. Filesystem only; every rank calls it
    (rank 0 moves, and ``auto``, whose choice a move could change, moves nothing)."""
    t, mode = cfg.trainer, cfg.trainer.resume_mode
    path = None
    if mode == "auto":
        path = latest_checkpoint(run_dir) or t.resume_from_path
        verl = latest_verl_step(run_dir) if path is None else None
        if verl is not None and rank == 0:  # veRL's run directory, veRL's default
            log.warning("%s", auto_line(run_dir, verl))
    elif mode == "resume_path":
        path = t.resume_from_path
    if path is not None and (problem := resume_problem(str(path))) is not None:
        raise ConfigError([problem])
    new_run = starts_new_run(mode, path, run_dir)
    if rank != 0:
        return Cleared(path, new_run)
    if new_run and mode != "auto" and (old := set_aside_checkpoints(run_dir)):
        log.info("checkpoints of an earlier run (not resumed) moved to %s", old.name)
    if new_run or mode == "resume_path":
        # A new run here, or a branch of this one: an earlier ending, and the exports it
        # marked with its steps, are not its own (a mark of the same step would keep them).
        (run_dir / COMPLETE_FILE).unlink(missing_ok=True)
        for folder in ("final", "final_adapter"):
            (run_dir / folder / EXPORT_MARK).unlink(missing_ok=True)
    if new_run and not cfg.model.lora_rank and (old := set_aside(run_dir / "final_adapter")):
        # A run without LoRA exports no adapter: an earlier run's stayed beside its final/.
        log.info("the final adapter of an earlier run (this one has none) moved to %s", old.name)
    rewound = False
    if mode == "resume_path" and not new_run and path is not None:  # a rewind
        rewound = abandon_later(run_dir, checkpoint_step(Path(path)))
    return Cleared(path, new_run, rewound)


def checkpoint_step(path: Path) -> int:
    """The learner step a checkpoint folder holds: its state file's (the folder may be a
    link, or renamed), else the number in its name."""
    try:
        return int(json.loads((path / STATE_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        if (m := STEP_ENTRY.match(path.name)) is None:
            raise ConfigError([f"{path}: no step in its {STATE_FILE} nor in its name"]) from None
        return int(m.group(1))


def restore(cfg: Config, trainer: Loads, run_dir: Path, cleared: Cleared | None = None) -> Start:
    """Load the checkpoint :func:`clear_the_way` chose (``cleared``, or chosen now), if
    any, into ``trainer`` (a :class:`learner.trainer.Trainer`; every rank calls this).
    Raises :class:`ConfigError` for a path that is no checkpoint and for one that cannot be
    loaded."""
    from torch.distributed.checkpoint.api import CheckpointException

    from learner.checkpoint import unloadable_line
    from learner.checkpoint_fit import CheckpointMisfit

    if cleared is None:
        cleared = clear_the_way(cfg, run_dir, trainer.rank)
    path, new_run = cleared.path, cleared.new_run or cleared.rewound
    if path is None:
        return Start(Restored(None, None, None), new_run)
    try:
        extra = trainer.load(path)
    except CheckpointMisfit as e:  # a config change, most likely: name it
        raise ConfigError([misfit_line(Path(path), str(e), cfg)]) from e
    # Damaged, or another model's: a restart fails the same way. torch's loader raises
    # CheckpointException, which is no Exception.
    except (Exception, CheckpointException) as e:
        raise ConfigError([unloadable_line(Path(path), e)]) from e
    finally:
        if cleared.rewound and sys.exc_info()[0] is not None:  # moved for a failed rewind
            log.warning("%s", REWOUND_BUT_FAILED.format(run=run_dir))
    rank0 = trainer.rank == 0
    changes = changed_settings(extra.get("settings"), cfg)
    if rank0 and (line := changed_line(changes, trainer.step, lora=cfg.model.lora_rank > 0)):
        log.warning("%s", line)
    if rank0 and (line := schedule_line(cfg, Path(path), trainer.step, extra.get("settings"))):
        log.warning("%s", line)
    session = str(extra.get("last_batch_session") or "")
    log.info(
        "resumed from %s at step %d, version %d (buffer session %r)",
        path,
        trainer.step,
        trainer.policy_version,
        session,
    )
    restored = Restored(
        Path(path),
        extra.get("last_batch_id"),
        extra.get("coordinator"),
        trainer.step,
        trainer.policy_version,
        session,
        extra.get("validation"),
        extra.get("lag_controller"),
        extra.get("saved_at"),
    )
    return Start(restored, new_run, extra.get("health") or {})


def misfit_line(path: Path, misfit: str, cfg: Config) -> str:
    """One line for a checkpoint whose trained weights are not this model's (``misfit``:
    :func:`learner.checkpoint_fit.model_misfit`, or no critic where this run has one), naming
    the model settings (and estimator) changed since."""
    from asyncrl.config.resumed import saved_settings

    changes = [
        c
        for c in changed_settings(saved_settings(path), cfg)
        if c.startswith(("model.", "critic.model.", "algorithm.adv_estimator"))
    ]
    since = f"; changed since it was saved: {'; '.join(changes)}" if changes else ""
    return (
        f"checkpoint {path} does not fit this model ({misfit}){since}. Put those settings "
        "back to resume it, or start from the model (trainer.resume_mode=disable)"
    )


def abandon_later(run_dir: Path, step: int) -> bool:
    """A rewind to ``step`` (the loaded checkpoint's own: its folder may be a link) of this
    run: its later steps (the branch left behind) go where ``auto`` does not look, or a
    restart would resume there. Whether any moved: then the new branch starts a new record
    (appended to the earlier branch's, and its W&B run, which drops steps that go back,
    it would be lost)."""
    from learner.checkpoint_folders import set_aside_later_checkpoints

    if (moved := set_aside_later_checkpoints(run_dir, step)) is None:
        return False
    log.info(
        "rewound to step %d: the later checkpoints (the branch left behind) moved to "
        "%s, where a restart does not look; the metrics start a new record",
        step,
        moved,
    )
    return True


def schedule_line(
    cfg: Config, path: Path, step: int, saved: Mapping[str, Any] | None
) -> str | None:
    """One line for a resume at ``step`` whose learning-rate schedule moved since the
    checkpoint at ``path`` (``saved``: the settings it kept), or None. A raised
    ``trainer.total_training_steps`` (how a complete run trains on), a new warmup, kind or
    floor: training goes on under the config's schedule, as veRL's resume does, but the
    next step's rate can jump (a finished cosine decay starts again from half-way), so the
    line gives that rate under both schedules, what the schedule does now, and the settings
    that moved it."""
    states = _saved_schedules(path)
    optimizers = ["actor.optim"] + (
        ["critic.optim"] if cfg.algorithm.adv_estimator == "gae" else []
    )
    keys: list[str] = []
    clauses: list[str] = []
    for optimizer in optimizers:
        changes = schedule_changes(saved, cfg, optimizer)
        kept = kept_schedule(saved, optimizer)
        if kept and not changes:
            continue  # the same schedule: no rate to compare
        clause = _schedule_clause(cfg, optimizer, states.get(optimizer), step, saved, kept)
        if clause is None:
            continue  # a checkpoint without its schedule settings, at the same rate
        keys += [c for c in changes if c not in keys]
        clauses.append(clause)
    if not clauses:
        return None
    why = "; ".join(keys) or "its checkpoint kept no schedule settings to name"
    back = "put those settings back" if keys else "put back the settings it was saved with"
    return (
        f"resuming step {step} under a changed learning-rate schedule ({why}): "
        f"{' '.join(clauses)} Training goes on under it; {back} to keep the checkpoint's"
    )


def _schedule_clause(
    cfg: Config,
    optimizer: str,
    state: Mapping[str, Any] | None,
    step: int,
    saved: Mapping[str, Any] | None,
    kept: bool,
) -> str | None:
    """``optimizer``'s part of :func:`schedule_line`: the next step's rate under the config
    and under the checkpoint (``state``: its saved schedule, which holds the rate it was
    at), and what the schedule does now. None when the checkpoint kept no schedule settings
    (``kept`` False) and no rate, or the config's rate: nothing shows it moved."""
    from learner import fsdp

    if state is None and not kept:
        return None  # neither the settings nor the rates to compare
    optim = optim_of(cfg, optimizer)
    total = total_training_steps(cfg)
    now = f"it now {fsdp.schedule_text(optim, total)}."
    if state is None:  # kept no rates: the settings alone say it moved
        return f"{optimizer}: {now}"
    position, old, base = state["last_epoch"], state["_last_lr"][0], state["base_lrs"][0]
    factor = fsdp.schedule_factor(optim, total)(position)
    if not kept and math.isclose(old / base, factor, rel_tol=1e-9, abs_tol=1e-12):
        return None
    new = optim.lr * factor
    if math.isclose(new, old, rel_tol=1e-9, abs_tol=1e-12):
        rates = f"{optimizer}.lr for step {step + 1} is {new:.3g} under both"
    else:
        rates = (
            f"{optimizer}.lr for step {step + 1} is {new:.3g} under it, {old:.3g} under "
            "the checkpoint's"
        )
    if kept and position > 0 and saved:
        # The rate the checkpoint's last step trained at: the jump from there is the news.
        before = with_saved(cfg, saved, schedule_settings(optimizer))
        last = fsdp.schedule_factor(optim_of(before, optimizer), total_training_steps(before))
        rates += f" (step {step} trained at {base * last(position - 1):.3g})"
    return f"{rates}; {now}"


def _saved_schedules(path: Path) -> dict[str, Mapping[str, Any]]:
    """The schedules a checkpoint's state file kept (``LambdaLR`` state: its position,
    base rate and the rate it was at), by optimizer; {} where it kept none readable."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        found = {
            "actor.optim": state.get("scheduler"),
            "critic.optim": (state.get("critic") or {}).get("scheduler"),
        }
        return {
            k: v
            for k, v in found.items()
            if isinstance(v, dict)
            and isinstance(v.get("last_epoch"), int)
            and v.get("_last_lr")
            and v.get("base_lrs")
        }
    except (OSError, ValueError, AttributeError):
        return {}
