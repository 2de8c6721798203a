"""The coordinator's I/O: two ROUTER sockets served by one thread, and the buffer poller.

:class:`ControlLoop` owns the sockets; it calls :class:`~asyncrl.control.state.ControlState`
under the coordinator's lock (a ``threading.Condition``, notified after every pass so that
the learner's waits in :mod:`asyncrl.control.coordinator` wake up). Nothing blocks while
holding it: sends are non-blocking, and a reply to a departed peer is dropped and counted.

Two kinds of requests are *held* (long-polls) rather than answered at once:

- a task request that gets nothing because of the budget, a pending catch-up or an
  exhausted dataset waits up to its ``wait_s`` (at most ``dead_after_s / 2``) and is
  granted the moment tasks can be dealt; held requests are served oldest first. Each wait
  is counted and timed (``coordinator/waits/<reason>``, ``coordinator/wait_s/<reason>``);
- a heartbeat without news waits up to ``min(wait_s, heartbeat_s)`` and is answered at
  once when there is news for its server (a sync to join, a new version, shutdown).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from asyncrl.control import messages as m
from asyncrl.control.state import ControlState

log = logging.getLogger(__name__)

POLL_S = 0.02  # longest poll: bounds how late a version, a sync start or a death is acted on
REAP_EVERY_S = 0.1
WAIT_REASONS = ("budget", "catchup", "exhausted", "starting")


@dataclass
class _HeldRequest:
    envelope: list[bytes]
    msg: m.TaskRequest
    deadline: float
    since: float
    reason: str = ""  # why it waits; "" before it was first refused


@dataclass
class _HeldWatch:
    envelope: list[bytes]
    msg: m.Heartbeat
    deadline: float


class ControlLoop:
    """Serves the ``tasks`` and ``control`` sockets for one :class:`ControlState`."""

    def __init__(
        self,
        state: ControlState,
        cond: threading.Condition,
        *,
        tasks_addr: str,
        control_addr: str,
        max_grant: int,
        on_shutdown_request: Callable[[str], None],
    ):
        self.state = state
        self.cond = cond
        self.tasks_addr = tasks_addr  # the bound endpoints once running
        self.control_addr = control_addr
        self.max_grant = max_grant
        self.on_shutdown_request = on_shutdown_request
        self.requests: list[_HeldRequest] = []
        self.watches: dict[str, _HeldWatch] = {}
        self.io: Counter[str] = Counter()

    def run(self, stop: threading.Event, ready: threading.Event) -> None:
        """Bind, set ``ready``, serve until ``stop`` is set, close."""
        ctx = zmq.Context()
        tasks, control = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        try:
            for sock in (tasks, control):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a departed peer raises
            tasks.bind(self.tasks_addr)
            control.bind(self.control_addr)
            self.tasks_addr = tasks.getsockopt_string(zmq.LAST_ENDPOINT)
            self.control_addr = control.getsockopt_string(zmq.LAST_ENDPOINT)
            log.info("coordinator: tasks on %s, control on %s", self.tasks_addr, self.control_addr)
            ready.set()
            self._loop(tasks, control, stop)
        finally:
            tasks.close(0)
            control.close(0)
            ctx.term()
            log.info("coordinator stopped")

    def _loop(self, tasks: zmq.Socket, control: zmq.Socket, stop: threading.Event) -> None:
        """Consumes task requests/acks and control messages; produces replies, grants and
        announcements. Waits in a poll of at most :data:`POLL_S`, unblocked by a message on
        either socket; after each poll it re-tries held requests (a version, a refund or a
        re-deal may have opened the budget), answers held heartbeats that now have news or
        whose wait ended, and declares silent servers dead. Runs until ``stop``."""
        poller = zmq.Poller()
        poller.register(tasks, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        last_reap = 0.0
        while not stop.is_set():
            events = dict(poller.poll(int(POLL_S * 1000)))
            with self.cond:
                now = time.monotonic()
                if events.get(tasks):
                    self._drain(tasks, now, self._on_task_message)
                if events.get(control):
                    self._drain(control, now, self._on_control_message)
                if now - last_reap >= REAP_EVERY_S:
                    self._reap(now)
                    last_reap = now
                self._serve_requests(tasks, now)
                self._serve_watches(control, now)
                self.cond.notify_all()  # finish_sync and shutdown wait on this state

    def _drain(self, sock: zmq.Socket, now: float, handler: Callable) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            envelope, body = _split(frames)
            try:
                if body is None:
                    raise m.ControlError("expected one frame after the envelope of a REQ socket")
                msg = m.decode_request(body)
            except m.ControlError as e:
                self.io["rejects"] += 1
                log.warning("rejected a control-plane message: %s", e)
                self._send(sock, envelope, m.ErrorReply(error="invalid", detail=str(e)))
                continue
            reply = handler(msg, envelope, now)
            if reply is not None:
                self._send(sock, envelope, reply)

    def _on_task_message(self, msg: m.Request, envelope: list[bytes], now: float) -> m.Reply | None:
        if isinstance(msg, m.TaskRequest):
            # One task socket per server: a new request means it gave up on a held one.
            self.requests = [h for h in self.requests if h.msg.server_id != msg.server_id]
            wait = min(msg.wait_s, self.state.dead_after_s / 2)
            self.requests.append(_HeldRequest(envelope, msg, now + wait, now))
            return None  # answered by _serve_requests, in arrival order
        if isinstance(msg, m.TaskAck):
            return self.state.ack(msg.server_id, msg.task_ids, now)
        if isinstance(msg, m.TaskNack):
            self.state.nack(msg.server_id, msg.task_ids, msg.reason, now)
            return m.Ok()
        return m.ErrorReply(error="wrong_socket", detail=f"{msg.kind} goes to the control socket")

    def _on_control_message(
        self, msg: m.Request, envelope: list[bytes], now: float
    ) -> m.Reply | None:
        st = self.state
        if isinstance(msg, m.Heartbeat):
            st.beat(msg, now)
            news = st.news(msg)
            if news is None:
                wait = min(msg.wait_s, st.heartbeat_s)
                self.watches[msg.server_id] = _HeldWatch(envelope, msg, now + wait)
            return news
        if isinstance(msg, m.Register):
            self.forget(msg.server_id)
            reply = st.register(msg, now)
            log.info(
                "server %s registered (%s, %d engine ranks, version %d%s)",
                msg.server_id,
                msg.address or "no address",
                msg.engine_world_size,
                msg.policy_version,
                ", catch-up first" if reply.catchup else "",
            )
            return reply
        if isinstance(msg, m.SyncDone):
            st.sync_done(msg, now)
            return m.Ok()
        if isinstance(msg, m.TaskAck):  # acks come here so a held task request cannot delay them
            return st.ack(msg.server_id, msg.task_ids, now)
        if isinstance(msg, m.TaskNack):
            st.nack(msg.server_id, msg.task_ids, msg.reason, now)
            return m.Ok()
        if isinstance(msg, m.Leave):
            self.forget(msg.server_id)
            st.leave(msg.server_id)
            log.info("server %s left (%s)", msg.server_id, msg.reason or "no reason given")
            return m.Ok()
        if isinstance(msg, m.ShutdownRequest):
            self.on_shutdown_request(msg.reason or "requested by a peer")
            return m.Ok()
        return m.ErrorReply(error="wrong_socket", detail=f"{msg.kind} goes to the tasks socket")

    def _serve_requests(self, sock: zmq.Socket, now: float) -> None:
        """Grant held task requests, oldest first; answer those whose wait ended."""
        still: list[_HeldRequest] = []
        for held in self.requests:
            want = min(held.msg.max_tasks, self.max_grant)
            grant = self.state.grant(held.msg.server_id, want, now, held.msg.request_id)
            if not grant.tasks and grant.reason in WAIT_REASONS and now < held.deadline:
                if not held.reason:
                    self.io[f"waits/{grant.reason}"] += 1
                held.reason = grant.reason
                still.append(held)
                continue
            if held.reason:
                self.io[f"wait_s/{held.reason}"] += now - held.since
            self._send(sock, held.envelope, grant)
        self.requests = still

    def _serve_watches(self, sock: zmq.Socket, now: float) -> None:
        for server_id, held in list(self.watches.items()):
            news = self.state.news(held.msg)
            if news is None and now >= held.deadline:
                news = self.state.idle_announcement(server_id)
            if news is not None:
                del self.watches[server_id]
                self._send(sock, held.envelope, news)

    def _reap(self, now: float) -> None:
        for server_id in self.state.reap(now):
            self.forget(server_id)
            log.warning(
                "server %s declared dead (silent for more than %gs); its unacknowledged tasks "
                "are re-dealt",
                server_id,
                self.state.dead_after_s,
            )

    def forget(self, server_id: str) -> None:
        """Drop what ``server_id`` left waiting (it restarted, left or died)."""
        self.watches.pop(server_id, None)
        self.requests = [h for h in self.requests if h.msg.server_id != server_id]

    def _send(self, sock: zmq.Socket, envelope: list[bytes], msg: m.Reply) -> None:
        try:
            sock.send_multipart([*envelope, m.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer is gone; EAGAIN: not reading
            self.io["replies_undeliverable"] += 1
            log.debug("reply to a departed peer dropped (%s)", e.strerror)

    def metrics(self) -> dict[str, float]:
        """Call under the lock."""
        out = {f"coordinator/{k}": float(v) for k, v in sorted(self.io.items())}
        out["coordinator/held_requests"] = float(len(self.requests))
        out["coordinator/held_watches"] = float(len(self.watches))
        return out


def poll_buffer(
    addr: str, state: ControlState, lock: threading.RLock, stop: threading.Event, every_s: float
) -> None:
    """Consumes the buffer's reports (``endpoints.batches``): dropped groups, scored
    validation groups, its session, and its inventory when due; produces task state changes
    (refunds, re-deals, adoptions).

    Waits ``every_s`` between requests and at most ``max(2, every_s)`` seconds for a reply;
    a silent buffer is logged once per outage. Runs until ``stop``. It must be the only
    caller of the buffer's ``dropped`` request, which drains the lists.
    """
    from asyncrl.transport import BufferClient

    client = BufferClient(addr, "coordinator", timeout_s=max(2.0, every_s))
    silent = False
    try:
        while not stop.wait(every_s):
            try:
                _poll_once(client, state, lock)
            except (TimeoutError, RuntimeError, ValueError) as e:  # silent, refused, garbled
                if not silent:
                    log.warning("buffer at %s did not answer (%s); retrying", addr, e)
                silent = True
                continue
            silent = False
    finally:
        client.close()


def _poll_once(client, state: ControlState, lock: threading.RLock) -> None:
    """One drain of the buffer's reports, and its inventory when one is due."""
    reply = client.drain()
    with lock:
        before = state.ledger.counts["lag_given_up"]
        n = state.ledger.dropped(reply.dropped)
        state.trained(list(reply.validated))
        given_up = state.ledger.counts["lag_given_up"] - before
        due = state.recovery.buffer_contact(reply.session, time.monotonic())
    if reply.dropped:
        log.info("buffer dropped %d groups; %d returned to the budget", len(reply.dropped), n)
    if given_up:
        log.warning(
            "%d training prompts given up after staleness.lag_retries retries: their "
            "responses take longer than staleness.max_policy_lag versions to generate "
            "(raise it, or lower data.max_response_length)", given_up,
        )  # fmt: skip
    if due:
        inventory = client.inventory()
        with lock:
            state.reconcile_buffer(list(inventory.held), list(inventory.dropped))
            state.trained(list(inventory.validated))


def _split(frames: list[bytes]) -> tuple[list[bytes], bytes | None]:
    """Routing envelope (up to and including the empty delimiter) and the one body frame."""
    try:
        cut = frames.index(b"", 1)
    except ValueError:
        return [frames[0], b""], None
    body = frames[cut + 1 :]
    return frames[: cut + 1], (body[0] if len(body) == 1 else None)
