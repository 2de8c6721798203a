"""The coordinator's I/O: two ROUTER sockets served by one thread, and the buffer poller.

:class:`ControlLoop` owns the sockets; it calls :class:`~asyncrl.control.state.ControlState`
under the coordinator's lock (a ``threading.Condition``, notified after every pass so that
the learner's waits in :mod:`asyncrl.control.coordinator` wake up). Nothing blocks while
holding it: sends are non-blocking, and a reply to a departed peer is dropped and counted.
Each socket is an :class:`asyncrl.net.serving.RouterService` and each kind of held request a
:class:`asyncrl.net.serving.HeldRequests`, as in the buffer's service.

Two kinds of requests are *held* (long-polls) rather than answered at once:

- a task request that gets nothing because of the budget, the server's pace
  (:mod:`asyncrl.control.pacing`), a pending catch-up or an exhausted dataset waits up to
  its ``wait_s`` (at most ``dead_after_s / 2``) and is granted the moment tasks can be
  dealt; held requests are served oldest first. Each wait is counted and timed
  (``coordinator/waits/<reason>``, ``coordinator/wait_s/<reason>``);
- a heartbeat without news waits up to ``min(wait_s, heartbeat_s)`` and is answered at
  once when there is news for its server (a sync to join, a new version, shutdown).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq

from asyncrl.config.shared import settings_problems
from asyncrl.control import messages as m
from asyncrl.control.state import ControlState
from asyncrl.control.task_states import Drops
from asyncrl.net import authority
from asyncrl.net.serving import Held, HeldRequests, RouterService
from asyncrl.wire.base import WireError, single

log = logging.getLogger(__name__)

POLL_S = 0.02  # longest poll: bounds how late a version, a sync start or a death is acted on
REAP_EVERY_S = 0.1
#: A longer gap between two passes means the coordinator itself did not run (paused, starved)
PAUSED_AFTER_S = 1.0
WAIT_REASONS = ("budget", "catchup", "exhausted", "pace", "starting")


def _server(msg: m.TaskRequest | m.Heartbeat) -> str:
    return msg.server_id


def _decode(body: list[bytes], max_bytes: int) -> m.Request:
    return m.decode_request(single(body), max_bytes)


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
        max_message_bytes: int = 0,
    ):
        self.state = state
        self.cond = cond
        self.tasks_addr = tasks_addr  # the bound endpoints once running
        self.control_addr = control_addr
        self.max_grant = max_grant
        self.on_shutdown_request = on_shutdown_request
        # control.max_message_mb: per request read (0: its default; the socket then sets
        # none) and per grant built.
        self.max_message_bytes = max_message_bytes
        self.requests: HeldRequests[m.TaskRequest] = HeldRequests(_server)
        self.watches: HeldRequests[m.Heartbeat] = HeldRequests(_server)
        self.io: Counter[str] = Counter()
        self.wait_s: dict[str, float] = {}  # seconds held task requests waited, by reason

    def run(self, stop: threading.Event, ready: threading.Event) -> None:
        """Bind, set ``ready``, serve until ``stop`` is set, close."""
        ctx = zmq.Context()
        services: list[RouterService[m.Request]] = []
        try:
            for addr in (self.tasks_addr, self.control_addr):
                services.append(
                    RouterService(
                        ctx,
                        addr,
                        functools.partial(_decode, max_bytes=self.max_message_bytes),
                        on_reject=self._reject,
                        counts=self.io,
                        max_message_bytes=self.max_message_bytes,
                        policy=authority.COORDINATOR,
                    )
                )
            tasks, control = services
            self.tasks_addr, self.control_addr = tasks.endpoint, control.endpoint
            log.info("coordinator: tasks on %s, control on %s", self.tasks_addr, self.control_addr)
            ready.set()
            self._loop(tasks, control, stop)
        finally:
            for service in services:
                service.close()
            ctx.term()
            log.info("coordinator stopped")

    def _reject(self, err: WireError) -> None:
        self.io["rejects"] += 1
        log.warning("rejected a control-plane message: %s", err)

    def _loop(self, tasks: RouterService, control: RouterService, stop: threading.Event) -> None:
        """Consumes task requests/acks and control messages; produces replies, grants and
        announcements. Waits in a poll of at most :data:`POLL_S`, unblocked by a message on
        either socket; after each poll it re-tries held requests (a version, a refund or a
        re-deal may have opened the budget), answers held heartbeats that now have news or
        whose wait ended, and declares silent servers dead. Runs until ``stop``."""
        poller = zmq.Poller()
        poller.register(tasks.sock, zmq.POLLIN)
        poller.register(control.sock, zmq.POLLIN)
        last_reap = 0.0
        last_pass = time.monotonic()
        while not stop.is_set():
            events = dict(poller.poll(int(POLL_S * 1000)))
            with self.cond:
                now = time.monotonic()
                if now - last_pass > PAUSED_AFTER_S:
                    self._paused(now - last_pass)
                last_pass = now
                for service, handler in (
                    (tasks, self._on_task_message),
                    (control, self._on_control_message),
                ):
                    if events.get(service.sock):
                        for envelope, msg in service.receive():
                            reply = handler(msg, envelope, now)
                            if reply is not None:
                                service.reply(envelope, reply)
                if now - last_reap >= REAP_EVERY_S:
                    self._reap(now)
                    last_reap = now
                self.requests.serve(tasks, now, self._grant)
                self.watches.serve(control, now, self._news)
                self.cond.notify_all()  # finish_sync and shutdown wait on this state

    def _on_task_message(self, msg: m.Request, envelope: list[bytes], now: float) -> m.Reply | None:
        if isinstance(msg, m.TaskRequest):
            # One task socket per server: a new request means it gave up on a held one.
            self.requests.hold(envelope, msg, now, min(msg.wait_s, self.state.dead_after_s / 2))
            return None  # answered by _grant, in arrival order
        if isinstance(msg, (m.TaskAck, m.TaskNack)):
            return self._on_report(msg, now)
        return m.ErrorReply(error="wrong_socket", detail=f"{msg.kind} goes to the control socket")

    def _on_report(self, msg: m.TaskAck | m.TaskNack, now: float) -> m.Reply:
        """A server's report of its tasks: pushed or filtered (ack), or failed (nack)."""
        st = self.state
        if isinstance(msg, m.TaskAck):
            return st.ack(
                msg.server_id,
                msg.task_ids,
                now,
                msg.filtered,
                msg.prompt_too_long,
                msg.attempts,
                msg.session,
            )
        st.nack(msg.server_id, msg.task_ids, msg.reason, now, msg.attempts, msg.session)
        return m.Ok()

    def _on_control_message(
        self, msg: m.Request, envelope: list[bytes], now: float
    ) -> m.Reply | None:
        st = self.state
        if isinstance(msg, m.Heartbeat):
            st.beat(msg, now)
            news = st.news(msg)
            if news is None:
                self.watches.hold(envelope, msg, now, min(msg.wait_s, st.heartbeat_s))
            return news
        if isinstance(msg, m.Register):
            if problems := settings_problems(st.settings, msg.settings):
                log.error("refused %s: its config differs: %s", msg.server_id, "; ".join(problems))
                return m.ErrorReply(error="config_mismatch", detail="; ".join(problems))
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
        if isinstance(msg, m.SlotRequest):
            return st.grant_slot(msg.server_id, now, msg.request_id)
        if isinstance(msg, m.SyncDone):
            st.sync_done(msg, now)
            return m.Ok()
        if isinstance(msg, (m.TaskAck, m.TaskNack)):
            return self._on_report(msg, now)  # here too, so a held task request cannot delay it
        if isinstance(msg, m.Leave):
            if not st.leave(msg.server_id, msg.pid):
                log.info("leave of %s pid %d ignored: it restarted", msg.server_id, msg.pid)
                return m.Ok()
            self.forget(msg.server_id)
            log.info("server %s left (%s)", msg.server_id, msg.reason or "no reason given")
            return m.Ok()
        if isinstance(msg, m.ShutdownRequest):
            self.on_shutdown_request(msg.reason or "requested by a peer")
            return m.Ok()
        return m.ErrorReply(error="wrong_socket", detail=f"{msg.kind} goes to the tasks socket")

    def _grant(self, held: Held[m.TaskRequest], now: float) -> m.TaskGrant | None:
        """A held task request's grant, or None while it waits for one (counted and timed
        by why it waits)."""
        msg = held.msg
        want = min(msg.max_tasks, self.max_grant)
        grant = self.state.grant(
            msg.server_id, want, now, msg.request_id, self.max_message_bytes, msg.max_samples
        )
        if not grant.tasks and grant.reason in WAIT_REASONS and not held.expired(now):
            if not held.reason:
                self.io[f"waits/{grant.reason}"] += 1
            held.reason = grant.reason
            return None
        if held.reason:
            self.wait_s[held.reason] = self.wait_s.get(held.reason, 0.0) + now - held.since
        return grant

    def _news(self, held: Held[m.Heartbeat], now: float) -> m.Announcement | None:
        """What a held heartbeat is answered with: news for its server, or at the end of
        its wait the current state."""
        news = self.state.news(held.msg)
        if news is None and held.expired(now):
            news = self.state.idle_announcement(held.msg.server_id)
        return news

    def _paused(self, gap_s: float) -> None:
        """The loop did not run for ``gap_s``: the servers' heartbeats queued meanwhile may
        land after the next reap, so their silence counts from now, not over the gap."""
        self.state.forgive_silence(gap_s)
        self.io["paused"] += 1
        log.warning(
            "the coordinator did not run for %.1fs (its process was paused or starved): the "
            "servers' silence over that time is not counted against control.dead_after_s",
            gap_s,
        )

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
        self.watches.drop(server_id)
        self.requests.drop(server_id)

    def metrics(self) -> dict[str, float]:
        """Call under the lock."""
        out = {f"coordinator/{k}": float(v) for k, v in sorted(self.io.items())}
        out |= {f"coordinator/wait_s/{k}": v for k, v in sorted(self.wait_s.items())}
        out["coordinator/held_requests"] = float(len(self.requests))
        out["coordinator/held_watches"] = float(len(self.watches))
        return out


def poll_buffer(
    addr: str,
    state: ControlState,
    lock: threading.RLock,
    stop: threading.Event,
    every_s: float,
    max_request_bytes: int = 0,
) -> None:
    """Consumes the buffer's reports (``endpoints.batches``): dropped groups, scored
    validation groups, its session, and its inventory when due; produces task state changes
    (refunds, re-deals, adoptions).

    Waits ``every_s`` between requests and at most ``max(2, every_s)`` seconds for a reply;
    a silent buffer is logged once per outage. Runs until ``stop``. It must be the only
    caller of the buffer's ``dropped`` request, which drains the lists. An audit is sent in
    requests of at most half ``max_request_bytes`` (``control.max_message_mb``, the most the
    buffer reads; 0: its default).
    """
    from asyncrl.net.buffer_client import BufferClient

    client = BufferClient(addr, "coordinator", timeout_s=max(2.0, every_s))
    silent = False
    failures: set[str] = set()  # kinds of unexpected errors already logged
    try:
        while not stop.wait(every_s):
            try:
                _poll_once(client, state, lock, max_request_bytes)
            except (TimeoutError, RuntimeError, ValueError) as e:  # silent, refused, garbled
                if not silent:
                    log.warning("buffer at %s did not answer (%s); retrying", addr, e)
                silent = True
                continue
            except Exception as e:  # a defect here must not end the polls: refunds stop
                if type(e).__name__ not in failures:  # with them, and the run stalls
                    failures.add(type(e).__name__)
                    log.exception("polling the buffer's reports failed; retrying")
                continue
            silent = False
    finally:
        client.close()


def _poll_once(
    client, state: ControlState, lock: threading.RLock, max_request_bytes: int = 0
) -> None:
    """One drain of the buffer's reports, and its inventory when one is due."""
    reply = client.drain()
    with lock:
        drops = _apply_drops(state, reply.dropped)
        try:
            state.trained(list(reply.validated))
        except Exception:  # the drops above stand; see _apply_drops
            state.counts["buffer_reports_failed"] += len(reply.validated)
            log.exception(
                "the buffer's %d validation reports could not be applied; skipped",
                len(reply.validated),
            )
        known = state.recovery.buffer_session
        due = state.recovery.buffer_contact(reply.session, time.monotonic())
        new_buffer = bool(known) and state.recovery.buffer_session != known
        lost = state.recovery.replay_lost(reply.session)  # asked once: the first drain
        if new_buffer or lost:  # (lost: restarted before a first drain told its session)
            state.versions.end_replay()
    if reply.dropped:
        log.info(
            "buffer dropped %d groups; %d returned to the budget",
            len(reply.dropped),
            drops.refunded,
        )
    if drops.overflowed:
        log.warning(
            "the buffer had no room for %d more incomplete groups (more than "
            "buffer.capacity_groups open at once) and dropped them; they are dealt again. "
            "Raise buffer.capacity_groups",
            drops.overflowed,
        )
    if drops.overflow_given_up:
        log.warning(
            "the buffer had no room for %d more incomplete groups whose prompts had been "
            "dealt staleness.lag_retries times already: given up (the accounting line "
            "counts them among its overflow drops). Raise buffer.capacity_groups",
            drops.overflow_given_up,
        )
    if drops.given_up:
        log.warning(
            "%d training prompts given up after staleness.lag_retries retries (the "
            "accounting line counts them among its lag drops): each came back more than "
            "staleness.max_policy_lag versions old every time it was dealt. Long responses do "
            "that (raise the lag, or lower data.max_response_length), and so does a server "
            "slower than the rest (compare the servers' rollout/tokens_per_s)",
            drops.given_up,
        )
    if due:
        inventory = client.inventory()
        with lock:
            state.reconcile_buffer(
                list(inventory.held),
                list(inventory.dropped),
                paused=inventory.paused,
                validated=list(inventory.validated),
            )
    with lock:
        audit = state.audit_request(time.monotonic())
    if audit is not None:
        ids, before = audit
        for part in id_chunks(ids, (max_request_bytes or m.DEFAULT_MAX_MESSAGE_BYTES) // 2):
            answer = client.inventory(part)
            with lock:
                state.audited(list(answer.unknown), answer.paused, before)
            if answer.paused:  # not reading: the rest may wait in its queue too
                break


def id_chunks(ids: list[str], max_bytes: int) -> list[list[str]]:
    """``ids`` in consecutive lists whose encoded ids take at most ``max_bytes`` each (a
    msgpack string costs its UTF-8 bytes and at most 5 bytes of header); every list holds
    at least one id. A request larger than the buffer reads is never answered: its socket
    drops it, and the audit read as a silent buffer."""
    out: list[list[str]] = []
    size = 0
    for tid in ids:
        cost = len(tid.encode()) + 5
        if not out or size + cost > max_bytes:
            out.append([])
            size = 0
        out[-1].append(tid)
        size += cost
    return out


def _apply_drops(state: ControlState, reports: list) -> Drops:
    """The buffer's drop reports, each on its own: the buffer has drained them, so one
    that cannot be applied (a malformed report, a defect) is logged, counted in
    ``coordinator/buffer_reports_failed`` and skipped, and the others still refund their
    budget (handled as one list, the whole drain was lost with it)."""
    total = Drops(0, 0, 0, 0)
    for report in reports:
        try:
            d = state.ledger.dropped([report])
        except Exception:
            state.counts["buffer_reports_failed"] += 1
            log.exception("the buffer's drop report %r could not be applied; skipped", report)
            continue
        total = Drops(*(a + b for a, b in zip(total, d, strict=True)))
    return total
