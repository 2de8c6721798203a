"""The task ledger's checkpoint format: what :func:`save_ledger` keeps of every task id of a
:class:`~asyncrl.control.ledger.TaskLedger`, and how :func:`load_ledger` reads it back
(checkpoints from before per-id states included). Functions over the ledger's public state:
the ledger itself knows nothing of checkpoints.

The coordinator's state goes into the learner's checkpoints. A restored ledger queues the
tasks that were outstanding (an external slot waits for its server, never dealt): their
servers belonged to the old session. A server that still holds one takes it back when it
registers again
(:func:`~asyncrl.control.ledger_recovery.adopt`), and the buffer's inventory tells which
acknowledged groups it still holds (:func:`~asyncrl.control.ledger_recovery.reconcile`);
:mod:`asyncrl.control.recovery` says when the coordinator deals again.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from asyncrl.control.ledger import TaskLedger
from asyncrl.control.task_states import QUEUED, is_external, restored


def save_ledger(ledger: TaskLedger) -> dict[str, Any]:
    """Budget, cursor and every id's state, failures and attempt (plain data)."""
    return {
        "budget": ledger.budget.state_dict(),
        "source": ledger.source.state_dict(),
        "entries": {
            tid: [e.state, e.failures, e.task.attempt if e.task else 0]
            for tid, e in ledger.entries.items()
        },
        "redeal": list(ledger.redeal),
        "dealt": dict(ledger.dealt),
        # Counters of events (coordinator/tasks/*, refunds by cause): a run's totals.
        "counts": dict(ledger.counts),
        "refunded": dict(ledger.refunded),
        "pacer": ledger.pacer.state_dict() if ledger.pacer is not None else None,
        "external_serial": ledger.external_serial,
        # The sessions of this line, whose external slots a restored ledger takes back.
        "sessions": (
            None
            if ledger.earlier_sessions is None
            else sorted(ledger.earlier_sessions | {ledger.session} - {""})
        ),
    }


def load_ledger(ledger: TaskLedger, state: dict[str, Any]) -> None:
    """Restore ``ledger`` from :func:`save_ledger`'s data; tasks outstanding then are queued
    (their servers belong to the old session; one that still holds its task takes it back
    when it registers)."""
    ledger.budget.load_state_dict(state["budget"])
    ledger.source.load_state_dict(state["source"])
    ledger.reset()
    saved = state.get("entries")
    if saved is None:  # a checkpoint from before per-id states: what was still owed
        saved = {t: [QUEUED, 0, 1] for t in [*state["outstanding"], *state["redeal"]]}
        # Nothing restored counts as trained, so consumption counts from the resume too:
        # against the version's own (version x groups), the window opened that many at once.
        ledger.budget.consumed = 0
    order = {tid: i for i, tid in enumerate(state.get("redeal", []))}
    ledger.external_serial = int(state.get("external_serial", 0))
    sessions = state.get("sessions")  # absent or None: a checkpoint that did not record them
    ledger.earlier_sessions = None if sessions is None else set(sessions)
    for tid, (st, failures, attempt) in saved.items():
        st, task = restored(tid, st, attempt, ledger.source, ledger.budget.version)
        ledger.track(tid, st, task).failures = failures
    queued = [t for t, e in ledger.entries.items() if e.state == QUEUED]
    ledger.unclaimed = {t for t in queued if is_external(t)}
    queued = [t for t in queued if t not in ledger.unclaimed]
    ledger.redeal.extend(sorted(queued, key=lambda t: order.get(t, -1)))
    if "dealt" in state:  # restore the count kept apart from the states
        ledger.dealt = Counter({k: int(v) for k, v in state["dealt"].items()})
    # Absent from checkpoints made before they were kept: they count from the resume.
    ledger.counts.update({k: int(v) for k, v in state.get("counts", {}).items()})
    ledger.refunded.update({k: int(v) for k, v in state.get("refunded", {}).items()})
    if ledger.pacer is not None and state.get("pacer"):  # pacing learned of the servers
        ledger.pacer.load_state_dict(state["pacer"])
