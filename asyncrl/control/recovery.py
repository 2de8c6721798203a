"""What the coordinator must learn after a restart before it deals again. Pure: no I/O, no
clock (callers pass ``now``).

Two restarts change what the coordinator knows (docs/DESIGN.md section 10: only the learner's
checkpoints are durable):

- **Its own** (the learner restarted from a checkpoint): the restored ledger does not know
  the tasks dealt after that checkpoint. The servers say which ones they still generate when
  they register again (:class:`~asyncrl.control.messages.Register` ``task_ids``) and the
  buffer lists the groups it holds (its inventory); the ledger adopts both, so none is dealt
  twice. Until every server of the saved registry has registered again and the inventory
  came (or ``dead_after_s`` passed), no task is dealt (grant reason ``starting``).
  The restored learner then trains the batches its previous life trained after the
  checkpoint again (the buffer redelivers them, in order), so it reaches the versions that
  life pushed, by the same schedule, to rounding: a server holding one of those versions
  (up to ``replay_through``) holds weights the replay reproduces. It is trusted and keeps
  generating; the learner skips the pushes of those versions (:meth:`ControlState.adopt`).
  Without this, every version pushed after the checkpoint counted twice, and the groups the
  servers generated meanwhile came out stale (7% of a 30-step run dropped for lag).
- **The buffer's** (a new buffer session): groups acknowledged to the old buffer and never
  trained are gone. After a short settling time (pushes queued while it was down land
  first), the inventory of the new buffer tells which acknowledged tasks must be dealt
  again. An ack may come after that (delayed) for a group that died with the old buffer:
  every :data:`AUDIT_EVERY_S` the coordinator asks the buffer which acknowledged groups
  (older than ``dead_after_s``) it never received, and deals those again; not while the
  buffer is full and not reading (then a group may still wait in a socket queue).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SETTLE_S = 2.0  # after a buffer restart: time for queued pushes to reach the new one
AUDIT_EVERY_S = 10.0  # how often acknowledged groups are checked against the buffer


class Recovery:
    """Resume hold and buffer-session tracking for one :class:`ControlState`."""

    def __init__(self, dead_after_s: float, settle_s: float = SETTLE_S):
        self.dead_after_s = dead_after_s
        self.settle_s = settle_s
        self.resuming = False
        self.awaiting: set[str] = set()  # servers of the saved registry not yet back
        self.deadline: float | None = None
        self.needs_inventory = False  # a restored ledger waits for the buffer's inventory
        self.buffer_session = ""
        self.inventory_due: float | None = None  # when to ask for the inventory
        self.cutoff = 0.0  # acks before this and missing from the inventory: lost
        # Versions a replay reproduces (see the module docstring): -1 on a fresh start (none
        # after version 0), None while a restored coordinator waits for the learner to say.
        self.replay_through: int | None = -1
        # The buffer session whose redelivery the replay counts on ("": not said).
        self.replay_session = ""
        self.next_audit = 0.0

    def audit_due(self, now: float) -> float | None:
        """When an audit of acknowledged groups is due now: the cutoff (groups acknowledged
        before it and unknown to the buffer were lost), else None. An ack can reach the
        coordinator after it saw a restarted buffer while its group went to the old one
        (a delayed ack): the one-off inventory cannot catch that, a periodic audit does.
        A group is judged once its ack is ``dead_after_s`` old (its push had that long)."""
        # The resume hold ends by time too, not only when a server asks for tasks.
        if self.holding(now) or self.inventory_due is not None or now < self.next_audit:
            return None
        self.next_audit = now + AUDIT_EVERY_S
        return now - self.dead_after_s

    def restored(self, server_ids: list[str], with_buffer: bool = True) -> None:
        """The ledger was restored from a checkpoint that knew these servers."""
        self.resuming = True
        self.awaiting = set(server_ids)
        self.needs_inventory = with_buffer
        self.replay_through = None

    def registered(self, server_id: str) -> None:
        self.awaiting.discard(server_id)

    def left(self, server_id: str) -> None:
        """A server of the saved registry was reaped before it registered again: it holds
        no task any more (a restarted process holds none), so it is not waited for."""
        if server_id in self.awaiting:
            self.awaiting.discard(server_id)
            log.info("resume: %s left before registering again; not waited for", server_id)

    def holding(self, now: float) -> bool:
        """True while a resumed coordinator must not deal yet."""
        if not self.resuming:
            return False
        if self.deadline is None:
            self.deadline = now + self.dead_after_s
        if (self.awaiting or self.needs_inventory) and now < self.deadline:
            return True
        self.resuming = False
        if self.awaiting or self.needs_inventory:
            log.warning(
                "resumed: dealing without %s after %.0fs (control.dead_after_s); their tasks "
                "are dealt again",
                sorted(self.awaiting) or "the buffer's inventory",
                self.dead_after_s,
            )
        else:
            log.info("resumed: every server registered again and the buffer's inventory came")
        return False

    def replay_lost(self, session: str) -> bool:
        """Whether a drain answered from ``session`` finds the buffer whose redelivery the
        learner's replay counts on (:attr:`replay_session`) gone: restarted between the
        learner's hello and the coordinator's first drain, which then knew no session to
        tell a new one by. Asked once; later restarts are told by the session change."""
        expected, self.replay_session = self.replay_session, ""
        return bool(expected and session and session != expected)

    def buffer_contact(self, session: str, now: float) -> bool:
        """The buffer answered from ``session``; True when an inventory is due now."""
        if session and session != self.buffer_session:
            known = self.buffer_session
            self.buffer_session = session
            if self.needs_inventory:
                self.inventory_due, self.cutoff = now, now
            elif known:  # a new buffer: what the old one held is gone
                log.warning("the buffer restarted (session %s -> %s)", known, session)
                self.inventory_due, self.cutoff = now + self.settle_s, now
        return self.inventory_due is not None and now >= self.inventory_due

    def reconciled(self) -> None:
        self.inventory_due = None
        self.needs_inventory = False
