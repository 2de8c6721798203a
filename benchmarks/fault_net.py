"""The simulated network of the fault simulation: messages in flight, and REQ-style clients.

Every message between two parts of the simulated run (a request, its reply, a group pushed
to the buffer) waits in one :class:`Net` queue until a schedule event delivers it, so the
schedule decides the order (FIFO, or any message first: reordering), and faults can lose,
duplicate or hold back (delay) any message. Nothing here reads a clock: times are the
simulation's virtual seconds.

A :class:`Endpoint` is one process incarnation's client side, with the real clients'
semantics (ZeroMQ REQ with ``REQ_CORRELATE``): one request in flight per socket, a deadline
after which the caller gives up, and a reply that arrives after that (or for an earlier
incarnation of the process) is discarded. That last rule is what turns a late reply into a
lost one, which is the fault behind several of the recovery defects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

OnReply = Callable[[Any], None]
OnTimeout = Callable[[], None]


@dataclass
class Msg:
    """One message in flight. ``rid`` 0 is a one-way push; replies carry the request's."""

    seq: int
    src: str  # the sending process (its name)
    dst: str  # the receiving process
    body: Any
    rid: int = 0
    sock: str = ""  # the requester's socket (requests and replies)
    inc: int = 0  # the requester's incarnation (a reply reaches that one only)
    reply: bool = False
    ready_at: float = 0.0  # held back until then (a delay)

    @property
    def channel(self) -> tuple[str, str, str, int, bool]:
        """The connection it travels on: a requester socket's requests, or its replies."""
        return (self.src, self.dst, self.sock, self.inc, self.reply)


@dataclass
class Pending:
    rid: int
    deadline: float
    on_reply: OnReply
    on_timeout: OnTimeout | None


class Net:
    """Messages in flight, in send order; deliveries are chosen by the schedule."""

    def __init__(self) -> None:
        self.queue: list[Msg] = []
        self._seq = 0
        self.counts: dict[str, int] = {}

    def send(self, msg: Msg) -> None:
        self._seq += 1
        msg.seq = self._seq
        self.queue.append(msg)

    def deliverable(self, now: float) -> list[int]:
        """Positions of the messages that may be delivered now: not held back, and first in
        their connection (one socket's messages arrive in order, as over TCP; a delayed one
        holds back those behind it, and only messages of different connections reorder)."""
        out, seen = [], set()
        for i, m in enumerate(self.queue):
            key = m.channel
            if key in seen:
                continue
            seen.add(key)
            if m.ready_at <= now:
                out.append(i)
        return out

    def take(self, k: int, now: float) -> Msg | None:
        """Remove and return the ``k``-th deliverable message (modulo their number)."""
        ready = self.deliverable(now)
        if not ready:
            return None
        return self.queue.pop(ready[k % len(ready)])

    def lose(self, k: int, losable: Callable[[Msg], bool]) -> Msg | None:
        """Lose the ``k``-th message if it is of a kind the network may lose."""
        if not self.queue or not losable(self.queue[k % len(self.queue)]):
            return None
        self._count("lost")
        return self.queue.pop(k % len(self.queue))

    def duplicate(self, k: int, dupable: Callable[[Msg], bool]) -> None:
        """Send the ``k``-th message again (only kinds the real clients may send twice)."""
        if not self.queue:
            return
        m = self.queue[k % len(self.queue)]
        if dupable(m):
            self._count("duplicated")
            self.send(Msg(0, m.src, m.dst, m.body, m.rid, m.sock, m.inc, m.reply, m.ready_at))

    def delay(self, k: int, until: float) -> None:
        if self.queue:
            self._count("delayed")
            m = self.queue[k % len(self.queue)]
            m.ready_at = max(m.ready_at, until)

    def drop_where(self, pred: Callable[[Msg], bool]) -> int:
        """Drop every message ``pred`` selects (a process died with them in its queue)."""
        keep = [m for m in self.queue if not pred(m)]
        lost = len(self.queue) - len(keep)
        self.queue = keep
        return lost

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


@dataclass
class Endpoint:
    """One process incarnation's REQ sockets: at most one request in flight per socket."""

    name: str
    net: Net
    inc: int = 1
    alive: bool = True
    pending: dict[str, Pending] = field(default_factory=dict)
    _rid: int = 0

    def busy(self, sock: str) -> bool:
        return sock in self.pending

    def request(
        self,
        sock: str,
        dst: str,
        body: Any,
        *,
        now: float,
        timeout: float,
        on_reply: OnReply,
        on_timeout: OnTimeout | None = None,
    ) -> bool:
        """Send ``body`` to ``dst`` on ``sock``; False (nothing sent) while it is busy."""
        if sock in self.pending or not self.alive:
            return False
        self._rid += 1
        self.pending[sock] = Pending(self._rid, now + timeout, on_reply, on_timeout)
        self.net.send(Msg(0, self.name, dst, body, self._rid, sock, self.inc))
        return True

    def push(self, dst: str, body: Any) -> None:
        """A one-way message (PUSH socket): no reply, no deadline."""
        if self.alive:
            self.net.send(Msg(0, self.name, dst, body, 0, "", self.inc))

    def receive_reply(self, msg: Msg) -> bool:
        """Hand a reply to its waiting caller; False when nobody waits for it any more."""
        p = self.pending.get(msg.sock)
        if not self.alive or msg.inc != self.inc or p is None or p.rid != msg.rid:
            return False
        del self.pending[msg.sock]
        p.on_reply(msg.body)
        return True

    def expire(self, now: float) -> None:
        """Callers whose deadline passed give up (their late replies will be discarded)."""
        for sock in [s for s, p in self.pending.items() if p.deadline <= now]:
            p = self.pending.pop(sock)
            if p.on_timeout is not None:
                p.on_timeout()

    def die(self) -> None:
        self.alive = False
        self.pending.clear()

    def reborn(self) -> None:
        """A new incarnation of the process: nothing in flight is its own."""
        self.inc += 1
        self.alive = True
        self.pending.clear()
