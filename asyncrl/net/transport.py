"""ZeroMQ helpers shared by every role: endpoints, the trajectory pusher, request clients.

- Trajectories go over PUSH/PULL: a producer blocks at the high-water mark
  (backpressure), never drops. :class:`TrajectoryPusher` times every blocked send, warns
  while it lasts, and offers :meth:`TrajectoryPusher.send_async` that runs the blocking
  send in a worker thread, so an asyncio loop keeps hearing control messages.
- Batches and control go over request/reply: :class:`ReqClient` (REQ, ``linger=0``,
  receive timeouts, usable again after a timeout); the buffer's own client is
  :class:`asyncrl.net.buffer_client.BufferClient`. Both services (the buffer, the
  coordinator) serve theirs with :mod:`asyncrl.net.serving`.
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
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import zmq

from asyncrl import wire
from asyncrl.net import security
from asyncrl.wire.base import check_size, encode

if TYPE_CHECKING:
    from asyncrl.config.schema import EndpointsConfig

log = logging.getLogger(__name__)

#: How long a producer may sit blocked before the first warning (then every doubling).
WARN_BLOCKED_S = 10.0
WARN_EVERY_MAX_S = 300.0  # a push blocked for hours still says so at least this often

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


def config_endpoint(endpoints_cfg: EndpointsConfig, name: str) -> str:
    """The endpoint of socket ``name`` (``trajectories``, ``batches``, ...) of the config's
    ``endpoints`` group."""
    return endpoint(endpoints_cfg.host, getattr(endpoints_cfg, name), name)


def mebibytes(mb: float) -> int:
    """Bytes of a ``*_mb`` config value."""
    return int(mb * (1 << 20))


def bind(sock: zmq.Socket, addr: str) -> str:
    """Bind (as a CURVE server when the process is configured so, see
    :mod:`asyncrl.net.security`) and return the actual endpoint (the chosen port when ``addr``
    ends in ``*``)."""
    security.secure_server(sock)
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, addr: str) -> None:
    """Connect (with this role's CURVE key when the process is configured so)."""
    security.secure_client(sock)
    sock.connect(addr)


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    linger_s: float = 0.0,
    sndhwm: int = 0,
    rcvhwm: int = 0,
    max_message_bytes: int = 0,
) -> zmq.Socket:
    """A socket with linger and high-water marks set (0 leaves zmq's default HWM, 1000).
    ``max_message_bytes`` > 0: a peer that sends a larger frame is disconnected by zmq
    before the frame is read (what one hostile message can cost is bounded)."""
    sock = ctx.socket(kind)
    if max_message_bytes:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
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
        max_message_bytes: int = 0,
    ):
        self.addr = addr
        self.linger_s = linger_s
        self.max_message_bytes = max_message_bytes  # the buffer's buffer.max_message_mb
        # An own context by default: terminating it at close is what waits for queued
        # messages to leave (a process exiting with the global context loses them).
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = make_socket(self._ctx, zmq.PUSH, linger_s=linger_s, sndhwm=hwm)
        connect(self._sock, addr)
        self._lock = threading.Lock()
        self._closing = threading.Event()  # set by close(): a blocked send gives up
        self.total_wait_s = 0.0
        self.sent = 0
        self.hwm = hwm
        # The first task id of the latest sends: named when a close drops what is queued.
        self._recent: deque[str] = deque(maxlen=3)

    def send(
        self, trajectories: Sequence[wire.Trajectory], timeout_s: float | None = None
    ) -> float:
        """Encode (validating) and push one message; returns the seconds spent blocked."""
        label = trajectories[0].task_id if trajectories else None
        return self.send_frames(wire.encode_trajectories(trajectories), timeout_s, label=label)

    async def send_async(
        self, trajectories: Sequence[wire.Trajectory], timeout_s: float | None = None
    ) -> float:
        """:meth:`send` in a worker thread: the event loop never blocks on the high-water
        mark."""
        return await asyncio.to_thread(self.send, trajectories, timeout_s)

    def send_frames(
        self, frames: Sequence[wire.Frame], timeout_s: float | None = None, label: str | None = None
    ) -> float:
        """Push pre-encoded frames (zero-copy for large ones).

        Waits for room as long as the buffer is not reading, up to ``timeout_s`` (None:
        forever, warning after :data:`WARN_BLOCKED_S` and at each doubling, at least every
        :data:`WARN_EVERY_MAX_S`); raises ``TimeoutError`` past it. Unblocked by the buffer
        reading again, or by :meth:`close` (``ConnectionError``: the message is not sent).
        A message over ``max_message_bytes`` raises ``WireError("oversize")`` unsent.
        ``label`` (its task id) names it if a close drops it queued.
        """
        check_size(frames, self.max_message_bytes, "buffer.max_message_mb")
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
                if self._closing.is_set():  # the process is ending: do not hold close()
                    self.total_wait_s += waited
                    raise ConnectionError(f"push to {self.addr} abandoned at close")
                if timeout_s is not None and waited >= timeout_s:
                    self.total_wait_s += waited
                    raise TimeoutError(f"push to {self.addr} blocked for {waited:.1f}s")
                if waited >= warn_at:
                    log.warning(
                        "push to %s blocked for %.0fs: the buffer is full (is the learner "
                        "taking batches? the buffer's log says; buffer.capacity_groups) or gone",
                        self.addr,
                        waited,
                    )
                    warn_at = min(warn_at * 2, waited + WARN_EVERY_MAX_S)
                poll_s = 1.0 if timeout_s is None else max(0.0, min(1.0, timeout_s - waited))
                self._sock.poll(int(poll_s * 1000) + 1, zmq.POLLOUT)
            self.sent += 1
            if label is not None:
                self._recent.append(label)
        waited = time.monotonic() - start
        self.total_wait_s += waited
        return waited

    def close(self, linger_s: float | None = None) -> None:
        """Close the socket and wait up to ``linger_s`` (default: the one it was made with)
        for queued messages to leave.

        With a caller's ``context``, the wait happens when its owner terminates it. A send
        blocked meanwhile (the buffer gone) gives up within a second instead of holding
        the close for good.
        """
        self._closing.set()
        with self._lock:
            if self._sock.closed:
                return
            if linger_s is not None and linger_s < self.linger_s:
                self.linger_s = linger_s
                self._sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
            self._sock.close()
            if not self._own_ctx:
                return
            start = time.monotonic()
            self._ctx.term()
            waited = time.monotonic() - start
            if self.linger_s and waited >= 0.99 * self.linger_s:
                # PUSH confirms nothing: the lost ones are among the last sent, as many as the
                # queue holds. Their groups are not lost to the run: the coordinator's audit
                # finds the buffer never got them and deals them again.
                log.warning(
                    "push to %s: messages still queued after %.0fs at close were dropped: "
                    "up to the last %d sent (the queue holds %d; the latest: %s); groups the "
                    "coordinator dealt are dealt again once its audit finds them missing",
                    self.addr,
                    waited,
                    min(self.sent, self.hwm),
                    self.hwm,
                    ", ".join(reversed(self._recent)) or "unnamed",
                )

    def __enter__(self) -> TrajectoryPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------- request/reply
class RequestRefused(RuntimeError):
    """A service answered a request with an :class:`asyncrl.wire.ErrorReply`; ``error`` is
    its kind (``internal``: the service failed on it, not the request)."""

    def __init__(self, message: str, error: str = "") -> None:
        super().__init__(message)
        self.error = error


class ReqClient:
    """A REQ socket with receive timeouts that stays usable after one.

    ``REQ_RELAXED`` lets a new request follow a timed-out one and ``REQ_CORRELATE`` drops a
    late reply to the old one, so a slow or restarted server never wedges the client
    (zmq's "lazy pirate" pattern without re-creating the socket). ``linger=0``: nothing is
    left to send when a client closes.
    """

    def __init__(
        self,
        addr: str,
        *,
        timeout_s: float = 10.0,
        context: zmq.Context | None = None,
        max_message_bytes: int = 0,
    ):
        self.addr = addr
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes  # the server's control.max_message_mb
        self._ctx = context or zmq.Context.instance()
        self._sock = make_socket(self._ctx, zmq.REQ)
        self._sock.setsockopt(zmq.REQ_RELAXED, 1)
        self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
        connect(self._sock, addr)
        self.late_replies = 0  # replies that came after their request was given up

    def request_frames(
        self, frames: Sequence[wire.Frame], timeout_s: float | None = None
    ) -> list[zmq.Frame]:
        """Send a request and wait up to ``timeout_s`` (default: the client's) for the
        reply; raises ``TimeoutError`` when none comes, ``WireError("oversize")`` (unsent)
        for a request over ``max_message_bytes``."""
        check_size(frames, self.max_message_bytes, "control.max_message_mb")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._send(frames, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(left_ms, zmq.POLLIN):
                raise TimeoutError(f"no reply from {self.addr} within {timeout_s:.1f}s")
            try:
                return self._sock.recv_multipart(zmq.DONTWAIT, copy=False)
            except zmq.Again:
                self.late_replies += 1
                # The poll saw a late reply to a request that timed out, which REQ_CORRELATE
                # drops at the receive: a blocking receive then waited for this request's
                # reply without a bound, for good where its server restarted meanwhile.
                continue

    def _send(self, frames: Sequence[wire.Frame], timeout_s: float) -> None:
        """Send within ``timeout_s``, else ``TimeoutError``. The send can block too: with
        no usable connection (a handshake refused, say for a wrong key, or a server going
        away) a REQ socket has nowhere to queue the request; and the connection a poll saw
        can be gone by the send, which then blocked for good (a client registering as the
        run ended). So it does not block, and tries again until the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if self._sock.poll(left_ms, zmq.POLLOUT):
                try:
                    self._sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
                    return
                except zmq.Again:  # the connection went between the poll and the send
                    pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"cannot send to {self.addr} within {timeout_s:.1f}s")
            time.sleep(0.01)  # a connection that comes and goes: do not spin on it

    def call(
        self,
        msg: wire.Message,
        decode: Callable[[list[zmq.Frame]], R],
        timeout_s: float | None = None,
    ) -> R:
        """One request, its reply decoded by ``decode``; an :class:`~asyncrl.wire.ErrorReply`
        raises :class:`RequestRefused`, silence ``TimeoutError``."""
        reply = decode(self.request_frames([encode(msg)], timeout_s))
        if isinstance(reply, wire.ErrorReply):
            raise RequestRefused(
                f"{self.addr} refused {msg.kind}: {reply.error}: {reply.detail}", reply.error
            )
        return reply

    def close(self) -> None:
        self._sock.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
