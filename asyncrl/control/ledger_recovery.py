"""What the task ledger does with what it learns after a restart: the tasks a re-registering
server still generates, the buffer's inventory, and audits of acknowledged groups. Pure: no
I/O, no clock (callers pass ``now`` and cutoffs). Functions over a
:class:`~asyncrl.control.ledger.TaskLedger`'s public state and its two transitions
(``move``, ``requeue``), as :mod:`asyncrl.control.ledger_checkpoint` is for its checkpoint:
the live path (deals, acks, failures, drops, training) stays in the ledger.

After a coordinator restart the restored ledger does not know the tasks dealt after its
checkpoint: :func:`adopt` takes back those a server still holds, :func:`reconcile` those the
buffer holds, each rebuilt from its id when it is one this line could have dealt
(``TaskLedger.our_session``), so none is dealt twice. After a buffer restart the groups
acknowledged to the old buffer are gone: :func:`reconcile` (the new buffer's inventory) and
:func:`lost` (an audit of :func:`acked_before`'s ids) deal them again, and
:func:`rescore` the validation groups it scored that the learner never read.
When each happens is :mod:`asyncrl.control.recovery`'s business.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from asyncrl.control.ledger import TaskLedger
from asyncrl.control.task_source import OtherValidationSet
from asyncrl.control.task_states import (
    BUF,
    DONE,
    GIVEN_UP,
    OUT,
    QUEUED,
    Entry,
    external_task,
    is_external,
    kind_of,
    well_formed_external,
)


def adopt(ledger: TaskLedger, server_id: str, task_ids: Iterable[str], now: float) -> int:
    """A (re-)registering server still works on these tasks (dealt by an earlier
    coordinator session, or queued since): they are outstanding at it again."""
    n = 0
    for tid in task_ids:
        e = ledger.entries.get(tid)
        if e is None:
            e = _rebuilt(ledger, tid, OUT)
            if e is None:
                continue
        elif e.state == QUEUED:
            ledger.move(tid, e, OUT)
        else:
            continue
        e.server, e.since, e.adopted = server_id, now, True
        ledger.owned.setdefault(server_id, set()).add(tid)
        n += 1
    ledger.counts["adopted"] += n
    return n


def give_up_unclaimed(ledger: TaskLedger) -> list[str]:
    """The external slots restored from a checkpoint that no server named by the end of
    the resume hold: their agents' sessions ended with their servers. Given up."""
    ids = sorted(ledger.unclaimed)
    for tid in ids:
        ledger.move(tid, ledger.entries[tid], GIVEN_UP, "unclaimed")
        ledger.counts["external_given_up/unclaimed"] += 1
    return ids


def _rebuilt(ledger: TaskLedger, tid: str, state: str) -> Entry | None:
    """A task dealt by an earlier session, known here from its id (None: not ours)."""
    if is_external(tid):
        if not well_formed_external(tid):
            ledger.counts["adopt_refused"] += 1
            return None
        if not ledger.our_session(tid):
            ledger.counts["adopt_foreign"] += 1
            return None
        return ledger.track(tid, state, external_task(tid, ledger.budget.version))
    try:
        task = ledger.source.task_for_id(tid, ledger.budget.version)
    except KeyError:
        ledger.counts["adopt_foreign"] += 1
        return None
    return ledger.track(tid, state, task)


def reconcile(
    ledger: TaskLedger, held: Iterable[str], reports: Iterable[Any], cutoff: float
) -> int:
    """Match the buffer's inventory: ``held`` ids are in the buffer; ``reports`` list
    what it dropped. A task acknowledged before ``cutoff`` that the buffer has not got
    was lost with a buffer that died: it is dealt again. Returns how many."""
    held = set(held)
    for tid in held:
        e = ledger.entries.get(tid)
        if e is None:
            _rebuilt(ledger, tid, BUF)
        elif e.state in (OUT, QUEUED):
            ledger.move(tid, e, BUF)
    ledger.dropped(reports)
    lost = [
        tid
        for tid, e in ledger.entries.items()
        if e.state == BUF and tid not in held and e.since < cutoff
    ]
    for tid in reversed(lost):
        ledger.requeue(tid, ledger.entries[tid], "lost", front=True)
    return len(lost)


def acked_before(ledger: TaskLedger, before: float) -> list[str]:
    """Ids acknowledged before ``before`` and not trained yet: what an audit of the
    buffer asks about."""
    return sorted(t for t in ledger.buffered if ledger.entries[t].since < before)


def lost(ledger: TaskLedger, task_ids: Iterable[str], before: float) -> int:
    """Acknowledged groups the buffer says it never received (they went to a buffer
    that died, whatever the order the news came in): dealt again. Returns how many."""
    n = 0
    for tid in task_ids:
        e = ledger.entries.get(tid)
        if e is not None and e.state == BUF and e.since < before:
            ledger.requeue(tid, e, "lost", front=True)
            n += 1
    return n


def rescore(ledger: TaskLedger, task_ids: Iterable[str]) -> tuple[int, list[str]]:
    """Validation groups counted as scored whose sums the learner never read: the buffer
    that scored them died first, and its successor has not got them. Dealt again (their
    entries are rebuilt from their ids: a scored entry kept no task). Returns how many, and
    the ids given up instead: a round of the validation set a resume replaced, whose rows
    are no longer read (its round is then reported without them, not waited for)."""
    n, gone = 0, []
    for tid in task_ids:
        e = ledger.entries.get(tid)
        if e is None or e.state != DONE or kind_of(tid) != "val":
            continue
        try:
            e.task = ledger.source.task_for_id(tid, ledger.budget.version)
        except OtherValidationSet:
            ledger.move(tid, e, GIVEN_UP, "other_val_set")
            ledger.counts["val_lost_other_set"] += 1
            gone.append(tid)
            continue
        except KeyError:  # another line's round: not ours to deal
            continue
        ledger.requeue(tid, e, "lost", front=True)
        n += 1
    return n, gone
