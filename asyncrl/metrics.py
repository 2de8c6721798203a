"""Metric sinks: the console, a JSONL file in the run directory, and wandb.

``trainer.logger`` picks the sinks (veRL's names: ``console``, ``wandb``). ``jsonl``, ours,
is always written, listed or not: one JSON object per line in ``<run dir>/metrics.jsonl``,
the run's record, which the launcher's live view, its summary and plots read (a veRL
config's ``logger: ['console', 'wandb']`` left them empty). Metric names use slash namespaces (``rollout/tokens_per_s``,
``buffer/lag_max``, ``actor/pg_clipfrac``, ``timing/weight_sync_s``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"  # the W&B run a resumed learner logs into again
#: "<W&B run id> <last W&B step>": where a resumed learner's W&B steps go on from when W&B
#: does not say (offline, its ``starting_step`` is 0: the steps logged again below the
#: run's were dropped at ``wandb sync``).
WANDB_STEP_FILE = "wandb_step"
#: The x axis of W&B's charts but validation's: the learner step of the record a value
#: came in (W&B's own step may run ahead of it, see MetricsLogger._wandb_row).
WANDB_AXIS = "train/step"


class MetricsLogger:
    """Writes ``{step, time, **metrics}`` records to every configured sink."""

    def __init__(
        self,
        run_dir: Path,
        sinks: Iterable[str],
        *,
        project: str = "asyncrl",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        console_keys: Iterable[str] = (),
        fresh: bool = False,
    ):
        self.sinks = set(sinks)
        self.run_dir = run_dir
        self.console_keys = list(console_keys)
        self._wandb = None
        # The run's record, whatever the sinks (see the module docstring).
        run_dir.mkdir(parents=True, exist_ok=True)
        if fresh:  # a new run in an old directory: keep the old records, apart
            set_aside(run_dir / METRICS_FILE)
        _end_whole(run_dir / METRICS_FILE)
        self._file = open(run_dir / METRICS_FILE, "a", buffering=1)  # noqa: SIM115
        if "wandb" in self.sinks:
            import wandb  # only when asked for: it is slow to import

            # WANDB_MODE (online, offline, disabled) and WANDB_DIR work as usual: W&B's
            # files go to the run directory unless WANDB_DIR says where. The run id is kept
            # in the run directory: a resumed learner logs into the same W&B run
            # (resume="allow" alone would open a new one at every restart).
            self._wandb = wandb.init(
                project=project,
                name=experiment,
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
                config=dict(config or {}),
                id=_wandb_id(run_dir, fresh),
                resume="allow",
            )
            # A validation round is logged at the step it completes; its chart's x axis is
            # the step it started at (the weights it measured), as in metrics.jsonl.
            self._wandb.define_metric("val/step")
            self._wandb.define_metric("val/*", step_metric="val/step")
            # Every other namespace is charted against the learner step of its record
            # (WANDB_AXIS, in every row): a record moved to a later W&B step (see
            # _wandb_row) stays at its own step on the charts.
            self._wandb.define_metric(WANDB_AXIS)
        # W&B's steps only go up, across a resume too: a resumed W&B run goes on from its
        # next step (which records moved ahead, see _wandb_row, may have pushed past the
        # learner's), else it dropped the resumed learner's first records without a word.
        start = int(getattr(self._wandb, "starting_step", 0) or 0)
        if self._wandb is not None:
            start = max(start, _saved_wandb_step(run_dir, self._wandb.id) + 1)
        self._wandb_step, self._wandb_keys = start if start > 0 else -1, set[str]()
        # The highest W&B step written to WANDB_STEP_FILE: a resumed learner's first row is
        # its start, which the file does not hold yet (a crash before its next row made
        # the learner after it log that step again, and offline sync dropped it).
        self._wandb_saved = start - 1
        self._wandb_charted = {"val", WANDB_AXIS.split("/")[0]}  # namespaces given an axis

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` at learner step ``step`` (non-numbers are dropped)."""
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if self._file is not None:
            self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._wandb is not None:
            self._chart_namespaces(clean)
            row = self._wandb_row(step, clean)
            self._wandb.log({**clean, WANDB_AXIS: float(step)}, step=row)
        if "console" in self.sinks:
            keys = self.console_keys or sorted(clean)
            shown = " ".join(f"{k}={clean[k]:.4g}" for k in keys if k in clean)
            if shown:  # a record of other keys only (say, the final accounting) stays quiet
                log.info("step %d: %s", step, shown)

    def _chart_namespaces(self, clean: Mapping[str, float]) -> None:
        """Chart each namespace seen for the first time (``loss/*``, ``rollout/*``, ...)
        against :data:`WANDB_AXIS`: W&B's globs are prefixes, one per namespace."""
        assert self._wandb is not None
        for key in clean:
            ns = key.split("/", 1)[0]
            if "/" in key and ns not in self._wandb_charted:
                self._wandb_charted.add(ns)
                self._wandb.define_metric(f"{ns}/*", step_metric=WANDB_AXIS)

    def _wandb_row(self, step: int, clean: Mapping[str, float]) -> int:
        """The W&B step to log a record of learner step ``step`` at. W&B keeps one value per
        key and step, the last logged: two records of one step sharing a key (two
        validation rounds completing together, the final weight push after the last step's)
        would keep only the second. Such a record goes to the next step there instead, and
        W&B's steps only go up, so the records after it may follow it there; the charts
        read each record's own step (:data:`WANDB_AXIS`, ``val/step`` for validation), and
        ``metrics.jsonl`` keeps every record at its own step."""
        row = max(step, self._wandb_step)
        if row == self._wandb_step and not self._wandb_keys.isdisjoint(clean):
            row += 1
        if row != self._wandb_step:
            self._wandb_step, self._wandb_keys = row, set()
        if row > self._wandb_saved:
            assert self._wandb is not None
            (self.run_dir / WANDB_STEP_FILE).write_text(f"{self._wandb.id} {row}\n")
            self._wandb_saved = row
        self._wandb_keys.update(clean)
        return row

    def mark_resumed(self, step: int, saved_at: float | None = None) -> None:
        """A learner resumed from its checkpoint at ``step`` (its state taken at wall time
        ``saved_at``, where the checkpoint says): when the file holds later steps, or
        records written after ``saved_at`` (trained or reported, then lost with the learner
        that died: a validation round read while it waited for its next batch), a record
        saying so, by which :func:`read_metrics` drops them (W&B charts both lives at their
        ``train/step``)."""
        if self._file is None:
            return
        records = read_metrics(self.run_dir)
        reached = max((r.get("step", 0) for r in records), default=0)
        after = saved_at is not None and any(r.get("time", 0) > saved_at for r in records)
        if reached > step or after:
            record = {"step": step, "time": time.time(), RESUMED_FROM: step, REACHED: reached}
            if saved_at is not None:
                record[SAVED_AT] = saved_at
            self._file.write(json.dumps(record) + "\n")
            if self._wandb is not None and reached > step:  # W&B takes no step twice
                log.warning(
                    "W&B charts steps %d-%d twice (at their train/step): as the learner lost "
                    "with its checkpoint logged them, and as they are trained again; this "
                    "run's %s keeps only the steps trained again",
                    step + 1,
                    reached,
                    METRICS_FILE,
                )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _end_whole(path: Path) -> None:
    """Cut a record the previous writer left half written (it died mid-line) from the end of
    ``path``: appended to, the next record (a resume's marker) joined it into one line that
    no reader can parse."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            back = min(size, 1 << 20)  # a record is far shorter than this
            f.seek(size - back)
            tail = f.read(back)
            cut = tail.rfind(b"\n")
            f.truncate(size - back + cut + 1 if cut >= 0 else size - back)
    except FileNotFoundError:
        return
    log.warning("%s ended in a half-written record (its writer died mid-line): cut", path.name)


def _wandb_id(run_dir: Path, fresh: bool) -> str:
    """The W&B run id of this run directory (``wandb_run_id``): a new one for a fresh run,
    the saved one for a resumed run."""
    path = run_dir / WANDB_ID_FILE
    if not fresh and path.is_file() and (saved := path.read_text().strip()):
        return saved
    if fresh:
        set_aside(path)  # the earlier run's W&B id, kept beside its records
    new = secrets.token_hex(4)
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(new + "\n")
    return new


def _saved_wandb_step(run_dir: Path, run_id: str) -> int:
    """The last W&B step a learner logged W&B run ``run_id`` at from ``run_dir``
    (:data:`WANDB_STEP_FILE`), or -1."""
    try:
        saved_id, step = (run_dir / WANDB_STEP_FILE).read_text().split()
        return int(step) if saved_id == run_id else -1
    except (OSError, ValueError):  # none yet, another run's, or a torn write
        return -1


def set_aside(path: Path) -> None:
    """Rename a non-empty ``path`` to the first free ``<stem>.<k><suffix>`` (nothing is
    deleted; only the new run's records stay under the name the tools read)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    k = 1
    while (old := path.with_name(f"{path.stem}.{k}{path.suffix}")).exists():
        k += 1
    path.rename(old)
    log.info("%s held records of an earlier run (not resumed): moved to %s", path, old.name)


#: A resume's record: the checkpoint's step, and the highest step the file held then.
RESUMED_FROM, REACHED = "learner/resumed_from_step", "learner/steps_reached"
#: A resume's record: the wall time its checkpoint's state was taken (records after it go).
SAVED_AT = "learner/resumed_saved_at"


def val_step(record: Mapping[str, float]) -> int:
    """The learner step whose weights a validation record measured (``val/step``; a round
    is recorded at the step it completed, later)."""
    return int(record.get("val/step", record["step"]))


def validation_rounds(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """The validation rounds of ``records`` in the order of the weights they measured
    (:func:`val_step`): rounds complete, and are recorded, out of that order."""
    return sorted((r for r in records if "val/score" in r), key=val_step)


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """The records of ``<run dir>/metrics.jsonl`` (skipping a torn last line), without the
    steps a learner trained and then lost, restarted from an earlier checkpoint: at a
    resume record (:meth:`MetricsLogger.mark_resumed`) those past its step are dropped,
    as the steps trained again replace them. The file keeps every record."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    out: list[dict[str, float]] = []
    for line in path.read_text().splitlines():
        try:
            out = _resumed(out, json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _resumed(out: list[dict[str, float]], record: dict[str, float]) -> list[dict[str, float]]:
    """``out`` with ``record`` after it, less the steps a resume record drops (and the
    records written after its checkpoint, where it says when that was)."""
    if RESUMED_FROM in record:
        saved_at = record.get(SAVED_AT, math.inf)
        out = [
            r
            for r in out
            if r.get("step", 0) <= record[RESUMED_FROM] and r.get("time", 0) <= saved_at
        ]
    out.append(record)
    return out


class MetricsTail:
    """:func:`read_metrics` for a reader that asks every second (the launcher's live line):
    each :meth:`read` parses only the lines appended since the last, and starts over when
    the file was replaced (a new run set the old one aside) or cut. Reading the whole file
    each time cost the launcher a core by a few thousand steps (a record holds some 200
    values), its loop, which also restarts roles, slowing as the run went on."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS_FILE
        self._records: list[dict[str, float]] = []
        self._offset, self._inode = 0, -1

    def read(self) -> list[dict[str, float]]:
        """The records as :func:`read_metrics` returns them (the list is this reader's)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._records, self._offset, self._inode = [], 0, -1
            return self._records
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._records, self._offset, self._inode = [], 0, stat.st_ino
        with self.path.open("rb") as f:
            f.seek(self._offset)
            new = f.read()
        whole = new.rfind(b"\n") + 1  # a line still being written is read next time
        for line in new[:whole].splitlines():
            try:
                self._records = _resumed(self._records, json.loads(line))
            except json.JSONDecodeError:
                continue
        self._offset += whole
        return self._records


def _is_number(v: Any) -> bool:
    """A finite number a record can hold (a value too large for a float is none: its
    ``float()`` raised, and the record with it)."""
    try:
        return not isinstance(v, bool | str | bytes) and math.isfinite(float(v))
    except (TypeError, ValueError, OverflowError):
        return False
