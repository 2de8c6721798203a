"""The run's checkpoint folders (the layout is in :mod:`learner.checkpoint`): which
complete one a resume reads, setting aside those of an earlier run or of a branch a rewind
abandoned, and deleting those past ``trainer.max_actor_ckpt_to_keep``. Nothing here reads
or writes tensors; a folder's content is :mod:`learner.checkpoint`'s."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from itertools import count
from pathlib import Path

import torch.distributed as dist

from asyncrl.config.inputs import ABANDONED_DIR, STATE_FILE, STEP_ENTRY, scan_checkpoints

log = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``run_dir``, or None. Says
    (rank 0) which folders it skipped as incomplete, and when it falls back to a
    ``step_<n>.old`` (see :func:`~asyncrl.config.inputs.scan_checkpoints`)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    found, skipped = scan_checkpoints(root)
    if _rank() == 0:
        for p in skipped:
            log.warning("skipped %s: an incomplete checkpoint (a save cut short)", p)
    if not found:
        return None
    latest = found[max(found)]
    if latest.suffix == ".old" and _rank() == 0:
        log.warning(
            "%s is missing (a re-save of it was cut short): resuming from %s, the complete "
            "copy it was replacing",
            latest.with_suffix(""),
            latest,
        )
    return latest


def _first_free(candidates: Iterable[Path]) -> Path:
    return next(p for p in candidates if not p.exists())


def set_aside(folder: Path) -> Path | None:
    """Rename ``folder`` to the first free ``<name>.<k>``; the new name, or None when there
    is no such folder. Nothing is deleted."""
    if not folder.is_dir():
        return None
    old = _first_free(folder.with_name(f"{folder.name}.{k}") for k in count(1))
    folder.rename(old)
    return old


def set_aside_checkpoints(run_dir: str | Path) -> Path | None:
    """Rename ``run_dir``'s checkpoints (of an earlier run) to the first free
    ``checkpoints.<k>``; the new name, or None when there were none. Nothing is deleted."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir() or not scan_checkpoints(root)[0]:
        return None
    old = _first_free(root.with_name(f"{root.name}.{k}") for k in count(1))
    root.rename(old)
    return old


def set_aside_later_checkpoints(run_dir: str | Path, step: int) -> Path | None:
    """Move ``run_dir``'s checkpoints after ``step`` (with their ``.old`` and ``.tmp``) to
    ``checkpoints/abandoned_after_step_<step>`` (``.2``, ... if taken), which
    :func:`latest_checkpoint` does not read: a run rewound to ``step`` must not be resumed
    by a restart (``resume_mode=auto``) on the branch it abandoned. The folder, or None when
    nothing came after ``step``. Nothing is deleted."""
    root = checkpoint_dir(run_dir)
    later = [
        p
        for p in sorted(root.iterdir())
        if (m := STEP_ENTRY.match(p.name)) and int(m.group(1)) > step
    ]
    if not later:
        return None
    name = ABANDONED_DIR.format(step=step)
    dest = _first_free(root / (f"{name}.{k}" if k > 1 else name) for k in count(1))
    dest.mkdir()
    for p in later:
        p.rename(dest / p.name)
    return dest


def prune_checkpoints(newest: Path, keep: int | None) -> list[Path]:
    """Delete the checkpoints beside ``newest`` (a complete ``step_<n>``, just saved) that
    are older than the newest ``keep`` of them, with their ``.tmp`` and ``.old`` folders:
    veRL's ``max_ckpt_to_keep`` (None or <= 0 keeps all, as there). ``newest``, later steps
    and ``abandoned_after_step_*`` folders are never touched. Rank 0 alone calls it. A
    deletion that fails is a warning, not an error: the run goes on. The folders deleted."""
    if keep is None or keep <= 0:
        return []
    root, step = newest.parent, int(newest.name.removeprefix("step_"))
    try:
        steps = sorted(s for s in scan_checkpoints(root)[0] if s <= step)
        if len(steps) <= keep:
            return []
        oldest_kept = steps[-keep]
        older = [
            p
            for p in sorted(root.iterdir())
            if (m := STEP_ENTRY.match(p.name)) and int(m.group(1)) < oldest_kept
        ]
    except OSError as e:
        log.warning("could not list %s to delete old checkpoints (%s); all are kept", root, e)
        return []
    removed = []
    for p in older:
        try:
            if p.is_symlink() or not p.is_dir():  # a link: never what it points to
                p.unlink()
            else:
                # First, so that a deletion cut short leaves no folder read as complete.
                (p / STATE_FILE).unlink(missing_ok=True)
                shutil.rmtree(p)
        except OSError as e:
            log.warning(
                "could not delete the old checkpoint %s (%s): delete it by hand to free the "
                "space (trainer.max_actor_ckpt_to_keep=%d)",
                p,
                e,
                keep,
            )
            continue
        removed.append(p)
    if removed:
        names = ", ".join(p.name for p in removed)
        log.info(
            "deleted %d old checkpoint folder(s), keeping the newest %d: %s",
            len(removed),
            keep,
            names,
        )
    return removed
