"""Where every task is: deals, acks, failures, re-deals, drops, training. Pure: no I/O, no
clock (callers pass ``now``).

Each task id has one *state* (:mod:`asyncrl.control.task_states`).

So ``dealt = in flight + in buffer + trained + dropped + given up`` at every moment
(:meth:`TaskLedger.accounting`; ``dealt`` is counted apart, so a lost transition shows as
``unaccounted``). Transitions come from what the coordinator hears: its own deals, server
acks and negative acks, server deaths, timeouts, the buffer's drop reports and inventory,
and the task ids of trained batches. They are idempotent and order-tolerant: a late ack of a
task already trained changes nothing, a task re-dealt after its first copy was delivered
ends as one id, once.

Admission (:mod:`asyncrl.control.admission`) charges a training task while it is in flight
at a server, in the buffer or trained; queued, dropped and given-up ones are not charged.

A training prompt dropped for *lag* (often the long, hard ones) is dealt again under a new
id, up to ``lag_retries`` times, so that lag drops do not bias an epoch towards short
answers; after that it is given up as a prompt (``coordinator/tasks/lag_given_up``).

Deal order for a request: queued tasks first, then validation, then new training tasks.

What a checkpoint holds, and how it loads: :mod:`asyncrl.control.ledger_checkpoint`. What
the ledger takes back after a restart (the tasks servers still hold, the buffer's inventory
and audits): :mod:`asyncrl.control.ledger_recovery`, over :meth:`TaskLedger.move` and
:meth:`TaskLedger.requeue`, the two transitions.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from asyncrl.control.admission import Budget
from asyncrl.control.grant_size import FULL, TAKE, TOO_LARGE, GrantRoom
from asyncrl.control.messages import Task
from asyncrl.control.pacing import Pacer
from asyncrl.control.task_source import TaskSource
from asyncrl.control.task_states import (
    BUF,
    CHARGED,
    DONE,
    DROP_REASONS,
    GIVEN_UP,
    OUT,
    QUEUED,
    TALLIES,
    TERMINAL,
    Drops,
    Entry,
    accounting,
    external_id,
    external_task,
    is_external,
    kind_of,
    well_formed_external,
)

__all__ = ["DONE", "TaskLedger", "kind_of"]

#: Seconds a refused agent's claim on the next free slot lasts (OpenAI clients retry a 429
#: after its Retry-After, 1 s).
AGENT_HOLD_S = 3.0


def _tallies(tid: str, kind: str) -> tuple[str, ...]:
    """The tallies ``tid`` counts in: its kind, and ``external`` for an endpoint slot."""
    return (kind, "external") if is_external(tid) else (kind,)


def _earlier_deal(e: Entry, attempt: int, session: str = "") -> bool:
    """Whether a server's report naming ``attempt`` (of a deal by coordinator ``session``,
    "" not said) is of an earlier deal than ``e``'s current one. An adopted entry's attempt
    is the server's own: taken as current. A learner restart starts attempts over, so an
    old coordinator's deal is told by its session: a report it never answered, sent again
    to the restored one, must not end that one's deal of the same id."""
    if e.adopted or e.task is None:
        return False
    dealt_by = e.task.dealt_session
    return e.task.attempt != attempt or bool(session and dealt_by and session != dealt_by)


class TaskLedger:
    """Every task id's state, the re-deal queue and the budget; one owner calls it."""

    def __init__(
        self,
        source: TaskSource,
        budget: Budget,
        lag_retries: int = 0,
        task_retries: int = 3,
        task_timeout_s: float = float("inf"),
        session: str = "",
        pacer: Pacer | None = None,
    ):
        self.source = source
        self.pacer = pacer  # per-server caps (staleness.pace_servers); None: none
        # Names this incarnation's external slots (``ext/<session>/<n>``): slots are never
        # dealt again, so their ids need not survive a restart, only never repeat.
        self.session = session
        # The earlier sessions of this line (the checkpoints it descends from): a server
        # may hand back their external slots. A fresh ledger has none: a slot dealt by a
        # coordinator whose line ended (a restart without a checkpoint) is not taken back,
        # as a training id of another lineage is not. None: any session (a checkpoint
        # from before sessions were recorded).
        self.earlier_sessions: set[str] | None = set()
        self.budget = budget
        self.lag_retries = lag_retries
        self.task_retries = task_retries
        self.task_timeout_s = task_timeout_s
        self.entries: dict[str, Entry] = {}
        self.owned: dict[str, set[str]] = {}  # server id -> ids OUT there
        self.redeal: deque[str] = deque()  # QUEUED ids, in deal order (external ones never)
        # External slots restored QUEUED from a checkpoint: their agents' sessions live on at
        # a server that may still hold them; given up if none names them by the hold's end.
        self.unclaimed: set[str] = set()
        self.buffered: set[str] = set()  # BUF ids: acknowledged, not yet trained
        self.counts: Counter[str] = Counter()  # events
        self.dealt: Counter[str] = Counter()  # kind -> distinct ids dealt
        self.tally: dict[str, Counter[str]] = {k: Counter() for k in TALLIES}
        self._serial = 0
        self.external_serial = 0  # external slots this incarnation dealt
        # Until then one free slot is kept for an agent refused a slot: the servers' own
        # task loops ask again the moment a slot frees, and would take every one first.
        self.agent_waiting_until = float("-inf")
        self.refunded: Counter[str] = Counter()  # training deals uncharged, by cause

    # ------------------------------------------------------------------ state changes
    def move(self, tid: str, e: Entry, state: str, cause: str = "") -> None:
        """Move ``tid`` (its entry ``e``) to ``state``; ``cause`` names a refund. Every state
        change goes through here (or :meth:`requeue`), so that the tallies, the re-deal
        queue, the buffered ids and the owners stay in step."""
        kind = kind_of(tid)
        if kind == "train" and e.state in CHARGED and state not in CHARGED:
            self.refunded[cause or state] += 1  # it leaves the admission budget
        for k in _tallies(tid, kind):
            self.tally[k][e.state] -= 1
            self.tally[k][state] += 1
        if e.state == BUF:
            self.buffered.discard(tid)
        elif state == BUF:
            self.buffered.add(tid)
        if e.state == OUT:
            self.owned.get(e.server, set()).discard(tid)
        elif e.state == QUEUED and tid in self.unclaimed:
            self.unclaimed.discard(tid)
        elif e.state == QUEUED:
            self.redeal.remove(tid)
        e.state = state
        if state in TERMINAL:
            e.task = None

    def reset(self) -> None:
        """Forget every id (a checkpoint is about to be loaded)."""
        self.entries.clear()
        self.owned.clear()
        self.redeal.clear()
        self.unclaimed.clear()
        self.buffered.clear()
        self.tally = {k: Counter() for k in TALLIES}
        self.dealt = Counter()

    def track(self, tid: str, state: str, task: Task | None) -> Entry:
        """Start tracking ``tid`` in ``state`` (a new deal, or one read from a checkpoint)."""
        e = self.entries[tid] = Entry(state, task)
        for k in _tallies(tid, kind_of(tid)):
            self.dealt[k] += 1
            self.tally[k][state] += 1
        if state == BUF:
            self.buffered.add(tid)
        return e

    def requeue(self, tid: str, e: Entry, cause: str, front: bool) -> None:
        """Back to the re-deal queue under the same id (``attempt + 1``); an external slot
        is given up instead (its agent talked to the server that lost it)."""
        if is_external(tid):
            self.move(tid, e, GIVEN_UP, cause)
            self.counts[f"external_given_up/{cause}"] += 1
            return
        self.move(tid, e, QUEUED, cause)
        assert e.task is not None
        e.task = msgspec.structs.replace(e.task, attempt=e.task.attempt + 1)
        (self.redeal.appendleft if front else self.redeal.append)(tid)
        self.counts[f"requeued/{cause}"] += 1

    @property
    def committed(self) -> int:
        """Training tasks charged to the admission budget."""
        t = self.tally["train"]
        return t[OUT] + t[BUF] + t[DONE]

    @property
    def outstanding(self) -> dict[str, str]:
        """Task id -> server, for every task outstanding at a server."""
        return {tid: s for s, ids in self.owned.items() for tid in ids}

    # ------------------------------------------------------------------ dealing
    def deal(
        self, server_id: str, max_tasks: int, now: float = 0.0, fit: GrantRoom | None = None
    ) -> tuple[list[Task], str]:
        """Up to ``max_tasks`` tasks for ``server_id`` and, when fewer, why: ``budget``
        (admission refused), ``pace`` (the server holds its cap of training groups, see
        :mod:`asyncrl.control.pacing`), ``exhausted`` (no training data left) or ``size``
        (the next would not fit in ``fit``'s bytes or the server's free slots: it stays
        queued); ``""`` when all were
        granted. A task too large for any grant is dropped (:mod:`~.grant_size`)."""
        tasks: list[Task] = []
        reason = ""
        room = self._pace_room(server_id, max_tasks)
        while len(tasks) < max_tasks:
            tid, reason = self._next(now, train=room > 0)
            if tid is None:
                break
            verdict = fit.admit(self._queued_task(tid)) if fit is not None else TAKE
            if verdict == TOO_LARGE:  # never charged: nothing to refund
                self.move(tid, self.entries[tid], "dropped/oversize", "oversize")
                continue
            if verdict == FULL:
                reason = "size"
                break
            task = self._hand(tid, server_id, now)
            tasks.append(task)
            room -= kind_of(tid) == "train"
            self.counts["val_dealt" if task.validation else "train_dealt"] += 1
            if task.attempt:
                self.counts["redealt"] += 1
        return tasks, ("" if len(tasks) == max_tasks else reason)

    def deal_external(self, server_id: str, now: float = 0.0) -> tuple[Task | None, str]:
        """One external slot for ``server_id``, or None and ``budget`` when admission
        refuses (queued re-deals do not go first: the agent waits on this answer)."""
        if not self.budget.free(self.committed):
            self.agent_waiting_until = now + AGENT_HOLD_S
            return None, "budget"
        self.agent_waiting_until = float("-inf")  # served (another refusal sets it again)
        self.external_serial += 1
        tid = external_id(self.session, self.external_serial)
        while tid in self.entries:  # an old checkpoint's plain ids share no session
            self.external_serial += 1
            tid = external_id(self.session, self.external_serial)
        self.track(tid, QUEUED, external_task(tid, self.budget.version))
        self.redeal.append(tid)  # move() takes it from the queue to OUT
        self.counts["external_dealt"] += 1
        return self._hand(tid, server_id, now), ""

    def budget_holders(self, server_id: str) -> str:
        """Who holds the admission budget, in one line (for a refused external slot)."""
        t = self.tally["train"]
        mine = sum(is_external(tid) for tid in self.owned.get(server_id, ()))
        return (
            f"{self.committed} of the {self.budget.limit} groups admitted so far are charged: "
            f"{t[DONE]} trained, {t[OUT]} generating ({self.tally['external'][OUT]} of them "
            f"endpoint groups, {mine} at this server), {t[BUF]} waiting in the buffer"
        )

    def _hand(self, tid: str, server_id: str, now: float) -> Task:
        """Mark queued ``tid`` outstanding at ``server_id``; its task as dealt now."""
        e = self.entries[tid]
        self.move(tid, e, OUT)
        e.server, e.since, e.adopted = server_id, now, False
        self._serial += 1
        e.serial = self._serial
        self.owned.setdefault(server_id, set()).add(tid)
        assert e.task is not None
        e.task = msgspec.structs.replace(
            e.task, dealt_version=self.budget.deal_version, dealt_session=self.session
        )
        return e.task

    def _pace_room(self, server_id: str, wanted: int) -> int:
        """Training groups ``server_id`` may still be dealt under its pace, ``wanted``
        without pacing (endpoint slots are not paced: their agents ask for them)."""
        if self.pacer is None:
            return wanted
        ids = self.owned.get(server_id, ())
        holding = sum(kind_of(t) == "train" and not is_external(t) for t in ids)
        return self.pacer.room(server_id, holding)

    def _free_for_dataset(self, now: float) -> int:
        """Training slots the dataset may take now: the budget's, less one while an agent
        waits for one (see ``agent_waiting_until``)."""
        return self.budget.free(self.committed) - (now < self.agent_waiting_until)

    def _next(self, now: float, train: bool = True) -> tuple[str | None, str]:
        """The next task to deal (queued first, then validation, then new training), or
        None and why; ``train=False``: validation only (the server holds its pace)."""
        for tid in self.redeal:
            if kind_of(tid) == "val" or (train and self._free_for_dataset(now) > 0):
                return tid, ""
        while True:  # ids adopted from an earlier session are skipped, not dealt twice
            task = self.source.next_val(self.budget.version)
            if task is None or task.task_id not in self.entries:
                break
        if task is None:
            if not train:
                return None, "pace"
            if self.source.exhausted:
                return None, "exhausted"
            if self._free_for_dataset(now) <= 0:
                return None, "budget"
            task = self.source.next_train(self.budget.version)
            while task is not None and task.task_id in self.entries:
                task = self.source.next_train(self.budget.version)
            if task is None:
                return None, "exhausted"
        self.track(task.task_id, QUEUED, task)
        self.redeal.append(task.task_id)  # move() takes it from the queue to OUT
        return task.task_id, ""

    # ------------------------------------------------------------------ outcomes
    def ack(
        self, task_ids: Iterable[str], now: float = 0.0, server_id: str = ""
    ) -> tuple[list[str], list[str]]:
        """Groups ``server_id`` handed to the buffer; returns (acknowledged, unknown) ids.

        An ack counts whoever sends it: a server declared dead too early that still
        finishes a task it lost has delivered it all the same, and it is the one the pacer
        then credits or blames (the task's last holder was, a fast server blamed for a
        slow one's late group). An id already in the buffer or beyond is "unknown" (its
        first delivery counted).
        """
        acked, unknown = [], []
        for tid in task_ids:
            e = self.entries.get(tid)
            if e is None or e.state not in (OUT, QUEUED):
                unknown.append(tid)
                continue
            self.move(tid, e, BUF)
            e.since = now
            e.server = server_id or e.server  # after the move: it left its holder's tasks
            acked.append(tid)
            # As the deals are counted: an endpoint slot apart from the training tasks.
            self.counts["external_acked" if is_external(tid) else f"{kind_of(tid)}_acked"] += 1
        self.counts["acks_unknown"] += len(unknown)
        return acked, unknown

    def filtered(
        self,
        server_id: str,
        task_ids: Sequence[str],
        reason: str = "filtered",
        attempts: Sequence[int] | None = None,
        session: str = "",
    ) -> list[str]:
        """Training groups ``server_id`` dropped before the push: terminal
        (``dropped/<reason>``: ``filtered`` by the group filter, ``prompt_too_long`` by
        ``data.filter_overlong_prompts``), out of the budget at once; returns the ids taken.
        A report of a task dealt again to another server since is ignored (that one's group
        counts), and so, with ``attempts``, is one of an earlier deal at the same server (a
        report sent again after a lost reply): the later deal's group is judged itself."""
        said = attempts if attempts is not None and len(attempts) == len(task_ids) else None
        done = []
        for i, tid in enumerate(task_ids):
            e = self.entries.get(tid)
            holder = e is not None and (
                e.state == QUEUED or (e.state == OUT and e.server == server_id)
            )
            if e is None or not holder or kind_of(tid) != "train":
                self.counts["filtered_unknown"] += 1
                continue
            if said is not None and e.state == OUT and _earlier_deal(e, said[i], session):
                self.counts["filtered_of_earlier_deals"] += 1
                continue
            self.move(tid, e, f"dropped/{reason}", reason)
            done.append(tid)
        return done

    def nack(
        self,
        server_id: str,
        task_ids: Sequence[str],
        cause: str = "failed",
        attempts: Sequence[int] | None = None,
        session: str = "",
    ) -> int:
        """Tasks that failed at ``server_id`` (a negative ack): dealt again, or given up
        after ``task_retries`` failures; returns how many go back to the queue. With
        ``attempts`` (each task's attempt as dealt there), a report of an earlier deal is
        ignored: one sent again after a lost reply, while the task was dealt to the same
        server again, failed that new deal too (generated twice, given up early)."""
        back = 0
        said = attempts if attempts is not None and len(attempts) == len(task_ids) else None
        for i, tid in enumerate(task_ids):
            e = self.entries.get(tid)
            if e is None or e.state != OUT or e.server != server_id:
                self.counts["nacks_unknown"] += 1
                continue
            if said is not None and _earlier_deal(e, said[i], session):
                self.counts["nacks_of_earlier_deals"] += 1
                continue
            back += self._fail(tid, e, cause)
        return back

    def _fail(self, tid: str, e: Entry, cause: str) -> int:
        e.failures += 1
        self.counts[f"failures/{cause}"] += 1
        if e.failures > self.task_retries:
            self.move(tid, e, GIVEN_UP, cause)
            self.counts["given_up"] += 1
            return 0
        self.requeue(tid, e, cause, front=False)
        return 1

    def reclaim(self, now: float) -> list[str]:
        """Take back tasks outstanding longer than ``task_timeout_s`` (a backstop for a
        live server that lost them); they count as failures. Not endpoint slots: an
        agent's episode may outlast it (a long tool-using task), and the server gives its
        slot back itself when the group goes idle (``group_idle_s``) or the server dies."""
        late = [
            tid
            for ids in self.owned.values()
            for tid in ids
            if now - self.entries[tid].since > self.task_timeout_s and not is_external(tid)
        ]
        for tid in late:
            self._fail(tid, self.entries[tid], "timeout")
        return late

    def release(self, server_id: str, cause: str) -> list[Task]:
        """Take back every task outstanding at ``server_id`` for re-dealing (``cause``:
        ``dead`` or ``left``), oldest deal first, at the front of the queue."""
        ids = sorted(self.owned.get(server_id, ()), key=lambda t: self.entries[t].serial)
        if self.pacer is not None:
            self.pacer.forget(server_id)
        for tid in reversed(ids):  # each to the front: the oldest ends up first
            self.requeue(tid, self.entries[tid], cause, front=True)
        self.owned.pop(server_id, None)
        return [self._queued_task(tid) for tid in ids if not is_external(tid)]

    def _queued_task(self, tid: str) -> Task:
        task = self.entries[tid].task
        assert task is not None  # only terminal entries drop their task
        return task

    def trained(self, task_ids: Iterable[str]) -> None:
        """Groups the learner trained on (validation: the buffer scored them)."""
        for tid in task_ids:
            e = self.entries.get(tid)
            if e is None and kind_of(tid) == "val" and not self._ours(tid):
                # Another line's round, scored by a buffer that outlived it (a new line
                # reads the buffer's reports from their start): not ours to count.
                self.counts["validated_foreign"] += 1
            elif e is None:  # dealt by an earlier session and never seen by this one
                self.track(tid, DONE, None)
            elif e.state != DONE:
                if self.pacer is not None and e.server and kind_of(tid) == "train":
                    self.pacer.fresh(e.server)
                self.move(tid, e, DONE)

    def is_out(self, tid: str) -> bool:
        """Whether ``tid`` is dealt and at a server now."""
        e = self.entries.get(tid)
        return e is not None and e.state == OUT

    def already_trained(self, task_ids: Iterable[str]) -> set[str]:
        """Those of ``task_ids`` whose groups were trained on (since the checkpoint this
        ledger was restored from, or ever): a second copy must not be trained again."""
        return {t for t in task_ids if (e := self.entries.get(t)) is not None and e.state == DONE}

    def dropped(self, reports: Iterable[Any]) -> Drops:
        """Groups the buffer dropped unused (``task_id``, ``cause``, ``validation`` like
        :class:`asyncrl.wire.DroppedTask`); returns how many left the budget and how many
        prompts were given up. A training prompt dropped for lag is queued again under a
        new id, ``lag_retries`` times at most.

        An id this ledger never dealt is recorded only when it is one of its own (dealt by
        an earlier life of this lineage after the checkpoint, so that it is not dealt
        again); anything else (another lineage's, or a made-up id) is counted and ignored.
        """
        refunded = given_up = overflowed = overflow_given_up = 0
        for d in reports:
            reason = d.cause if d.cause in DROP_REASONS else "expired"
            e = self.entries.get(d.task_id)
            if e is not None and e.state in TERMINAL:
                continue  # reported before (an inventory repeats every drop)
            if e is None and not self._ours(d.task_id):
                self.counts["drops_foreign"] += 1
                continue
            self.counts[f"buffer_dropped/{d.cause}"] += 1
            if e is None:
                self.track(d.task_id, f"dropped/{reason}", None)
            else:
                refunded += e.state in CHARGED and kind_of(d.task_id) == "train"
                self.move(d.task_id, e, f"dropped/{reason}", reason)
            if reason == "lag" and kind_of(d.task_id) == "train":
                given_up += self._retry(d.task_id, reason)
                if self.pacer is not None and e is not None and e.server:
                    self.pacer.stale(e.server)
            elif reason == "overflow" and kind_of(d.task_id) == "train":
                # The buffer had no room for another incomplete group: not the prompt's
                # fault, so it is dealt again (under the same bound as lag drops), and
                # past it given up, said as lag drops' are (not "dealt again").
                if self._retry(d.task_id, reason):
                    overflow_given_up += 1
                else:
                    overflowed += 1
        return Drops(refunded, given_up, overflowed, overflow_given_up)

    def _retry(self, task_id: str, reason: str) -> bool:
        """Queue a prompt dropped for ``reason`` (lag, overflow) again under a new id;
        True when it ran out of ``lag_retries`` instead."""
        try:
            task, k = self.source.retry_of(task_id, self.budget.version)
        except KeyError:  # not one of this source's training ids
            return False
        if k > self.lag_retries:
            self.counts[f"{reason}_given_up"] += 1
            return True
        if task.task_id not in self.entries:
            self.track(task.task_id, QUEUED, task)
            self.redeal.append(task.task_id)
            self.counts[f"{reason}_retried"] += 1
        return False

    # ------------------------------------------------------------------ lineage
    def _ours(self, tid: str) -> bool:
        """Whether ``tid`` could have been dealt by this lineage (its source's id, or a
        well-formed external slot id of one of its sessions)."""
        if is_external(tid):
            return well_formed_external(tid) and self.our_session(tid)
        try:
            self.source.task_for_id(tid)
        except KeyError:
            return False
        return True

    def our_session(self, tid: str) -> bool:
        """Whether external slot ``tid`` was dealt by this line (this session or one it
        was restored from); a plain ``ext/<n>`` names no session and is taken as ours."""
        parts = tid.split("/")
        if len(parts) == 2 or self.earlier_sessions is None:
            return True
        return parts[1] == self.session or parts[1] in self.earlier_sessions

    # ------------------------------------------------------------------ metrics
    def accounting(self) -> dict[str, float]:
        """``accounting/<kind>/...``: dealt and where every dealt task is now."""
        out = accounting(self.tally, self.dealt)
        # Prompts out of lag retries: ids already among the lag drops, named apart.
        out["accounting/train/prompts_out_of_lag_retries"] = float(self.counts["lag_given_up"])
        return out

    def metrics(self) -> dict[str, float]:
        out = {f"coordinator/tasks/{k}": float(v) for k, v in sorted(self.counts.items())}
        out["coordinator/tasks/outstanding"] = float(sum(len(s) for s in self.owned.values()))
        out["coordinator/tasks/redeal_queue"] = float(len(self.redeal))
        out |= self.budget.metrics(self.committed) | self.source.metrics()
        out |= {f"coordinator/budget/refunded/{c}": float(n) for c, n in self.refunded.items()}
        if self.pacer is not None:
            out |= {f"coordinator/{k}": v for k, v in self.pacer.metrics().items()}
        return out | self.accounting()
