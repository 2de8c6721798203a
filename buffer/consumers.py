"""Which client is each consumer id's current one, for :mod:`buffer.answers`.

A consumer (the learner) keeps its consumer id across restarts, so the id alone cannot tell
a restarted learner from the old one still alive beside it (hung, partitioned, a second
launch). Both would take each other's batches: the new one's ``hello`` hands the old one's
unacknowledged batches back, and each request's "received through k" has the buffer resend
what it just released to the other; every batch trained twice, silently. So each client
object sends a random ``incarnation`` token in its ``hello``, batch requests and acks
(:class:`asyncrl.net.buffer_client.BufferClient`); the last ``hello`` under an id names its
current client, and batch requests and acks of any other token are refused with
``ErrorReply("superseded")``, counted (``buffer/superseded_requests``) and logged once per
stale client. The buffer forgets the tokens when it restarts: until a consumer says hello
again, its requests are served whatever their token.
"""

from __future__ import annotations

import logging

from asyncrl import wire

log = logging.getLogger(__name__)

SUPERSEDED = "superseded"  # the ErrorReply's ``error``
MAX_WARNED = 64  # stale clients named in a warning; the rest are only counted


class Incarnations:
    """The incarnation token of each consumer id's last ``hello``; refusals of the others."""

    def __init__(self) -> None:
        self.latest: dict[str, str] = {}  # consumer id -> token of its last hello
        self.refused = 0  # requests refused as superseded (buffer/superseded_requests)
        self._warned: set[tuple[str, str]] = set()

    def hello(self, consumer: str, incarnation: str) -> None:
        """``consumer`` said hello from the client ``incarnation``: it is the current one."""
        before = self.latest.get(consumer)
        if before is not None and before != incarnation:
            log.info(
                "consumer %s said hello from a new client (incarnation %r, was %r): requests "
                "of the old one are refused from now on",
                consumer,
                incarnation,
                before,
            )
        self.latest[consumer] = incarnation

    def refusal(self, consumer: str, incarnation: str, kind: str) -> wire.ErrorReply | None:
        """The reply refusing a ``kind`` request of a superseded client, counted; None
        when ``incarnation`` is the current one (or ``consumer`` never said hello)."""
        latest = self.latest.get(consumer)
        if latest is None or incarnation == latest:
            return None
        self.refused += 1
        if (consumer, incarnation) not in self._warned and len(self._warned) < MAX_WARNED:
            self._warned.add((consumer, incarnation))
            log.warning(
                "refused a %s of consumer %s from a stale client (incarnation %r; another "
                "said hello since, as %r): two learners run under one consumer id, each "
                "would train the other's batches; stop the stale one. Further refusals are "
                "counted in buffer/superseded_requests",
                kind,
                consumer,
                incarnation,
                latest,
            )
        detail = f"another learner said hello as {consumer!r}; this one is stale: stop it"
        return wire.ErrorReply(error=SUPERSEDED, detail=detail)
