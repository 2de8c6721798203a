"""The prompt dataset cursor: training tasks epoch by epoch, validation tasks round by round.

- Training: epoch ``e`` deals every row once, in the order of a permutation seeded by
  ``data.seed`` and ``e`` (identity when ``data.shuffle`` is off), for
  ``trainer.total_epochs`` epochs. The task at position ``p`` of epoch ``e`` has id
  ``train/<e>/<p>``; its ``k``-th retry after the buffer dropped it for lag,
  ``train/<e>/<p>/<k>`` (a new id: the buffer keeps the first copy of each id).
- Validation: every round deals each validation row once, in file order; row ``r`` of
  round ``k`` has id ``val/<k>/<r>``. Rounds are dealt in the order they were started.

Ids are a pure function of the cursor and the source's *lineage*, so a task can be rebuilt
from its id alone (:meth:`TaskSource.task_for_id`) and a cursor restored from a checkpoint
deals the same tasks under the same ids again; the buffer keeps the first copy of an id, so
a restart repeats no group. The lineage (``train.<lineage>/<e>/<p>``, ``val.<lineage>/...``)
is drawn anew by every new source (a coordinator that starts without a checkpoint) and kept
in checkpoints: a fresh start after a crash never deals an id that a surviving buffer
already saw for other work (it would drop the group as a duplicate). An empty lineage gives
the plain ids above.

The state (:meth:`TaskSource.state_dict`) is a few integers, saved with the learner's
checkpoint; the rows themselves are read from ``data.train_files``/``data.val_files``.
"""

from __future__ import annotations

import functools
import logging
import random
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from asyncrl.config.errors import ConfigError
from asyncrl.control.messages import Task
from asyncrl.tasks.digest import rows_digest, train_digest

_TRAIN, _VAL = "train", "val"
log = logging.getLogger(__name__)

_START_OVER = "start over here with trainer.resume_mode=disable (the checkpoints are kept aside)"
_RESUME_FIX = f"put the files and settings back to resume, or {_START_OVER}"


class OtherValidationSet(ConfigError, KeyError):
    """A validation id of a round dealt over the validation set a resumed checkpoint had,
    not this run's: a :class:`KeyError` to those who look ids up (not this source's), a
    :class:`ConfigError` to the resume that restores it as outstanding."""

    def __str__(self) -> str:  # KeyError's would quote the lines
        return ValueError.__str__(self)


def load_rows(paths: Sequence[str], prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """The rows of several parquet files in veRL's layout, in order (needs pyarrow). A file
    that is not (a row of the wrong shape) is a :class:`~asyncrl.config.ConfigError`: a
    learner restarted would fail on it the same way."""
    from asyncrl.tasks import read_rows

    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            rows.extend(read_rows(path, prompt_key=prompt_key))
        except ValueError as e:
            raise ConfigError([str(e)]) from e
    return rows


def earlier_rows(earlier: Sequence[tuple[int, int]], number: int) -> int | None:
    """The rows of the validation set that round ``number`` was dealt over, when it was
    one a resume replaced (``earlier``: :attr:`TaskSource.other_val`); None: this run's."""
    return next((rows for end, rows in earlier if number < end), None)


def _earlier_sets(saved: Sequence[Any]) -> list[tuple[int, int]]:
    """:attr:`TaskSource.other_val` from a checkpoint: pairs, or one ``[rounds, rows]``
    as checkpoints saved before a second change was kept (``rounds`` 0: none)."""
    if len(saved) == 2 and all(isinstance(x, int) for x in saved):
        return [(int(saved[0]), int(saved[1]))] if saved[0] else []
    return [(int(end), int(rows)) for end, rows in saved]


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Row indices in the order epoch ``epoch`` deals them."""
    order = list(range(size))
    if shuffle:
        # An int seed: Random(int) is the same on every platform and Python version.
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _parse_id(task_id: str, lineage: str) -> tuple[str, int, int, int]:
    """``(kind, epoch or round, position or row, retry)`` of a task id of ``lineage``
    (retry 0: none); KeyError for any other id."""
    try:
        head, number, index, *rest = task_id.split("/")
        kind, _, its_lineage = head.partition(".")
        if its_lineage != lineage:
            raise ValueError
        retry = int(rest[0]) if len(rest) == 1 else 0
        if len(rest) > 1 or (rest and retry < 1):
            raise ValueError
        return kind, int(number), int(index), retry
    except ValueError:
        raise KeyError(f"{task_id!r} is not a task id of this source") from None


class TaskSource:
    """Deals :class:`Task` objects from in-memory rows; not thread-safe (one owner)."""

    def __init__(
        self,
        train_rows: Sequence[dict[str, Any]],
        val_rows: Sequence[dict[str, Any]] = (),
        *,
        seed: int = 1,
        shuffle: bool = True,
        total_epochs: int | None = None,
        n: int = 1,
        val_n: int = 1,
        prompt_key: str = "prompt",
        lineage: str | None = None,
        default_agent: str = "single_turn",
    ):
        self.train_rows = list(train_rows)
        # None: a lineage of its own, so a new cursor never deals an id an earlier one
        # dealt; "" gives plain ids (tests that name them).
        self.lineage = secrets.token_hex(3) if lineage is None else lineage
        self.val_rows = list(val_rows)
        self.seed = seed
        self.shuffle = shuffle
        self.total_epochs = total_epochs
        self.n = n
        self.val_n = val_n
        self.prompt_key = prompt_key
        # The agent of rows without an ``agent_name`` column: ``tool_agent`` when multi-turn
        # episodes are on (veRL's multi-turn datasets name none: its rollout ran every row
        # with the tools), ``single_turn`` otherwise.
        self.default_agent = default_agent
        self.epoch = 0
        self.position = 0  # next position in the current epoch
        self.val_rounds = 0  # rounds started so far
        self.val_queue: deque[int] = deque()  # rounds started and not fully dealt
        self.val_position = 0  # next row of val_queue[0]
        # [(end, rows)], ends rising: the rounds numbered below ``end`` (and from the
        # previous end) were dealt over a validation set of ``rows`` rows, not these (one
        # pair per resume that changed the set; see load_state_dict).
        self._other_val: list[tuple[int, int]] = []
        self.val_digest = rows_digest(self.val_rows)
        self._orders: dict[int, list[int]] = {}  # epoch -> its order (two at most)
        # Asked before dealing each training row (its index, epoch, position): True passes
        # it over (algorithm.filter_groups.skip_uninformative; see GroupFilter.skip_row).
        self.skip: Callable[[int, int, int], bool] | None = None

    @functools.cached_property
    def train_digest(self) -> str:
        """The training rows' fingerprint (:func:`asyncrl.tasks.digest.train_digest`), taken
        once, at the first checkpoint or resume: about 5 s a million rows, which a start
        that never saves nor resumes does not pay."""
        return train_digest(self.train_rows, self.prompt_key)

    # ------------------------------------------------------------------ training
    @property
    def exhausted(self) -> bool:
        """No training task is left (``total_epochs`` done, or no training rows)."""
        if not self.train_rows:
            return True
        return self.total_epochs is not None and self.epoch >= self.total_epochs

    def next_train(self, version: int = 0) -> Task | None:
        """The next training task (None when exhausted); advances the cursor past it and
        past the rows ``skip`` passes over (at most one epoch's worth per call)."""
        passed = 0
        while not self.exhausted:
            epoch, position = self.epoch, self.position
            self.position += 1
            if self.position >= len(self.train_rows):
                self.epoch, self.position = self.epoch + 1, 0
            row = self._order_of(epoch)[position]
            skip = self.skip if passed < len(self.train_rows) else None
            if skip is not None and skip(row, epoch, position):
                passed += 1
                continue
            return self._train_task(epoch, position, version)
        return None

    def row_of(self, task_id: str) -> int | None:
        """The training row a training task id of this source names (None for any other
        id: validation, an endpoint slot, another lineage's)."""
        try:
            kind, epoch, position, _ = _parse_id(task_id, self.lineage)
        except KeyError:
            return None
        if kind != _TRAIN or not 0 <= position < len(self.train_rows):
            return None
        return self._order_of(epoch)[position]

    def _order_of(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_order(len(self.train_rows), epoch, self.seed, self.shuffle)
            # Keep the cursor's epoch and this one: acks of the epoch before trail the
            # cursor across an epoch's end.
            kept = {e: o for e, o in self._orders.items() if e == self.epoch}
            self._orders = kept | {epoch: order}
        return order

    def _train_task(self, epoch: int, position: int, version: int) -> Task:
        row = self.train_rows[self._order_of(epoch)[position]]
        return self._task(row, f"{self._head(_TRAIN)}/{epoch}/{position}", self.n, False, version)

    def _head(self, kind: str) -> str:
        return f"{kind}.{self.lineage}" if self.lineage else kind

    @property
    def val_head(self) -> str:
        """What validation ids start with: round k's are ``<val_head>/<k>/<row>``."""
        return self._head(_VAL)

    # ------------------------------------------------------------------ validation
    def start_validation(self) -> int:
        """Start a validation round (dealt before any later training task); its number."""
        number = self.val_rounds
        self.val_rounds += 1
        if self.val_rows:
            self.val_queue.append(number)
        return number

    def next_val(self, version: int = 0) -> Task | None:
        """The next task of the oldest unfinished validation round, or None."""
        if not self.val_queue:
            return None
        number = self.val_queue[0]
        task_id = f"{self._head(_VAL)}/{number}/{self.val_position}"
        task = self._task(self.val_rows[self.val_position], task_id, self.val_n, True, version)
        self.val_position += 1
        if self.val_position >= len(self.val_rows):
            self.val_queue.popleft()
            self.val_position = 0
        return task

    def oversize_val_rows(self, fits: Callable[[Task], bool]) -> list[int]:
        """The validation rows whose task ``fits`` refuses (a grant could not carry it:
        such a row is never dealt, and its rounds would never complete)."""
        head = self._head(_VAL)
        return [
            i
            for i, row in enumerate(self.val_rows)
            if not fits(self._task(row, f"{head}/0/{i}", self.val_n, True, 0))
        ]

    # ------------------------------------------------------------------ ids, state
    @property
    def other_val(self) -> tuple[tuple[int, int], ...]:
        """``((end, rows), ...)``, ends rising: the rounds numbered below ``end`` (and
        from the previous end) were dealt over a validation set of ``rows`` rows, which a
        resume then replaced (empty: none was)."""
        return tuple(self._other_val)

    def task_for_id(self, task_id: str, version: int = 0) -> Task:
        """Rebuild the task that ``task_id`` names (e.g. one outstanding at a restart)."""
        kind, number, index, retry = _parse_id(task_id, self.lineage)
        if kind == _TRAIN and 0 <= index < len(self.train_rows):
            task = self._train_task(number, index, version)
            return msgspec.structs.replace(task, task_id=task_id) if retry else task
        if kind == _VAL and (rows := earlier_rows(self.other_val, number)) is not None:
            # A ledger restoring it outstanding cannot deal it: a config error. Anyone
            # else asking (a server or buffer naming it) learns it is not ours.
            what = f"task {task_id} is outstanding"
            raise OtherValidationSet([self._val_changed(what, rows)])
        if kind == _VAL and 0 <= index < len(self.val_rows) and not retry:
            return self._task(self.val_rows[index], task_id, self.val_n, True, version)
        raise KeyError(f"{task_id!r} is not a task id of this source")

    def retry_of(self, task_id: str, version: int) -> tuple[Task, int]:
        """The next retry of training task ``task_id`` (a new id) and its retry number."""
        kind, number, index, retry = _parse_id(task_id, self.lineage)
        if kind != _TRAIN:
            raise KeyError(f"{task_id!r} is not a training task id")
        k = retry + 1
        return self.task_for_id(f"{self._head(kind)}/{number}/{index}/{k}", version), k

    def _task(self, row: dict[str, Any], task_id: str, n: int, val: bool, version: int) -> Task:
        return Task(
            task_id=task_id,
            data_source=str(row["data_source"]),
            prompt=list(row[self.prompt_key]),
            ground_truth=row["reward_model"]["ground_truth"],
            extra_info=dict(row.get("extra_info") or {}),
            agent_name=str(row.get("agent_name") or self.default_agent),
            n=n,
            validation=val,
            dealt_version=version,
        )

    def state_dict(self) -> dict[str, Any]:
        """The cursor as plain data (ints and lists): save it with the checkpoint."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "val_rounds": self.val_rounds,
            "val_queue": list(self.val_queue),
            "val_position": self.val_position,
            "train_rows": len(self.train_rows),
            "train_digest": self.train_digest,
            "val_rows": len(self.val_rows),
            "val_digest": self.val_digest,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "lineage": self.lineage,
            "other_val": [list(pair) for pair in self._other_val],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor; refuses one saved over another number of training rows or another
        order (a :class:`ConfigError`: a restart would fail the same way): task ids name rows
        by index, so the tasks in flight would point at other prompts, or at none. Rows
        edited in place (as many, other content) go on with a warning, as veRL's resume.

        The validation files and schedule may change, as a veRL resume allows: with no
        round under way the rounds go on over this run's rows (none when validation is
        off), numbered after the saved ones, whose ids then name no task of this source
        (:meth:`task_for_id`). A round still being dealt is refused: its ids name rows of
        the saved set, and the learner waits for all of them."""
        if (problem := self._train_mismatch(state)) is not None:
            raise ConfigError([problem])
        # Absent from checkpoints made before it was saved: taken as unchanged.
        val_saved = int(state.get("val_rows", len(self.val_rows)))
        digest = state.get("val_digest", self.val_digest)
        changed = val_saved != len(self.val_rows) or digest != self.val_digest
        if changed and state["val_queue"]:
            what = f"round {int(state['val_queue'][0])} is being dealt"
            raise ConfigError([self._val_changed(what, val_saved)])
        self.lineage = str(state.get("lineage", ""))  # "": saved before lineages
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.val_rounds = int(state["val_rounds"])
        self.val_queue = deque(int(r) for r in state["val_queue"])
        self.val_position = int(state["val_position"])
        self._other_val = _earlier_sets(state.get("other_val", []))
        ends = self._other_val[-1][0] if self._other_val else 0
        if changed and self.val_rounds > ends:  # the saved set's rounds are all dealt
            self._other_val.append((self.val_rounds, val_saved))
            log.info(
                "validation goes on over %d rows (the checkpoint's %d rounds were over %d)",
                len(self.val_rows),
                self.val_rounds,
                val_saved,
            )

    def _train_mismatch(self, state: dict[str, Any]) -> str | None:
        """Why the saved cursor cannot go on over these training rows (None: it can). The
        seed orders the rows only when shuffling: without, it may change."""
        saved = (state["train_rows"], state["seed"], state["shuffle"])
        now = (len(self.train_rows), self.seed, self.shuffle)
        if saved[0] == now[0] and saved[2] == now[2] and (saved[1] == now[1] or not now[2]):
            if state.get("train_digest", self.train_digest) != self.train_digest:
                # Files edited in place go on, as veRL's resume does; said once here, since
                # the tasks in flight are rebuilt from the rows their indices name now.
                log.warning(
                    "data.train_files changed since the checkpoint (the same %d rows in "
                    "number, not in content or order): going on from the saved position; "
                    "tasks in flight are rebuilt from the rows now at their indices",
                    now[0],
                )
            return None
        return (
            f"the checkpoint's data cursor is for {saved[0]} training rows, seed {saved[1]}, "
            f"shuffle {saved[2]}; this run has {now[0]}, {now[1]}, {now[2]} "
            f"(data.train_files, data.seed or data.shuffle changed): {_RESUME_FIX}"
        )

    def _val_changed(self, what: str, val_saved: int) -> str:
        """The line refusing a resume with validation work (``what``) outstanding over
        another validation set. No rows here: validation is off (the launch check refuses
        empty files when it is on)."""
        n = len(self.val_rows)
        other = " other" if n == val_saved else ""  # the same size, other content
        now = f"now holds {n}{other}" if n else "holds none now (validation is off)"
        return (
            f"the checkpoint's validation rounds are over {val_saved} rows; data.val_files "
            f"{now}, and its {what}: resume with the validation files and settings it was "
            f"saved with until that round's val/ record is logged, or {_START_OVER}"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "coordinator/data/epoch": float(self.epoch),
            "coordinator/data/position": float(self.position),
            "coordinator/data/val_rounds": float(self.val_rounds),
        }
