"""The bound side of request/reply, shared by the two services (the buffer, the coordinator).

:class:`RouterService` serves REQ clients on a ROUTER socket: it splits envelopes, decodes
and refuses bad requests (answered with an error reply, counted), and never blocks on a
reply. :class:`HeldRequests` holds long-polls until they can be answered or their wait
ends. The client side is :class:`asyncrl.net.transport.ReqClient`.

Under CURVE each request's connection carries the role of the key it presented (the
``User-Id`` :mod:`asyncrl.net.security` gives it); a service built with an
:class:`asyncrl.net.authority.Policy` serves only the requests that role may send, and answers
the rest with an ``ErrorReply("forbidden")`` (counted as ``security/refused/<role>``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zmq

from asyncrl import wire
from asyncrl.net import security
from asyncrl.net.authority import Policy
from asyncrl.net.transport import bind, make_socket
from asyncrl.wire.base import encode

log = logging.getLogger(__name__)

M = TypeVar("M", bound=wire.Message)


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes] | None]:
    """A ROUTER's message as the routing envelope (up to and including the empty delimiter
    a REQ socket adds) and the body; None for the body when there is no delimiter."""
    try:
        cut = frames.index(b"", 1)
    except ValueError:
        return [frames[0], b""], None
    return frames[: cut + 1], frames[cut + 1 :]


class RouterService(Generic[M]):
    """The bound side of a request/reply socket: a ROUTER that serves REQ clients.

    :meth:`receive` splits each request from its envelope and decodes it with ``decode``
    (which raises :class:`~asyncrl.wire.WireError`); a request that cannot be accepted is
    answered here with an :class:`~asyncrl.wire.ErrorReply` and passed to ``on_reject``.
    With a ``policy`` and CURVE on, a request its connection's role may not send is answered
    ``forbidden`` and counted per role (``security/refused/<role>``, logged once per role
    and kind); without CURVE there is no role and everything is served.
    Replies never block: one to a client that is gone (``ROUTER_MANDATORY`` makes zmq say
    so) or not reading is dropped and counted in ``counts["replies_undeliverable"]`` (the
    first one logged).
    Used from one thread, the one that created it.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        addr: str,
        decode: Callable[[list[bytes]], M],
        *,
        on_reject: Callable[[wire.WireError], None],
        counts: Counter[str],
        max_message_bytes: int = 0,
        rcvhwm: int = 1000,
        policy: Policy | None = None,
    ):
        self.decode = decode
        self.on_reject = on_reject
        self.counts = counts
        self.policy = policy
        self.sock = make_socket(ctx, zmq.ROUTER, rcvhwm=rcvhwm, max_message_bytes=max_message_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a departed peer raises
        try:
            self.endpoint = bind(self.sock, addr)
        except zmq.ZMQError:
            # Left open, the socket holds its context: terminating it waited for good (a
            # buffer whose port was taken hung instead of saying so).
            self.sock.close(linger=0)
            raise
        # Roles exist only where CURVE authenticated the peer (the ZAP handler named them).
        self.authenticated = bool(self.sock.getsockopt(zmq.CURVE_SERVER))
        self._warned: set[tuple[str, str]] = set()

    def receive(self, most: int | None = None) -> Iterator[tuple[list[bytes], M]]:
        """``(envelope, request)`` for each valid request waiting, up to ``most``; never
        waits."""
        n = 0
        while most is None or n < most:
            try:
                frames, role = self._recv()
            except zmq.Again:
                return
            n += 1
            envelope, body = split_envelope(frames)
            try:
                if body is None:
                    raise wire.WireError("malformed", "no empty delimiter frame: send from REQ")
                msg = self.decode(body)
            except wire.WireError as e:
                self.on_reject(e)
                self.reply(envelope, wire.ErrorReply.of(e))
                continue
            if self.policy is not None and not self.policy.permits(role, msg.kind):
                self._refuse(envelope, role or "", msg.kind)
                continue
            yield envelope, msg

    def _recv(self) -> tuple[list[bytes], str | None]:
        """The next message's frames and the role of the connection it came on (None
        without CURVE); raises ``zmq.Again`` when none waits."""
        if not self.authenticated:
            return self.sock.recv_multipart(zmq.NOBLOCK), None
        parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        try:
            role = parts[-1].get("User-Id")
        except zmq.ZMQError:  # no ZAP answer recorded one: a role nobody was granted
            role = ""
        return [p.bytes for p in parts], str(role)

    def _refuse(self, envelope: list[bytes], role: str, kind: str) -> None:
        """Answer a request its sender's role may not send, count it, say so once."""
        assert self.policy is not None
        detail = self.policy.refusal(role, kind)
        security.count(f"refused/{role or 'unknown'}")
        if (role, kind) not in self._warned:
            self._warned.add((role, kind))
            log.warning("refused a request on %s: %s", self.endpoint, detail)
        self.reply(envelope, wire.ErrorReply(error="forbidden", detail=detail))

    def reply(self, envelope: list[bytes], msg: wire.Message) -> bool:
        """Send a one-frame reply; False when it could not be delivered."""
        return self.send(envelope, [encode(msg)])

    def send(self, envelope: list[bytes], frames: Sequence[wire.Frame]) -> bool:
        """Send a reply of any frames (zero-copy); False when it could not be delivered."""
        try:
            self.sock.send_multipart([*envelope, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client is gone; EAGAIN: not reading
            self.counts["replies_undeliverable"] += 1
            # A client that died or restarted leaves one behind: say so once, then count.
            level = logging.WARNING if self.counts["replies_undeliverable"] == 1 else logging.DEBUG
            log.log(
                level, "reply to a departed client of %s dropped (%s)", self.endpoint, e.strerror
            )
            return False
        return True

    def close(self) -> None:
        self.sock.close(0)


@dataclass
class Held(Generic[M]):
    """A request answered later (a long-poll): who asked, what, since and until when."""

    envelope: list[bytes]
    msg: M
    since: float
    deadline: float
    reason: str = ""  # why it still waits, as the service says; "" before it first did

    def expired(self, now: float) -> bool:
        """Whether its wait has ended: answer it now, whatever the answer."""
        return now >= self.deadline


class HeldRequests(Generic[M]):
    """Requests a service holds until it can answer them or their wait ends, oldest
    first, at most one per ``key`` (a client asking again gave up on its held request)."""

    def __init__(self, key: Callable[[M], str]):
        self.key = key
        self._held: list[Held[M]] = []

    def hold(self, envelope: list[bytes], msg: M, now: float, wait_s: float) -> Held[M]:
        """Hold ``msg`` until ``now + wait_s``, replacing its client's earlier request."""
        self.drop(self.key(msg))
        held = Held(envelope, msg, now, now + wait_s)
        self._held.append(held)
        return held

    def drop(self, key: str) -> None:
        """Forget what ``key`` left waiting (it restarted, left or died)."""
        self.take(key)

    def take(self, key: str) -> list[Held[M]]:
        """Forget what ``key`` left waiting and return it (for the caller to answer)."""
        mine = [h for h in self._held if self.key(h.msg) == key]
        if mine:
            self._held = [h for h in self._held if self.key(h.msg) != key]
        return mine

    def serve(
        self,
        service: RouterService[Any],
        now: float,
        answer: Callable[[Held[M], float], wire.Message | list[wire.Frame] | None],
    ) -> None:
        """Ask ``answer(held, now)`` for each held request, oldest first, and send what it
        returns (a message, or the frames of one); None keeps the request held (``answer``
        must not return None once :meth:`Held.expired`). A request whose answer raises (a
        defect) is answered ``internal``, counted (``request_errors``) and let go: held on,
        it raised again at every pass and ended the service's thread."""
        still: list[Held[M]] = []
        for held in self._held:
            try:
                reply = answer(held, now)
            except Exception as e:
                reply = internal_error(service, held.msg, e)
            if reply is None:
                still.append(held)
            elif isinstance(reply, wire.Message):
                service.reply(held.envelope, reply)
            else:
                service.send(held.envelope, reply)
        self._held = still

    def next_deadline(self) -> float | None:
        """When the first held wait ends (None: nothing held)."""
        return min((h.deadline for h in self._held), default=None)

    def __len__(self) -> int:
        return len(self._held)


def internal_error(service: RouterService[Any], msg: Any, e: Exception) -> wire.ErrorReply:
    """The reply to a request ``service`` failed on (a defect: logged with its traceback,
    counted as ``request_errors``); the service goes on."""
    service.counts["request_errors"] += 1
    kind = getattr(msg, "kind", type(msg).__name__)
    log.exception("a %s request on %s failed; answered 'internal'", kind, service.endpoint)
    detail = f"the service failed on this {kind} request: {type(e).__name__}: {e}"
    return wire.ErrorReply(error="internal", detail=detail[:500])
