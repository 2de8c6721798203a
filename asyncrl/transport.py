"""ZeroMQ helpers shared by every role: endpoints, the trajectory pusher, request clients.

- Trajectories go over PUSH/PULL: a producer blocks at the high-water mark
  (backpressure), never drops. :class:`TrajectoryPusher` times every blocked send, warns
  while it lasts, and offers :meth:`TrajectoryPusher.send_async` that runs the blocking
  send in a worker thread, so an asyncio loop keeps hearing control messages.
- Batches and control go over request/reply: :class:`ReqClient` (REQ, ``linger=0``,
  receive timeouts, usable again after a timeout) and :class:`BufferClient`, the
  consumer's side of the buffer protocol, whose :meth:`BufferClient.hello` is the READY
  handshake.
- Endpoints come from the ``endpoints`` config group: ``tcp://host:port`` (host defaults
  to 127.0.0.1, so nothing listens beyond the machine unless configured), or ipc when
  ``endpoints.host`` is ``ipc://<directory>``.

Every payload is produced by :mod:`asyncrl.wire` (typed msgpack and raw arrays only).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import zmq

from asyncrl import wire

log = logging.getLogger(__name__)

#: How long a producer may sit blocked before the first warning (then every doubling).
WARN_BLOCKED_S = 10.0

C = TypeVar("C", bound="ReqClient")
R = TypeVar("R")


# ----------------------------------------------------------------------- endpoints
def endpoint(host: str, port: int, name: str) -> str:
    """``tcp://host:port``, or ``ipc://<dir>/<name>.sock`` when ``host`` is ``ipc://<dir>``.

    Port 0 means "any free port" and is only meaningful for binding (``tcp://host:*``).
    """
    if host.startswith("ipc://"):
        return f"{host.rstrip('/')}/{name}.sock"
    if "://" in host:
        raise ValueError(f"endpoints.host={host!r}: use a host name/address or ipc://<dir>")
    return f"tcp://{host}:{port if port else '*'}"


def config_endpoint(endpoints_cfg: Any, name: str) -> str:
    """The endpoint of socket ``name`` (``trajectories``, ``batches``, ...) of the config's
    ``endpoints`` group."""
    return endpoint(endpoints_cfg.host, getattr(endpoints_cfg, name), name)


def bind(sock: zmq.Socket, addr: str) -> str:
    """Bind and return the actual endpoint (the chosen port when ``addr`` ends in ``*``)."""
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def make_socket(
    ctx: zmq.Context, kind: int, *, linger_s: float = 0.0, sndhwm: int = 0, rcvhwm: int = 0
) -> zmq.Socket:
    """A socket with linger and high-water marks set (0 leaves zmq's default HWM, 1000)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
    if sndhwm:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    if rcvhwm:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    return sock


# ----------------------------------------------------------------------- trajectories
class TrajectoryPusher:
    """PUSH side of the trajectory stream (a rollout server, or a test producer).

    ``send`` blocks while the buffer does not read (its queue and ours are full) and returns
    the seconds it waited; ``total_wait_s`` sums them. Thread-safe: sends are serialised by
    a lock, so ``send_async`` may run in any worker thread. On close, queued messages get
    ``linger_s`` to leave before they are dropped (and a warning says so).
    """

    def __init__(
        self,
        addr: str,
        *,
        hwm: int = 1000,
        linger_s: float = 10.0,
        context: zmq.Context | None = None,
    ):
        self.addr = addr
        self.linger_s = linger_s
        # An own context by default: terminating it at close is what waits for queued
        # messages to leave (a process exiting with the global context loses them).
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = make_socket(self._ctx, zmq.PUSH, linger_s=linger_s, sndhwm=hwm)
        self._sock.connect(addr)
        self._lock = threading.Lock()
        self.total_wait_s = 0.0
        self.sent = 0

    def send(
        self, trajectories: Sequence[wire.Trajectory], timeout_s: float | None = None
    ) -> float:
        """Encode (validating) and push one message; returns the seconds spent blocked."""
        return self.send_frames(wire.encode_trajectories(trajectories), timeout_s)

    async def send_async(
        self, trajectories: Sequence[wire.Trajectory], timeout_s: float | None = None
    ) -> float:
        """:meth:`send` in a worker thread: the event loop never blocks on the high-water
        mark."""
        return await asyncio.to_thread(self.send, trajectories, timeout_s)

    def send_frames(self, frames: Sequence[wire.Frame], timeout_s: float | None = None) -> float:
        """Push pre-encoded frames (zero-copy for large ones).

        Waits for room as long as the buffer is not reading, up to ``timeout_s`` (None:
        forever, warning after :data:`WARN_BLOCKED_S` and at each doubling); raises
        ``TimeoutError`` past it. Unblocked by the buffer reading again.
        """
        start = time.monotonic()
        warn_at = WARN_BLOCKED_S
        with self._lock:
            while True:
                try:
                    self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    pass
                waited = time.monotonic() - start
                if timeout_s is not None and waited >= timeout_s:
                    self.total_wait_s += waited
                    raise TimeoutError(f"push to {self.addr} blocked for {waited:.1f}s")
                if waited >= warn_at:
                    log.warning(
                        "push to %s blocked for %.0fs: buffer full or gone", self.addr, waited
                    )
                    warn_at *= 2
                poll_s = 1.0 if timeout_s is None else max(0.0, min(1.0, timeout_s - waited))
                self._sock.poll(int(poll_s * 1000) + 1, zmq.POLLOUT)
            self.sent += 1
        waited = time.monotonic() - start
        self.total_wait_s += waited
        return waited

    def close(self) -> None:
        """Close the socket and wait up to ``linger_s`` for queued messages to leave.

        With a caller's ``context``, the wait happens when its owner terminates it.
        """
        with self._lock:
            if self._sock.closed:
                return
            self._sock.close()
            if not self._own_ctx:
                return
            start = time.monotonic()
            self._ctx.term()
            waited = time.monotonic() - start
            if self.linger_s and waited >= 0.99 * self.linger_s:
                log.warning(
                    "push to %s: messages still queued after %.0fs at close were dropped",
                    self.addr,
                    waited,
                )

    def __enter__(self) -> TrajectoryPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------- request/reply
class ReqClient:
    """A REQ socket with receive timeouts that stays usable after one.

    ``REQ_RELAXED`` lets a new request follow a timed-out one and ``REQ_CORRELATE`` drops a
    late reply to the old one, so a slow or restarted server never wedges the client
    (zmq's "lazy pirate" pattern without re-creating the socket). ``linger=0``: nothing is
    left to send when a client closes.
    """

    def __init__(self, addr: str, *, timeout_s: float = 10.0, context: zmq.Context | None = None):
        self.addr = addr
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._sock = make_socket(self._ctx, zmq.REQ)
        self._sock.setsockopt(zmq.REQ_RELAXED, 1)
        self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self._sock.connect(addr)

    def request_frames(
        self, frames: Sequence[wire.Frame], timeout_s: float | None = None
    ) -> list[zmq.Frame]:
        """Send a request and wait up to ``timeout_s`` (default: the client's) for the
        reply; raises ``TimeoutError`` when none comes."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._sock.send_multipart(frames, copy=False)
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"no reply from {self.addr} within {timeout_s:.1f}s")
        return self._sock.recv_multipart(copy=False)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BufferReplyError(RuntimeError):
    """The buffer answered with an :class:`asyncrl.wire.ErrorReply`."""


class BufferClient(ReqClient):
    """The consumer's (learner's) side of the buffer's batch socket.

    Start with :meth:`hello`, then loop: :meth:`request_batch` with the current policy
    version, train, and :meth:`ack` batch ids once a checkpoint contains them.
    """

    def __init__(
        self,
        addr: str,
        consumer_id: str = "learner",
        *,
        timeout_s: float = 10.0,
        context: zmq.Context | None = None,
    ):
        super().__init__(addr, timeout_s=timeout_s, context=context)
        self.consumer_id = consumer_id
        self.last_wait_s = 0.0  # how long the last request_batch waited

    def call(self, msg: wire.Request, timeout_s: float | None = None) -> wire.Reply | wire.Batch:
        """One request, its decoded reply; an error reply raises :class:`BufferReplyError`."""
        reply = wire.decode_reply(self.request_frames([wire.encode_request(msg)], timeout_s))
        if isinstance(reply, wire.ErrorReply):
            raise BufferReplyError(
                f"buffer rejected {type(msg).__name__}: {reply.error}: {reply.detail}"
            )
        return reply

    def _call(self, msg: wire.Request, expect: type[R], timeout_s: float | None = None) -> R:
        reply = self.call(msg, timeout_s)
        if not isinstance(reply, expect):
            raise BufferReplyError(f"{type(msg).__name__} answered by {type(reply).__name__}")
        return reply

    def hello(self, acked_through: int | None = None, wait_s: float = 60.0) -> wire.Welcome:
        """READY handshake: wait up to ``wait_s`` for the buffer (logging while it is not
        up), start a session; unacknowledged batches after ``acked_through`` come again."""
        msg = wire.Hello(
            schema=wire.SCHEMA_VERSION, consumer_id=self.consumer_id, acked_through=acked_through
        )
        start = time.monotonic()
        while True:
            try:
                return self._call(msg, wire.Welcome, timeout_s=min(self.timeout_s, wait_s))
            except TimeoutError:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    raise TimeoutError(f"buffer at {self.addr} silent for {waited:.0f}s") from None
                log.info("waiting for the buffer at %s (%.0fs so far)", self.addr, waited)

    def wait_ready(self, wait_s: float = 60.0) -> dict[str, float]:
        """Wait up to ``wait_s`` for the buffer to answer (its stats), without starting a
        session: what clients other than the learner use to know it is up."""
        start = time.monotonic()
        while True:
            try:
                return self._call(
                    wire.StatsRequest(schema=wire.SCHEMA_VERSION),
                    wire.StatsReply,
                    timeout_s=min(self.timeout_s, wait_s),
                ).metrics
            except TimeoutError:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    raise TimeoutError(f"buffer at {self.addr} silent for {waited:.0f}s") from None
                log.info("waiting for the buffer at %s (%.0fs so far)", self.addr, waited)

    def request_batch(self, policy_version: int, wait_s: float = 1.0) -> wire.Batch | None:
        """The next training batch, or None when the buffer has none within ``wait_s``."""
        msg = wire.BatchRequest(
            schema=wire.SCHEMA_VERSION,
            consumer_id=self.consumer_id,
            policy_version=policy_version,
            wait_s=wait_s,
        )
        start = time.monotonic()
        reply = self.call(msg, timeout_s=wait_s + self.timeout_s)
        self.last_wait_s = time.monotonic() - start
        return reply if isinstance(reply, wire.Batch) else None

    def ack(self, batch_ids: Sequence[int]) -> wire.AckReply:
        """Tell the buffer these batches are in a saved checkpoint."""
        msg = wire.Ack(
            schema=wire.SCHEMA_VERSION, consumer_id=self.consumer_id, batch_ids=list(batch_ids)
        )
        return self._call(msg, wire.AckReply)

    def stats(self) -> dict[str, float]:
        """The buffer's metrics (``buffer/...``)."""
        return self._call(wire.StatsRequest(schema=wire.SCHEMA_VERSION), wire.StatsReply).metrics

    def dropped(self) -> list[wire.DroppedTask]:
        """Tasks dropped for lag or expiry since the last call (drained)."""
        return self.drain().dropped

    def drain(self) -> wire.DroppedReply:
        """Tasks dropped and validation tasks scored since the last call (drained), with
        the buffer's session."""
        return self._call(wire.DroppedRequest(schema=wire.SCHEMA_VERSION), wire.DroppedReply)

    def inventory(self) -> wire.InventoryReply:
        """Every task id the buffer holds, dropped or scored in its session."""
        msg = wire.InventoryRequest(schema=wire.SCHEMA_VERSION)
        return self._call(msg, wire.InventoryReply)

    def validation(self) -> dict[str, wire.ValidationStats]:
        """Validation results per data source since the last call (drained)."""
        msg = wire.ValidationRequest(schema=wire.SCHEMA_VERSION)
        return self._call(msg, wire.ValidationReply).by_data_source

    def shutdown(self) -> None:
        """Ask the buffer service to stop (it answers before it does)."""
        self._call(wire.Shutdown(schema=wire.SCHEMA_VERSION), wire.Ok)
