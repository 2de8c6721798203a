"""DAPO's dynamic sampling, the coordinator's half (``algorithm.filter_groups.*``).

The rollout servers filter: a training task dealt with ``filter=True`` whose group's
members all score alike (:func:`asyncrl.rewards.shaping.has_signal`) is never pushed; its
server acknowledges it as filtered, the ledger records it ``dropped/filtered`` and its
admission budget is free at once, so the next task request gets a fresh prompt and the
learner's batch fills with groups that carry a signal.

This object decides whether a task is dealt with the filter on, and keeps the counts.
``max_num_gen_batches`` bounds the filtered groups per trained batch, in veRL's unit:
generation batches of ``data.gen_batch_size`` prompts (``data.train_batch_size`` when
unset). Past ``max_num_gen_batches * gen_batch_size`` filtered groups since the last
trained step, tasks are dealt unfiltered until the learner trains again, and the run says
so in one line. Tasks already out with the filter on are still judged, so the filtered
groups of one batch can pass the bound by those in flight when it is reached (at most the
admission window). veRL counts kept and filtered prompts together and raises at the bound;
here the batch's own groups come on top, and the run goes on. Without a bound (0, veRL's
default) a run where nearly everything is filtered keeps dealing, and says so every
``NOTE_EVERY_BATCHES`` batches' worth of filtered groups.

With ``skip_uninformative`` it also keeps each training row's filtered streak
(:class:`~asyncrl.control.prompt_skip.PromptSkip`), and the task source asks it whether to
pass a row over before dealing it: the filter's cost is then paid for fewer groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from asyncrl.control.prompt_skip import PromptSkip

if TYPE_CHECKING:
    from asyncrl.control.messages import Task
    from asyncrl.control.task_source import TaskSource

log = logging.getLogger(__name__)

NOTE_EVERY_BATCHES = 20


class GroupFilter:
    """Whether to deal tasks filtered, and what the filter did (``filter/*`` metrics)."""

    def __init__(
        self,
        *,
        enable: bool,
        max_num_gen_batches: int,
        batch_size: int,
        skip: PromptSkip | None = None,
    ):
        """``batch_size``: prompts in a generation batch, the bound's unit."""
        self.enable = enable
        self.skip = skip if enable else None
        self._judging: set[str] = set()  # dealt with the filter on, not yet acked
        self.row_of: Callable[[str], int | None] | None = None  # set with the task source
        self.batch_size = max(1, batch_size)
        self.bound = max_num_gen_batches * self.batch_size if max_num_gen_batches > 0 else 0
        self.max_num_gen_batches = max_num_gen_batches
        self.since_step = 0  # groups filtered since the learner last trained
        self.total = 0
        self.bound_hits = 0
        self.last_frac = 0.0
        self.last_per_trained = 1.0

    def state_dict(self) -> dict[str, Any]:
        """Its counts (saved with the coordinator: a resumed run's ``filter/*`` go on, and
        the ``max_num_gen_batches`` bound keeps counting from where it was)."""
        out: dict[str, Any] = {
            "since_step": self.since_step,
            "total": self.total,
            "bound_hits": self.bound_hits,
        }
        if self.skip is not None:
            out["skip"] = self.skip.state_dict()
            # Tasks out with the filter on: a server that takes one back after a restart
            # still gives its row a verdict (an informative group ends the row's streak).
            out["judging"] = sorted(self._judging)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.since_step = int(state["since_step"])
        self.total = int(state["total"])
        self.bound_hits = int(state["bound_hits"])
        if self.skip is not None and "skip" in state:  # saved without it: streaks start again
            self.skip.load_state_dict(state["skip"])
            self._judging = set(state.get("judging", []))

    @property
    def active(self) -> bool:
        """Deal the next training task with the filter on."""
        return self.enable and not (self.bound and self.since_step >= self.bound)

    def skip_row(self, row: int, epoch: int, position: int) -> bool:
        """Pass training row ``row`` over at ``position`` of ``epoch`` (never while the
        filter is off or past its bound: then every group trains, whatever it scores)."""
        return self.skip is not None and self.active and self.skip.skip(row, epoch, position)

    def attach(self, source: TaskSource) -> None:
        """Skip rows of ``source`` (when skipping is on): it asks before dealing a row, and
        names the row of an acked task."""
        if self.skip is not None:
            source.skip = self.skip_row
            self.row_of = source.row_of

    def dealt(self, tasks: Iterable[Task]) -> None:
        """Tasks just dealt: the acks of those dealt with the filter on are verdicts. A
        group dealt unfiltered (past the bound) is pushed whatever it scores, also when an
        earlier deal of the same task (before its server died) was filtered."""
        if self.skip is None:
            return
        for t in tasks:
            if t.filter:
                self._judging.add(t.task_id)
            else:
                self._judging.discard(t.task_id)

    def forget(self, task_ids: Iterable[str]) -> list[str]:
        """Those of ``task_ids`` dealt with the filter on, forgotten (acked, or failed and
        dealt again)."""
        out = [t for t in task_ids if t in self._judging]
        self._judging.difference_update(out)
        return out

    def keep_only(self, pending: Callable[[str], bool]) -> None:
        """Forget the tasks awaiting a verdict that will never get one (trained, dropped or
        given up without an ack of their server's): kept, they grew the set and every
        checkpoint for the whole run."""
        self._judging = {t for t in self._judging if pending(t)}

    def verdicts(self, task_ids: list[str], filtered: bool) -> None:
        """Acked tasks' groups were filtered, or pushed to be trained: their rows'
        streaks (only for groups the filter judged; ``row_of`` names a task's row)."""
        judged = self.forget(task_ids)
        if self.skip is None or self.row_of is None:
            return
        for tid in task_ids if filtered else judged:
            row = self.row_of(tid)
            if row is not None:
                self.skip.record(row, informative=not filtered)

    def filtered(self, n: int, step: int) -> None:
        """A server filtered ``n`` groups."""
        if n <= 0:
            return
        before = self.since_step
        self.since_step += n
        self.total += n
        if self.bound and before < self.bound <= self.since_step:
            self.bound_hits += 1
            log.warning(
                "filter_groups: %d groups in a row filtered since step %d (every member "
                "scored alike), the bound of algorithm.filter_groups.max_num_gen_batches=%d "
                "batches of %d: dealing unfiltered until the next step, which trains what "
                "comes; the prompts may be too easy or too hard for the model",
                self.since_step,
                step,
                self.max_num_gen_batches,
                self.batch_size,
            )
        elif not self.bound:
            note = NOTE_EVERY_BATCHES * self.batch_size
            if before // note < self.since_step // note:
                log.warning(
                    "filter_groups: %d groups filtered since step %d and none trained; "
                    "set algorithm.filter_groups.max_num_gen_batches to bound the search",
                    self.since_step,
                    step,
                )

    def trained(self, groups: int) -> None:
        """The learner trained a batch of ``groups`` groups: the count starts again."""
        if groups <= 0 or not self.enable:
            return
        self.last_frac = self.since_step / (self.since_step + groups)
        self.last_per_trained = (self.since_step + groups) / groups
        self.since_step = 0
        if self.skip is not None:
            self.skip.stepped()

    def metrics(self) -> dict[str, float]:
        if not self.enable:
            return {}
        return {
            "filter/filtered_frac": self.last_frac,
            "filter/prompts_per_trained_group": self.last_per_trained,
            "filter/groups_filtered": float(self.total),
            "filter/since_step": float(self.since_step),
            "filter/bound_hits": float(self.bound_hits),
            "filter/active": float(self.active),
        } | (self.skip.metrics() if self.skip is not None else {})
