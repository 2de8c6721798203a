"""The consumer's side of the buffer protocol (the learner's, and the coordinator's drop
polls): :class:`BufferClient` over :class:`~asyncrl.net.transport.ReqClient`.

:meth:`BufferClient.hello` is the READY handshake (it names the batches already received,
so a restarted buffer or learner replays or acknowledges the right ones); then
:meth:`BufferClient.request_batch` long-polls for a batch and :meth:`BufferClient.ack`
acknowledges it. The messages are :mod:`asyncrl.wire`'s; the serving side is
``buffer.service``.

Each client object has its own random ``incarnation`` token, sent with its hello, batch
requests and acks. Once another client says hello under the same consumer id (a restarted
learner beside an old one still alive), the buffer refuses this one's batch requests and
acks, and they raise :class:`Superseded`: the stale learner must stop, not retry (both would
train each other's batches).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import zmq

from asyncrl import wire
from asyncrl.net.transport import ReqClient, RequestRefused

log = logging.getLogger(__name__)

R = TypeVar("R")

#: The longest wait for a batch's reply, in ``timeout_s``: it grows to fit the slowest batch.
MAX_BATCH_TIMEOUTS = 16


class Superseded(RequestRefused):
    """Another client said hello to the buffer under this client's consumer id: this one
    is stale (a learner left alive beside its successor) and must stop."""


class BufferClient(ReqClient):
    """The consumer's (learner's) side of the buffer's batch socket.

    Start with :meth:`hello`, then loop: :meth:`request_batch` with the current policy
    version, train, and :meth:`ack` batch ids once a checkpoint contains them. A refused
    request raises :class:`RequestRefused` (:class:`Superseded` once another client said
    hello under ``consumer_id``), a silent buffer ``TimeoutError``.
    """

    def __init__(
        self,
        addr: str,
        consumer_id: str = "learner",
        *,
        timeout_s: float = 10.0,
        context: zmq.Context | None = None,
        max_message_bytes: int = 0,
    ):
        super().__init__(
            addr, timeout_s=timeout_s, context=context, max_message_bytes=max_message_bytes
        )
        self.consumer_id = consumer_id
        # Which client this is, for the buffer: it outlives timeouts (the same object goes on),
        # not the object (a restarted learner is another client).
        self.incarnation = secrets.token_hex(8)
        self.last_wait_s = 0.0  # how long the last request_batch waited
        # How long a batch's reply is waited for beyond its long-poll: doubled when a reply
        # came after its request was given up (see _fit_batch_timeout).
        self.batch_timeout_s = timeout_s
        self._late_seen = 0
        # Whether the last request given up was a batch request: a late reply counted next
        # belongs to it (a late answer to a validation poll says nothing of batch sizes).
        self._batch_given_up = False
        # The last batch received, as (buffer session, batch id): sent with every batch
        # request, so a batch whose reply came after this client stopped waiting is sent
        # again instead of being lost. None until hello: no tracking.
        self.received: tuple[str, int | None] | None = None
        # Where the next drop/validation report starts: (buffer session, drops, validated).
        self._reports_at: tuple[str, int, int] = ("", 0, 0)

    def _decode(self, frames: list[zmq.Frame]) -> wire.Reply | wire.Batch:
        """A reply; a ``superseded`` refusal raises :class:`Superseded` (no retry helps)."""
        reply = wire.decode_reply(frames)
        if isinstance(reply, wire.ErrorReply) and reply.error == "superseded":
            raise Superseded(f"buffer at {self.addr}: {reply.detail}")
        return reply

    def call(
        self,
        msg: wire.Message,
        decode: Callable[[list[zmq.Frame]], R],
        timeout_s: float | None = None,
    ) -> R:
        """:meth:`ReqClient.call`, noting whether a request given up was a batch request."""
        try:
            return super().call(msg, decode, timeout_s)
        except TimeoutError:
            self._batch_given_up = isinstance(msg, wire.BatchRequest)
            raise

    def _ask(self, msg: wire.Request, expect: type[R], timeout_s: float | None = None) -> R:
        reply = self.call(msg, self._decode, timeout_s)
        if not isinstance(reply, expect):
            raise RequestRefused(f"{msg.kind} answered by {type(reply).__name__}")
        return reply

    def _until_up(self, msg: wire.Request, expect: type[R], wait_s: float) -> R:
        """Ask until the buffer answers, up to ``wait_s``, logging while it does not."""
        start = time.monotonic()
        while True:
            try:
                return self._ask(msg, expect, timeout_s=min(self.timeout_s, wait_s))
            except TimeoutError:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    raise TimeoutError(f"buffer at {self.addr} silent for {waited:.0f}s") from None
                log.info("waiting for the buffer at %s (%.0fs so far)", self.addr, waited)

    def hello(
        self,
        acked_through: int | None = None,
        wait_s: float = 60.0,
        session: str = "",
        resumed: bool = True,
    ) -> wire.Welcome:
        """READY handshake: wait up to ``wait_s`` for the buffer (logging while it is not
        up), start a session; unacknowledged batches after ``acked_through`` (a batch id of
        buffer ``session``) come again (``resumed`` False: no checkpoint, nothing replays:
        their groups go back to the pool)."""
        msg = wire.Hello(
            consumer_id=self.consumer_id,
            acked_through=acked_through,
            session=session,
            resumed=resumed,
            incarnation=self.incarnation,
        )
        welcome = self._until_up(msg, wire.Welcome, wait_s)
        self.received = (session, acked_through)
        return welcome

    def wait_ready(self, wait_s: float = 60.0) -> dict[str, float]:
        """Wait up to ``wait_s`` for the buffer to answer (its stats), without starting a
        session: what clients other than the learner use to know it is up."""
        return self._until_up(wire.StatsRequest(), wire.StatsReply, wait_s).metrics

    def request_batch(
        self, policy_version: int, wait_s: float = 1.0, ack: Sequence[int] = ()
    ) -> wire.Batch | None:
        """The next training batch, or None when the buffer has none within ``wait_s``.

        ``ack``: batches to acknowledge first, as :meth:`ack` would, in the same round trip
        (on a TimeoutError it is unknown whether they were: acknowledging again is harmless).
        """
        session, through = self.received if self.received is not None else (None, None)
        msg = wire.BatchRequest(
            consumer_id=self.consumer_id,
            policy_version=policy_version,
            wait_s=wait_s,
            received_session=session,
            received_through=through,
            ack=list(ack),
            incarnation=self.incarnation,
        )
        start = time.monotonic()
        try:
            reply = self.call(msg, self._decode, timeout_s=wait_s + self.batch_timeout_s)
        finally:
            self._fit_batch_timeout()
        self.last_wait_s = time.monotonic() - start
        self._fit_batch_timeout(took_s=self.last_wait_s - wait_s)
        if not isinstance(reply, wire.Batch):
            return None
        if self.received is not None:
            self.received = (reply.session, reply.batch_id)
        return reply

    def _fit_batch_timeout(self, took_s: float | None = None) -> None:
        """Double the wait for a batch's reply, up to :data:`MAX_BATCH_TIMEOUTS` times
        ``timeout_s``, once a reply came after its request was given up. A reply counts as
        received only when all of it has come: a batch that takes longer than the wait to
        cross the link (a large one, a slow link) came late every time, training stalled,
        and the buffer queued one more copy of it for each request. Halve it back towards
        ``timeout_s`` after a reply that ``took_s`` under a quarter of it beyond its
        long-poll: a wait grown once would otherwise delay, for the rest of the run, every
        request a buffer restart loses."""
        if took_s is not None:
            if self.batch_timeout_s > self.timeout_s and took_s < self.batch_timeout_s / 4:
                self.batch_timeout_s = max(self.timeout_s, self.batch_timeout_s / 2)
            return
        if self.late_replies == self._late_seen:
            return
        self._late_seen = self.late_replies
        if not self._batch_given_up:  # a late reply to another request (a validation poll)
            return
        longer = min(2 * self.batch_timeout_s, MAX_BATCH_TIMEOUTS * self.timeout_s)
        if longer > self.batch_timeout_s:
            self.batch_timeout_s = longer
            log.warning(
                "a reply from the buffer at %s came after the learner stopped waiting for "
                "it (a large batch, a slow link): batches are now waited for %.3gs longer "
                "than their long-poll",
                self.addr,
                longer,
            )

    def ack(self, batch_ids: Sequence[int], session: str | None = None) -> wire.AckReply:
        """Tell the buffer these batches, numbered by buffer ``session`` (None: not said),
        are in a saved checkpoint."""
        msg = wire.Ack(
            consumer_id=self.consumer_id,
            batch_ids=list(batch_ids),
            session=session,
            incarnation=self.incarnation,
        )
        return self._ask(msg, wire.AckReply)

    def stats(self) -> dict[str, float]:
        """The buffer's metrics (``buffer/...``)."""
        return self._ask(wire.StatsRequest(), wire.StatsReply).metrics

    def dropped(self) -> list[wire.DroppedTask]:
        """Tasks dropped unused since the last call."""
        return self.drain().dropped

    def drain(self) -> wire.DroppedReply:
        """Tasks dropped and validation tasks scored since the last call, with the buffer's
        session. Read by cursor: the cursor moves only when a reply came, so a reply lost
        to a timeout is read again by the next call (a buffer restart starts over)."""
        session, drops, validated = self._reports_at
        msg = wire.DroppedRequest(session=session, drops_from=drops, validated_from=validated)
        reply = self._ask(msg, wire.DroppedReply)
        self._reports_at = (
            reply.session,
            reply.drops_from + len(reply.dropped),
            reply.validated_from + len(reply.validated),
        )
        return reply

    def inventory(self, ids: list[str] | None = None) -> wire.InventoryReply:
        """Every task id the buffer holds, dropped or scored in its session; with ``ids``,
        which of those it never received (``unknown``)."""
        return self._ask(wire.InventoryRequest(ids=ids), wire.InventoryReply)

    def validation(self, rounds: list[str] | None = None) -> wire.ValidationReply:
        """The validation groups the buffer's session scored (``by_round``: round key ->
        validation id -> group; the ``rounds`` named, or all; not drained) and that
        ``session``."""
        return self._ask(wire.ValidationRequest(rounds=rounds or []), wire.ValidationReply)

    def shutdown(self) -> None:
        """Ask the buffer service to stop (it answers before it does)."""
        self._ask(wire.Shutdown(), wire.Ok)
