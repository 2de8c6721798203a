"""The task ledger's checkpoint: what :class:`~asyncrl.control.ledger.TaskLedger` saves of
every task id, and how it loads it again (checkpoints from before per-id states included).

The coordinator's state goes into the learner's checkpoints. A restored ledger queues the
tasks that were outstanding (an external slot is given up): their servers belonged to the
old session. A server that still holds one takes it back when it registers again
(``TaskLedger.adopt``), and the buffer's inventory tells which acknowledged groups it still
holds (``TaskLedger.reconcile``); :mod:`asyncrl.control.recovery` says when the coordinator
deals again.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from asyncrl.control.admission import Budget
from asyncrl.control.messages import Task
from asyncrl.control.task_source import TaskSource
from asyncrl.control.task_states import KINDS, QUEUED, Entry, restored


class LedgerCheckpoint:
    """``state_dict`` and ``load_state_dict`` of :class:`~asyncrl.control.ledger.TaskLedger`
    (mixed into it: these are its attributes)."""

    source: TaskSource
    budget: Budget
    entries: dict[str, Entry]
    owned: dict[str, set[str]]
    redeal: deque[str]
    buffered: set[str]
    dealt: Counter[str]
    tally: dict[str, Counter[str]]
    external_serial: int

    def _new(self, tid: str, state: str, task: Task | None) -> Entry:
        raise NotImplementedError  # the ledger's

    def state_dict(self) -> dict[str, Any]:
        """Budget, cursor and every id's state, failures and attempt (plain data)."""
        return {
            "budget": self.budget.state_dict(),
            "source": self.source.state_dict(),
            "entries": {
                tid: [e.state, e.failures, e.task.attempt if e.task else 0]
                for tid, e in self.entries.items()
            },
            "redeal": list(self.redeal),
            "dealt": dict(self.dealt),
            "external_serial": self.external_serial,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; tasks outstanding then are queued (their servers belong to the old
        session; one that still holds its task takes it back when it registers)."""
        self.budget.load_state_dict(state["budget"])
        self.source.load_state_dict(state["source"])
        self.entries.clear()
        self.owned.clear()
        self.redeal.clear()
        self.buffered.clear()
        self.tally = {k: Counter() for k in KINDS}
        self.dealt = Counter()
        saved = state.get("entries")
        if saved is None:  # a checkpoint from before per-id states: what was still owed
            saved = {t: [QUEUED, 0, 1] for t in [*state["outstanding"], *state["redeal"]]}
        order = {tid: i for i, tid in enumerate(state.get("redeal", []))}
        self.external_serial = int(state.get("external_serial", 0))
        for tid, (st, failures, attempt) in saved.items():
            st, task = restored(tid, st, attempt, self.source, self.budget.version)
            self._new(tid, st, task).failures = failures
        queued = [t for t, e in self.entries.items() if e.state == QUEUED]
        self.redeal.extend(sorted(queued, key=lambda t: order.get(t, -1)))
        if "dealt" in state:  # restore the count kept apart from the states
            self.dealt = Counter({k: int(v) for k, v in state["dealt"].items()})
