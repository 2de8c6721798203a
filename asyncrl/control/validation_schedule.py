"""When validation rounds start: before training (``trainer.val_before_train``), every
``trainer.test_freq`` steps, and at the end of training, never twice on the same weights
at one step.

:class:`ValidationSchedule` holds these rules; :class:`~asyncrl.control.state.ControlState`
owns one (as it owns a :class:`~asyncrl.control.versions.Versions`), passes it the learner's
steps and saves its ``last_val_step`` with its own state. A round started here is queued in
the task source (:meth:`~asyncrl.control.task_source.TaskSource.start_validation`), which
deals its groups before any later training task.
:class:`ValidationProgress` tells the learner how many rounds were started, and how many
groups make one, so it knows which rounds' scores to wait for.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from asyncrl.control.task_source import TaskSource, earlier_rows

log = logging.getLogger(__name__)


class ValidationProgress(NamedTuple):
    rounds_started: int  # validation rounds started so far (this run, resumes included)
    round_groups: int  # groups in one round: one per validation row
    head: str = "val"  # round k's groups have ids ``<head>/<k>/<row>`` (its round key)
    started_at: dict[int, int] | None = None  # round number -> the step of its weights
    # ((end, groups), ...): the rounds numbered below ``end`` were dealt over a validation
    # set of that many rows, which a resume then replaced (TaskSource.other_val)
    earlier: tuple[tuple[int, int], ...] = ()

    def round_key(self, number: int) -> str:
        return f"{self.head}/{number}"

    def groups_in(self, key: str) -> int:
        """How many groups make round ``key``: one per row of the set it was dealt over."""
        rows = earlier_rows(self.earlier, int(key.rsplit("/", 1)[1]))
        return self.round_groups if rows is None else rows

    def start_step(self, key: str) -> int | None:
        """The learner step whose weights round ``key`` measures (None: not known, a round
        started before a checkpoint that kept no such record)."""
        number = int(key.rsplit("/", 1)[1])
        return (self.started_at or {}).get(number)


class ValidationSchedule:
    """Starts validation rounds on ``source`` at the steps the run config asks for."""

    def __init__(
        self, source: TaskSource, *, test_freq: int = -1, val_before_train: bool = False
    ) -> None:
        self.source = source
        self.test_freq = test_freq
        self.val_before_train = val_before_train
        self.last_val_step = -1  # the step the last round started at (-1: none yet)
        # Round number -> the learner step whose weights it measures (its start step, or
        # the last step before it that pushed: see admission.weights_step).
        self.started_at: dict[int, int] = {}

    def start_run(self, step: int) -> None:
        """Before the first training task: the validation round of ``val_before_train``."""
        if self.val_before_train and step == 0 and self.source.val_rounds == 0:
            self.start(0)

    def on_step(self, step: int, weights_step: int | None = None) -> bool:
        """The learner finished ``step``; True when a validation round was started."""
        due = self.test_freq > 0 and step % self.test_freq == 0 and step > self.last_val_step
        return due and self.start(step, weights_step)

    def start(self, step: int, weights_step: int | None = None) -> bool:
        """The one place a validation round starts (before training, every ``test_freq``
        steps, at the end): not when there are no validation rows, nor twice on the same
        weights at one step. ``weights_step``: the step whose weights the servers hold
        (default ``step``), which the round's ``val/step`` reports. True when a round was
        started.

        Found by a review: the end's round was refused at a step whose ``test_freq`` round
        had started on an earlier step's weights (``staleness.sync_every`` not dividing it),
        so the weights the run ends with (pushed at the end) were never validated; and two
        rounds started at step 0 on the same weights (``val_before_train`` then the end of
        a run with no batch to train)."""
        source = self.source
        held = step if weights_step is None else weights_step
        last = self.started_at.get(source.val_rounds - 1, held)  # not recorded: the same
        if not source.val_rows or (self.last_val_step == step and last == held):
            return False
        number = source.start_validation()
        self.last_val_step = step
        self.started_at[number] = held
        if held == step:
            log.info("validation round %d started at step %d", number, step)
        else:
            log.info(
                "validation round %d started at step %d, on the weights of step %d (the last "
                "pushed: staleness.sync_every does not divide trainer.test_freq)",
                number,
                step,
                held,
            )
        return True

    def progress(self) -> ValidationProgress:
        source = self.source
        return ValidationProgress(
            source.val_rounds,
            len(source.val_rows),
            source.val_head,
            dict(self.started_at),
            source.other_val,
        )
