"""Which released batches each consumer holds unacknowledged, and which it gets again.

A batch released by :class:`buffer.core.ReplayBuffer` stays here until the consumer
acknowledges it (its checkpoint contains it). Two ways it is released again, unchanged:

- *resent*: the consumer says which batch it received last (``received``); one released to
  it after that was never received (its reply came after the consumer stopped waiting);
- *redelivered*: the consumer restarted (:meth:`Deliveries.restart`), holding nothing
  beyond its checkpoint's ``acked_through``: its other batches are queued, in batch id
  order, and marked ``redelivered`` (the learner replays them).

Batch ids are unique within the buffer's ``session`` only, so an ``acked_through`` or a
``received`` of another session (the buffer restarted since) names none of these batches.
Pure bookkeeping: which groups the batches hold is the buffer's business.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import msgspec

from asyncrl.wire import Batch

Received = tuple[str, int | None]  # (buffer session, last batch id received or None)


class Deliveries:
    """Unacknowledged batches by id (in id order), their consumers, the redelivery queue."""

    def __init__(self, session: str):
        self.session = session
        self.unacked: dict[int, Batch] = {}
        self.owner: dict[int, str] = {}  # unacked batch id -> consumer id
        self.redeliver: deque[int] = deque()

    def record(self, batch: Batch, consumer: str) -> None:
        """``batch`` was just released to ``consumer``."""
        self.unacked[batch.batch_id] = batch
        self.owner[batch.batch_id] = consumer

    def resend(self, consumer: str, received: Received | None) -> Batch | None:
        """The oldest batch released to ``consumer`` after what it ``received`` (None: it
        does not say), not counting one waiting in the redelivery queue."""
        if received is None:
            return None
        session, last = received
        for bid in self.unacked:  # batch id order
            if self.owner.get(bid) != consumer or bid in self.redeliver:
                continue
            if session != self.session or last is None or bid > last:
                return self.unacked[bid]
        return None

    def redelivery(self, consumer: str) -> Batch | None:
        """The next batch queued by :meth:`restart`, marked redelivered, now ``consumer``'s."""
        if not self.redeliver:
            return None
        bid = self.redeliver.popleft()
        self.owner[bid] = consumer
        # Kept marked: sent again (its reply lost), it is still a replay.
        self.unacked[bid] = msgspec.structs.replace(self.unacked[bid], redelivered=True)
        return self.unacked[bid]

    def ack(self, batch_ids: Iterable[int]) -> tuple[list[Batch], list[int]]:
        """Forget these batches; returns (the acknowledged batches, unknown ids)."""
        acked, unknown = [], []
        for bid in batch_ids:
            batch = self.unacked.pop(bid, None)
            if batch is None:
                unknown.append(bid)
                continue
            self.owner.pop(bid, None)
            if bid in self.redeliver:
                self.redeliver.remove(bid)
            acked.append(batch)
        return acked, unknown

    def forget(self, consumer: str | None) -> list[Batch]:
        """Every unacknowledged batch of ``consumer`` (None: every consumer's), forgotten:
        its consumer started over without them."""
        mine = [b for b in self.unacked if consumer is None or self.owner.get(b) == consumer]
        return self.ack(mine)[0]

    def restart(
        self, acked_through: int | None, consumer: str | None, session: str
    ) -> tuple[list[int], list[int]]:
        """A consumer (re)started holding batches up to ``acked_through`` of ``session``
        (another session's, or none said, acknowledges nothing here). Returns (the ids it holds, which the caller
        acknowledges; the ids queued again). ``consumer`` None: every consumer's."""
        mine = [b for b in self.unacked if consumer is None or self.owner.get(b) == consumer]
        held: list[int] = []
        if acked_through is not None and session == self.session:
            held = [b for b in mine if b <= acked_through]
        queued = (set(self.redeliver) | set(mine)) - set(held)
        self.redeliver = deque(sorted(queued))
        return held, sorted(queued)
