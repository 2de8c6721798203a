"""What the buffer service answers on its ``batches`` socket, request by request
(:mod:`buffer.service` owns the socket, the loop and the thread; this decides the replies).

- ``batch_request``: the acknowledgements it carries are applied first; then it is held
  until a batch can be released for it (the lag filter for its version is applied at once,
  even if none can) or its ``wait_s`` runs out (:class:`~asyncrl.wire.NoBatch`). Every batch
  carries the service's metrics.
- ``hello``: a consumer (re)started. Requests it left held are void (those of another
  client under its id are answered ``superseded``), its unacknowledged batches are
  acknowledged or queued again (:meth:`buffer.core.ReplayBuffer.restart`), and its client's
  incarnation token becomes the only one whose batch requests and acks are served
  (:mod:`buffer.consumers`).
- ``ack``, ``stats``, ``dropped`` (read by cursor, from the start for another session's
  cursors), ``inventory`` (or an audit of given ids, ``paused`` as the service's
  ``paused`` says), ``validation``: answered at once.
- ``shutdown``: the service stops.

A request that cannot be decoded or that its sender's role may not send never gets here:
:class:`~asyncrl.net.serving.RouterService` refuses it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from asyncrl import wire
from asyncrl.net.serving import Held, HeldRequests, RouterService
from buffer.consumers import Incarnations
from buffer.core import ReplayBuffer

log = logging.getLogger(__name__)


class Answers:
    """Answers the ``batches`` socket's requests for one :class:`ReplayBuffer`, and holds its
    batch requests. Called from the service loop's thread only.

    ``metrics`` returns the service's metrics (stats replies and batches carry them);
    ``on_shutdown`` stops the service (a ``shutdown`` request); ``paused`` says whether
    trajectories may still wait unread in the socket (an audit's ``paused``).
    """

    def __init__(
        self,
        buffer: ReplayBuffer,
        *,
        metrics: Callable[[], dict[str, float]],
        on_shutdown: Callable[[], None],
        paused: Callable[[], bool],
    ):
        self.buffer, self.session = buffer, buffer.session
        self.metrics, self.on_shutdown = metrics, on_shutdown
        self.paused = paused
        self.held: HeldRequests[wire.BatchRequest] = HeldRequests(_consumer)
        self.incarnations = Incarnations()

    def on_request(
        self, router: RouterService[wire.Request], envelope: list[bytes], msg: wire.Request
    ) -> None:
        """Answer ``msg`` now, or hold it (a batch request)."""
        if isinstance(msg, wire.BatchRequest):
            refused = self.incarnations.refusal(msg.consumer_id, msg.incarnation, msg.kind)
            if refused is not None:  # its acks too: its batches may be another's now
                router.reply(envelope, refused)
                return
            # Acknowledgements carried on the request, applied first (those of another
            # buffer session are not: their ids name other batches here).
            if msg.ack:
                self.buffer.ack(msg.ack, msg.received_session)
            now = time.monotonic()
            self.held.hold(envelope, msg, now, msg.wait_s)
            # Apply the lag filter for this version now, even if no batch can be released.
            self.held.serve(router, now, lambda held, now: self._answer_held(held, now, True))
        elif isinstance(msg, wire.Hello):
            # Requests held for another client under this id: tell it now that it is stale
            # (dropped unanswered, it would only learn it at its next request).
            left = self.held.take(msg.consumer_id)
            router.reply(envelope, self.answer(msg))
            for held in left:
                m = held.msg
                refused = self.incarnations.refusal(m.consumer_id, m.incarnation, m.kind)
                if refused is not None:
                    router.reply(held.envelope, refused)
        else:
            router.reply(envelope, self.answer(msg))

    def serve(self, router: RouterService[wire.Request], now: float) -> None:
        """Answer the held batch requests that can be: with a batch, or ``NoBatch`` once
        their wait ended."""
        self.held.serve(router, now, self._answer_held)

    def answer(self, msg: wire.Request) -> wire.Reply:
        """The reply to any request but a batch request (those are held)."""
        if isinstance(msg, wire.Hello):
            return self._hello(msg)
        if isinstance(msg, wire.Ack):
            refused = self.incarnations.refusal(msg.consumer_id, msg.incarnation, msg.kind)
            if refused is not None:
                return refused
            acked, unknown = self.buffer.ack(msg.batch_ids, msg.session)
            return wire.AckReply(acked=acked, unknown=unknown)
        if isinstance(msg, wire.StatsRequest):
            return wire.StatsReply(metrics=self.metrics())
        if isinstance(msg, wire.DroppedRequest):
            # Cursors of another session (the buffer restarted) read from the start.
            mine = msg.session == self.session
            drops_from = msg.drops_from if mine else 0
            validated_from = msg.validated_from if mine else 0
            dropped, validated = self.buffer.reports_since(drops_from, validated_from)
            return wire.DroppedReply(
                dropped=dropped,
                validated=validated,
                session=self.session,
                drops_from=drops_from,
                validated_from=validated_from,
            )
        if isinstance(msg, wire.InventoryRequest) and msg.ids is not None:
            return wire.InventoryReply(
                session=self.session,
                held=[],
                dropped=[],
                validated=[],
                unknown=self.buffer.unknown(msg.ids),
                paused=self.paused(),
            )
        if isinstance(msg, wire.InventoryRequest):
            held, dropped, validated = self.buffer.inventory()
            return wire.InventoryReply(
                session=self.session,
                held=held,
                dropped=dropped,
                validated=validated,
                paused=self.paused(),
            )
        if isinstance(msg, wire.ValidationRequest):
            by_round = self.buffer.reports.results_for(msg.rounds)
            return wire.ValidationReply(by_round=by_round, session=self.session)
        log.info("shutdown requested on the batch socket")  # the only request left
        self.on_shutdown()
        return wire.Ok()

    def _hello(self, msg: wire.Hello) -> wire.Welcome:
        # Requests this consumer left held before it restarted must not take batches now:
        # nobody would receive them until its next restart.
        self.held.drop(msg.consumer_id)
        self.incarnations.hello(msg.consumer_id, msg.incarnation)
        if msg.acked_through is not None and msg.resumed and not msg.session:
            log.warning(
                "consumer %s holds batches through %d but names no buffer session: nothing "
                "is acknowledged, its unacknowledged batches come again (trained twice "
                "rather than lost); send Hello.session, the session of the batch replies",
                msg.consumer_id,
                msg.acked_through,
            )
        returned = self.buffer.counts["batches_returned"]
        redelivering, acked = self.buffer.restart(
            msg.acked_through, msg.consumer_id, msg.session, msg.resumed
        )
        if not msg.resumed:  # a learner without a checkpoint: it replays nothing
            log.info(
                "consumer %s started afresh: the groups of its %d unacknowledged batches are "
                "back in the pool (released again under the lag filter)",
                msg.consumer_id,
                self.buffer.counts["batches_returned"] - returned,
            )
        else:
            log.info(
                "consumer %s started (acked through %s): %d batches acknowledged, %d to "
                "release again",
                msg.consumer_id,
                msg.acked_through,
                acked,
                redelivering,
            )
        return wire.Welcome(
            redelivering=redelivering,
            next_batch_id=self.buffer.next_batch_id,
            acked=acked,
            policy_version=self.buffer.learner_version,
            session=self.session,
        )

    def _answer_held(
        self, held: Held[wire.BatchRequest], now: float, force: bool = False
    ) -> list[wire.Frame] | wire.NoBatch | None:
        """A batch for a held request when one can be released (``force``: try even when
        none seems ready, which applies the lag filter for the request's version), else
        :class:`~asyncrl.wire.NoBatch` once its wait ended, else None (it waits on)."""
        if force or self.buffer.can_release():
            m = held.msg
            received = (
                None if m.received_session is None else (m.received_session, m.received_through)
            )
            batch = self.buffer.release(m.policy_version, m.consumer_id, received)
            if batch is not None:  # with the service's counters (rejects, refusals, rates)
                batch = msgspec.structs.replace(batch, metrics=self.metrics())
                return wire.encode_batch(batch)
        if held.expired(now):
            return wire.NoBatch(ready=self.buffer.ready, needed=self.buffer.batch_size)
        return None


def _consumer(msg: wire.BatchRequest) -> str:
    return msg.consumer_id
