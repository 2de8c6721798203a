"""Who holds which task: deals, acknowledgements, re-deals and refunds. Pure: no I/O, no clock.

Life of a deal:

1. *Dealt* to a server (:meth:`TaskLedger.deal`): it is *outstanding* at that server. A
   training deal is charged to the admission budget (:class:`~asyncrl.control.admission.Budget`).
2. *Acknowledged* (:meth:`TaskLedger.ack`): the server handed the whole group (``n``
   trajectories) to its trajectory socket. From then on the coordinator never re-deals it;
   a group lost after that point (say, with a crashed buffer) is not recovered here, but
   if the buffer saw part of it, its expiry is reported and refunded.
3. Or *released* (:meth:`TaskLedger.release`): its server was declared dead or left before
   acknowledging. The task goes to the front of the re-deal queue under the same id
   (``attempt + 1``) and, if training, is refunded; it is charged again when re-dealt, so
   the budget neither leaks nor double-counts.

Groups the buffer dropped unused (lag, expiry; :meth:`TaskLedger.dropped`) are refunded
once per id; a dropped task still outstanding stops being outstanding (its group can no
longer complete). A training prompt dropped for *lag* (its responses took longer than the
lag window to generate: often the long, hard ones) is dealt again under a new id, up to
``lag_retries`` times, so that lag drops do not quietly bias an epoch towards short
answers; after that it is given up and counted (``lag_given_up``).

Deal order for a request: re-dealt tasks first, then validation, then new training tasks.
Validation tasks are never charged.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from typing import Any

import msgspec

from asyncrl.control.admission import Budget
from asyncrl.control.messages import Task
from asyncrl.control.task_source import TaskSource

#: Refunded ids remembered to ignore a second report of the same drop.
RECENT_REFUNDS = 65536


class TaskLedger:
    """Outstanding deals per server, the re-deal queue and the budget; one owner calls it."""

    def __init__(self, source: TaskSource, budget: Budget, lag_retries: int = 0):
        self.source = source
        self.budget = budget
        self.lag_retries = lag_retries
        self.outstanding: dict[str, tuple[Task, str]] = {}  # task id -> (task, server id)
        self.owned: dict[str, set[str]] = {}  # server id -> outstanding task ids
        self.redeal: deque[Task] = deque()
        self.redeal_log: list[tuple[str, str, str]] = []  # (task id, from server, cause)
        self.counts: Counter[str] = Counter()
        self._refunded: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ dealing
    def deal(self, server_id: str, max_tasks: int) -> tuple[list[Task], str]:
        """Up to ``max_tasks`` tasks for ``server_id`` and, when fewer, why: ``budget``
        (admission refused) or ``exhausted`` (no training data left); ``""`` when all were
        granted."""
        tasks: list[Task] = []
        reason = ""
        while len(tasks) < max_tasks:
            task, reason = self._next()
            if task is None:
                break
            tasks.append(self._hand_out(task, server_id))
        return tasks, ("" if len(tasks) == max_tasks else reason)

    def _next(self) -> tuple[Task | None, str]:
        for i, task in enumerate(self.redeal):
            if task.validation or self.budget.take(1):
                del self.redeal[i]
                return task, ""
        task = self.source.next_val(self.budget.version)
        if task is not None:
            return task, ""
        if self.source.exhausted:
            return None, "exhausted"
        if not self.budget.take(1):
            return None, "budget"
        task = self.source.next_train(self.budget.version)
        assert task is not None  # not exhausted
        return task, ""

    def _hand_out(self, task: Task, server_id: str) -> Task:
        task = msgspec.structs.replace(task, dealt_version=self.budget.version)
        self.outstanding[task.task_id] = (task, server_id)
        self.owned.setdefault(server_id, set()).add(task.task_id)
        self.counts["val_dealt" if task.validation else "train_dealt"] += 1
        if task.attempt:
            self.counts["redealt"] += 1
        return task

    # ------------------------------------------------------------------ outcomes
    def ack(self, task_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """Groups handed to the buffer; returns (acknowledged, unknown) ids.

        An ack counts whoever sends it: a server declared dead too early that still
        finishes a task it lost has delivered it all the same.
        """
        acked, unknown = [], []
        for tid in task_ids:
            entry = self.outstanding.pop(tid, None)
            if entry is None:
                unknown.append(tid)
                continue
            self.owned.get(entry[1], set()).discard(tid)
            acked.append(tid)
            self.counts["val_acked" if entry[0].validation else "train_acked"] += 1
        self.counts["acks_unknown"] += len(unknown)
        return acked, unknown

    def release(self, server_id: str, cause: str) -> list[Task]:
        """Take back every task outstanding at ``server_id`` for re-dealing (``cause``:
        ``dead`` or ``left``), oldest deal first; training ones are refunded."""
        ids = self.owned.pop(server_id, set())
        back = [self.outstanding.pop(tid)[0] for tid in list(self.outstanding) if tid in ids]
        charged = sum(not t.validation for t in back)
        if charged:
            self.budget.refund(charged, cause)
        # Front of the queue, in their original order: they are the oldest work.
        for task in reversed(back):
            self.redeal.appendleft(msgspec.structs.replace(task, attempt=task.attempt + 1))
        self.redeal_log += [(t.task_id, server_id, cause) for t in back]
        return back

    def dropped(self, entries: Iterable[Any]) -> int:
        """Refund training groups the buffer dropped unused (``task_id``, ``cause``,
        ``validation`` like :class:`asyncrl.wire.DroppedTask`); returns how many.

        A dropped task still outstanding is no longer owed (its group cannot complete); one
        waiting for a re-deal leaves the queue and is not refunded again (its release did).
        """
        refunded = 0
        for d in entries:
            self.counts[f"buffer_dropped/{d.cause}"] += 1
            if d.validation or d.task_id in self._refunded:
                continue
            self._refunded[d.task_id] = None
            if len(self._refunded) > RECENT_REFUNDS:
                self._refunded.popitem(last=False)
            entry = self.outstanding.pop(d.task_id, None)
            if entry is not None:
                self.owned.get(entry[1], set()).discard(d.task_id)
            elif self._drop_from_redeal(d.task_id):
                continue
            if self.budget.dealt > 0:  # 0 only after a restart lost track of the deal
                self.budget.refund(1, "expired" if d.cause == "expired" else "lag")
                refunded += 1
            if d.cause == "lag":
                self._retry(d.task_id)
        return refunded

    def _retry(self, task_id: str) -> None:
        """Queue a fresh deal of a prompt dropped for lag (at the back: it is new work),
        unless it has had its ``lag_retries``."""
        try:
            task, k = self.source.retry_of(task_id, self.budget.version)
        except KeyError:  # not one of this source's training ids
            return
        if k > self.lag_retries:
            self.counts["lag_given_up"] += 1
            return
        self.redeal.append(task)
        self.counts["lag_retried"] += 1

    def _drop_from_redeal(self, task_id: str) -> bool:
        for i, task in enumerate(self.redeal):
            if task.task_id == task_id:
                del self.redeal[i]
                return True
        return False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Budget, cursor and the ids still owed (outstanding or queued for re-deal)."""
        return {
            "budget": self.budget.state_dict(),
            "source": self.source.state_dict(),
            "outstanding": list(self.outstanding),
            "redeal": [t.task_id for t in self.redeal],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; every owed task is queued for re-deal under its id (outstanding training
        ones refunded first: the servers that held them belong to the old session)."""
        self.budget.load_state_dict(state["budget"])
        self.source.load_state_dict(state["source"])
        self.outstanding.clear()
        self.owned.clear()
        tasks = [
            self.source.task_for_id(tid, self.budget.version)
            for tid in [*state["outstanding"], *state["redeal"]]
        ]
        charged = sum(not t.validation for t in tasks[: len(state["outstanding"])])
        if charged:
            self.budget.refund(charged, "restore")
        self.redeal = deque(msgspec.structs.replace(t, attempt=1) for t in tasks)

    def metrics(self) -> dict[str, float]:
        out = {f"coordinator/tasks/{k}": float(v) for k, v in sorted(self.counts.items())}
        out["coordinator/tasks/outstanding"] = float(len(self.outstanding))
        out["coordinator/tasks/redeal_queue"] = float(len(self.redeal))
        return out | self.budget.metrics() | self.source.metrics()
