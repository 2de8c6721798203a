"""A rollout server's side of the control plane: :class:`CoordinatorClient`.

Typical use (a rollout server's main loop; the heartbeat runs in its own thread)::

    client = CoordinatorClient.from_config(cfg, "rollout-0", engine_world_size=1)
    client.register()
    client.start_watching()                       # heartbeats, announcements, syncs
    while not client.shutdown.is_set():
        start = client.next_sync(timeout_s=0)     # a SyncStart to join, if any
        if start is not None:
            ...                                   # pause, receive weights, resume
            client.sync_done(start, ok=True)
        grant = client.request_tasks()            # waits while the budget is closed
        for task in grant.tasks:
            ...                                   # generate n responses, push the group
            client.ack([task.task_id])            # after the whole group was pushed
    client.leave("shutdown")

Acknowledging means: every trajectory of the task's group was handed to the trajectory
socket (``TrajectoryPusher.send`` returned). Until then, the coordinator re-deals the task
if this server dies.

Three REQ sockets, each behind its own lock (:mod:`asyncrl.control.client_sockets`), so any
thread may call any method. A server that
the coordinator no longer knows (it was declared dead, or the coordinator restarted) is
registered again automatically, once per stale registration whichever thread notices first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any

import zmq

from asyncrl.control import messages as m
from asyncrl.control.client_sockets import ClientSockets, Socket
from asyncrl.control.request_ids import RequestIds
from asyncrl.control.server_totals import COUNTER_PREFIXES
from asyncrl.net.transport import RequestRefused
from asyncrl.wire.base import single

if TYPE_CHECKING:
    from asyncrl.config import Config

log = logging.getLogger(__name__)

STOPPING_LOCK_WAIT_S = 0.5  # how long a stopping server's request waits for the socket


class CoordinatorGone(RuntimeError):
    """The coordinator did not answer for longer than the client's patience."""


class CoordinatorClient:
    """Register, heartbeat (and watch for announcements), take and acknowledge tasks."""

    def __init__(
        self,
        tasks_addr: str,
        control_addr: str,
        server_id: str,
        *,
        engine_world_size: int = 1,
        address: str = "",
        policy_version: int = 0,
        heartbeat_s: float = 2.0,
        tasks_per_request: int = 4,
        timeout_s: float = 5.0,
        patience_s: float = 300.0,
        context: zmq.Context | None = None,
        max_message_bytes: int = 0,
    ):
        self.server_id = server_id
        self.engine_world_size = engine_world_size
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.tasks_per_request = tasks_per_request
        self.timeout_s = timeout_s
        self.patience_s = patience_s  # silence after which the coordinator counts as gone
        self.policy_version = policy_version  # the weights this server holds
        self.weights_partial = False  # its last sync broke them off mid-load (sync_done)
        self.announced_version = policy_version  # the latest version announced to it
        self.registered: m.Registered | None = None
        self.metrics: dict[str, float] = {}  # sent with every heartbeat (the server sets it)
        self._metrics_cut_said = False
        # The task ids this server is generating now (the server sets it): a registration
        # says them, so a restarted coordinator lets it keep them.
        self.held_tasks: Callable[[], list[str]] = list
        self.settings: dict[str, str] = {}  # what it must share with the learner (register)
        # Called after each answered registration, the first and those again (a restarted
        # coordinator): the server marks it where its launcher looks.
        self.on_registered: Callable[[m.Registered], None] = lambda reply: None
        self.session = ""
        self.registrations = 0  # answered registrations: which one a reply was about
        self.seen_sync = 0
        # Each call takes its own id (concurrent calls never share a grant); an unanswered
        # one is asked again by the next call, which gets the grant whose reply was lost.
        self._task_ids, self._slot_ids = RequestIds(), RequestIds()
        self.syncs: queue.Queue[m.SyncStart] = queue.Queue()
        self.shutdown = threading.Event()  # the coordinator said the run is over
        self.gone = threading.Event()  # the coordinator was silent past patience_s
        # Set with gone when the coordinator answered but this server cannot go on with it
        # (a registration refused, a reply it cannot read): not silence, so not a learner
        # that hangs (its exit code says which, for the launcher).
        self.refused = ""
        self.last_heard = time.monotonic()
        self.max_message_bytes = max_message_bytes  # control.max_message_mb, both ways
        self._sockets = ClientSockets(
            tasks_addr,
            control_addr,
            timeout_s=timeout_s,
            context=context or zmq.Context.instance(),
            max_message_bytes=max_message_bytes,
        )
        self.control_addr = control_addr
        self._register_lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._watch_margin_s = max(1.0, heartbeat_s)

    @classmethod
    def from_config(cls, cfg: Config, server_id: str, **kwargs: Any) -> CoordinatorClient:
        """A client dialing ``endpoints.tasks``/``endpoints.control`` with the ``control``
        group's heartbeat and request size; patience ``launch.start_timeout_s``."""
        from asyncrl.net.transport import config_endpoint, mebibytes

        kwargs.setdefault("heartbeat_s", cfg.control.heartbeat_s)
        kwargs.setdefault("tasks_per_request", cfg.control.tasks_per_request)
        kwargs.setdefault("patience_s", cfg.launch.start_timeout_s)
        kwargs.setdefault("max_message_bytes", mebibytes(cfg.control.max_message_mb))
        from asyncrl.config.shared import shared_settings

        client = cls(
            config_endpoint(cfg.endpoints, "tasks"),
            config_endpoint(cfg.endpoints, "control"),
            server_id,
            **kwargs,
        )
        client.settings = shared_settings(cfg)
        return client

    # ------------------------------------------------------------------ plumbing
    def _call(
        self,
        sock: Socket,
        msg: m.Request,
        timeout_s: float | None = None,
        lock_wait_s: float = -1.0,
    ) -> m.Reply:
        """One request/reply on socket ``sock`` (:meth:`ClientSockets.call`)."""
        return self._sockets.call(sock, msg, self._heard, timeout_s, lock_wait_s)

    def _heard(self, frames: list[zmq.Frame]) -> m.Reply:
        """A reply came (even a refusal): the coordinator is alive."""
        self.last_heard = time.monotonic()
        return m.decode_reply(single(frames), self.max_message_bytes)

    # ------------------------------------------------------------------ registration
    def register(self, wait_s: float | None = None) -> m.Registered:
        """Register (waiting up to ``wait_s``, default ``patience_s``, for the coordinator,
        logging while it is not up). Resets what was seen of the previous session."""
        wait_s = self.patience_s if wait_s is None else wait_s
        msg = m.Register(
            server_id=self.server_id,
            address=self.address,
            engine_world_size=self.engine_world_size,
            policy_version=self.policy_version,
            pid=_pid(),
            task_ids=self.held_tasks(),
            settings=self.settings,
            weights_partial=self.weights_partial,
        )
        start = time.monotonic()
        while True:
            try:
                reply = self._register_once(msg, min(self.timeout_s, wait_s))
                break
            except TimeoutError:
                waited = time.monotonic() - start
                if waited >= wait_s or self._closed.is_set() or self.shutdown.is_set():
                    raise CoordinatorGone(
                        f"no coordinator at {self.control_addr} for {waited:.0f}s"
                    ) from None
                log.info("waiting for the coordinator at %s (%.0fs)", self.control_addr, waited)
        assert isinstance(reply, m.Registered), reply
        self.registered, self.session, self.seen_sync = reply, reply.session, 0
        self.registrations += 1
        self.announced_version = max(self.announced_version, reply.policy_version)
        if self.engine_world_size == 0:  # no weights to load: adopt the version
            self.policy_version = self.announced_version
        log.info(
            "%s registered (session %s, version %d%s)",
            self.server_id,
            reply.session,
            reply.policy_version,
            ", catch-up first" if reply.catchup else "",
        )
        self.on_registered(reply)
        return reply

    def _register_once(self, msg: m.Register, timeout_s: float) -> m.Reply:
        """One registration request, given up at once (TimeoutError) when :attr:`shutdown`
        is set meanwhile: a server stopped (SIGTERM) while the coordinator is gone heard it
        only after each attempt, and overran the launcher's grace. The request then runs
        out on its own thread, holding the control socket up to ``timeout_s``; should the
        coordinator register the server after all, that thread tells it the server left
        (the server, stopping, believes it never registered: it would leave a ghost)."""
        if self.shutdown.is_set():
            raise TimeoutError("stopping")
        reply: futures.Future[m.Reply] = futures.Future()
        settle = threading.Lock()  # the reply and the giving up: one of them comes first
        gave_up = False

        def call() -> None:
            try:
                got = self._call("control", msg, timeout_s)
            except BaseException as e:  # handed to the caller
                with settle:
                    reply.set_exception(e)
                return
            with settle:
                reply.set_result(got)
                late = gave_up
            if late and isinstance(got, m.Registered):
                try:
                    self.leave("stopped while registering")
                except Exception as e:  # the client closed meanwhile: dead_after_s will do
                    log.debug("no Leave after a late registration: %s", e)

        threading.Thread(target=call, name="register", daemon=True).start()
        while not futures.wait([reply], 0.1).done:
            if self.shutdown.is_set():
                with settle:
                    if not reply.done():
                        gave_up = True
                        raise TimeoutError("stopping")
        return reply.result()

    def _registration(self) -> tuple[str, int]:
        """Which registration a request is sent under (read before sending it)."""
        return self.session, self.registrations

    def _reregister(self, stale: tuple[str, int]) -> None:
        """Register again unless another thread already did since ``stale`` (a
        :meth:`_registration`). The session alone did not tell: registering again with the
        same coordinator keeps it, so the heartbeat and the task threads, told
        "unregistered" together, both registered, and the second counted as a restart."""
        with self._register_lock:
            if self._registration() == stale and not self._closed.is_set():
                log.warning(
                    "%s is not registered with the coordinator: registering", self.server_id
                )
                try:
                    self.register()
                except CoordinatorGone as e:
                    if not self.shutdown.is_set():  # else: stopping, no need to register
                        # Said as the watch says it: raised here, the task thread's call
                        # ended the server with a traceback, exit 1, not 3 (gone).
                        log.error("%s: %s: leaving", self.server_id, e)
                        self.gone.set()
                except RequestRefused as e:  # a learner restarted with another config
                    log.error("%s: registration refused (%s): leaving", self.server_id, e)
                    self.refused = f"its registration was refused ({e})"
                    self.gone.set()  # the server exits; its restart reads the config again

    # ------------------------------------------------------------------ heartbeat / watch
    def heartbeat(self, wait_s: float | None = None) -> m.Announcement | None:
        """One heartbeat that also watches: returns when the coordinator has news for this
        server or after about ``wait_s`` (default ``heartbeat_s``); None if it stayed
        silent. Announcements are applied (version, sync queue, shutdown)."""
        wait_s = self.heartbeat_s if wait_s is None else wait_s
        seen = self._registration()
        msg = m.Heartbeat(
            server_id=self.server_id,
            session=seen[0],
            policy_version=self.policy_version,
            seen_version=self.announced_version,
            seen_sync=self.seen_sync,
            wait_s=wait_s,
            metrics=self._heartbeat_metrics(),
        )
        try:
            # A short reply timeout: a silent coordinator is noticed within two periods.
            ann = self._call("watch", msg, wait_s + self._watch_margin_s)
        except TimeoutError:
            return None
        assert isinstance(ann, m.Announcement), ann
        self._apply(ann, seen)
        return ann

    def _heartbeat_metrics(self) -> dict[str, float]:
        """The server's metrics, at most what a heartbeat may carry (the coordinator
        refuses a longer one; those past the limit are left out, said once)."""
        metrics = dict(self.metrics)
        if len(metrics) <= m.HEARTBEAT_METRICS_MAX:
            return metrics
        if not self._metrics_cut_said:
            self._metrics_cut_said = True
            log.warning(
                "%s has %d metrics; heartbeats carry the first %d by name",
                self.server_id,
                len(metrics),
                m.HEARTBEAT_METRICS_MAX,
            )
        # The server's own counters first: those named as they arise (per agent, endpoint
        # or version) are the ones left out.
        open_ended = (*COUNTER_PREFIXES, "rollout/tokens_by_version/")
        kept = sorted(metrics.items(), key=lambda kv: (kv[0].startswith(open_ended), kv[0]))
        return dict(kept[: m.HEARTBEAT_METRICS_MAX])

    def _apply(self, ann: m.Announcement, seen: tuple[str, int]) -> None:
        if ann.shutdown:
            self.shutdown.set()
            return
        if not ann.registered:
            self._reregister(seen)
            return
        if ann.policy_version > self.announced_version:
            self.announced_version = ann.policy_version
            if self.engine_world_size == 0:
                self.policy_version = ann.policy_version
        if ann.sync is not None and ann.sync.sync_id > self.seen_sync:
            self.seen_sync = ann.sync.sync_id
            self.syncs.put(ann.sync)

    def start_watching(self) -> threading.Thread:
        """Heartbeat in a daemon thread until shutdown, :meth:`close` or silence past
        ``patience_s`` (then :attr:`gone` is set)."""
        self._watcher = threading.Thread(target=self._watch_loop, name="heartbeat", daemon=True)
        self._watcher.start()
        return self._watcher

    def _watch_loop(self) -> None:
        """Consumes announcements; produces heartbeats (each is the next watch), back to
        back. Waits in each long-poll for at most twice ``heartbeat_s`` (at least 1 s more).
        Unblocked by news for this server; ends at shutdown, close, or a coordinator silent
        for ``patience_s``."""
        while not (self.shutdown.is_set() or self._closed.is_set() or self.gone.is_set()):
            try:
                news = self.heartbeat()
            except Exception as e:  # a dead watch would leave the server up, unheard
                # A coordinator gone during a registration (silence: exit 3), a refused
                # heartbeat, a reply it cannot read (answered: exit 4): nothing this
                # server can mend; it exits and restarts.
                log.error(
                    "%s: the coordinator watch failed (%s: %s): leaving",
                    self.server_id,
                    type(e).__name__,
                    e,
                )
                if not isinstance(e, CoordinatorGone):
                    self.refused = self.refused or f"its watch failed ({type(e).__name__}: {e})"
                self.gone.set()
                return
            if news is None:
                silent = time.monotonic() - self.last_heard
                if silent > self.patience_s:
                    log.error("coordinator silent for %.0fs: giving up", silent)
                    self.gone.set()
                    return
                log.warning("no answer to a heartbeat (coordinator silent for %.0fs)", silent)

    def next_sync(self, timeout_s: float = 0.0) -> m.SyncStart | None:
        """The next sync this server must join, waiting up to ``timeout_s`` for one."""
        try:
            return self.syncs.get(timeout=timeout_s) if timeout_s > 0 else self.syncs.get_nowait()
        except queue.Empty:
            return None

    def sync_done(
        self,
        start: m.SyncStart,
        ok: bool,
        error: str = "",
        seconds: float = 0.0,
        checksum: str = "",
        attempts: int = 3,
        probe: list[float] | None = None,
    ) -> bool:
        """Report the outcome of ``start``; on success this server now holds its version.
        A failure whose ``error`` begins with :data:`~asyncrl.control.messages.WEIGHTS_PARTIAL`
        left its weights partly loaded: a registration says so until a sync loads them.

        Retried on timeouts (a report is idempotent): until the coordinator has it, this
        server counts as busy in that sync and gets no catch-up. False if never answered.
        """
        if ok:  # what it loaded, older than before after a catch-up from a restarted learner
            self.policy_version = start.version
        self.weights_partial = not ok and error.startswith(m.WEIGHTS_PARTIAL)
        msg = m.SyncDone(
            server_id=self.server_id,
            sync_id=start.sync_id,
            version=start.version,
            ok=ok,
            error=error[:4000],
            seconds=seconds,
            checksum=checksum,
            probe=probe or [],
            session=start.session,
        )
        return self._send_retried(msg, attempts, f"the report of sync {start.sync_id}")

    def _control_retried(self, msg: m.Request, attempts: int) -> m.Reply | None:
        """An idempotent request on the control socket, retried on timeouts (the task
        socket may be held by a long-polled request, and a request queued behind it would
        also hold a worker thread of the server); None when it was never answered."""
        for attempt in range(attempts):
            if self.gone.is_set() or (attempt and self.shutdown.is_set()):
                break
            try:
                # Stopping, a request does not queue behind another's timeout (a live
                # coordinator answers the one ahead in milliseconds; a server stopped with
                # the learner took 15 s per request, then SIGKILL), nor tries again.
                wait_s = STOPPING_LOCK_WAIT_S if self.shutdown.is_set() else -1.0
                return self._call("control", msg, lock_wait_s=wait_s)
            except TimeoutError:
                continue
        return None

    def _send_retried(self, msg: m.Request, attempts: int, what: str) -> bool:
        """Send a report with :meth:`_control_retried`; False (and a warning naming
        ``what``) when it was never answered."""
        if self._control_retried(msg, attempts) is not None:
            return True
        log.log(
            logging.INFO if self.shutdown.is_set() else logging.WARNING,
            "%s was never answered",
            what,
        )
        return False

    # ------------------------------------------------------------------ tasks
    def request_tasks(
        self, max_tasks: int | None = None, wait_s: float | None = None, max_samples: int = 0
    ) -> m.TaskGrant:
        """Ask for up to ``max_tasks`` (default ``tasks_per_request``) tasks, of at most
        ``max_samples`` responses past the first task (0: any); the coordinator holds the
        request up to ``wait_s`` (default ``heartbeat_s``) while it can grant none. An
        empty grant says why in ``reason`` (``timeout``: no answer)."""
        wait_s = self.heartbeat_s if wait_s is None else wait_s
        seen = self._registration()
        msg = m.TaskRequest(
            server_id=self.server_id,
            max_tasks=max_tasks or self.tasks_per_request,
            wait_s=wait_s,
            request_id=self._task_ids.take(),
            max_samples=max_samples,
        )
        try:
            grant = self._call("tasks", msg, wait_s + self.timeout_s)
        except TimeoutError:  # the next request repeats this id: a lost grant comes again
            self._task_ids.unanswered(msg.request_id)
            return m.TaskGrant(tasks=[], policy_version=self.announced_version, reason="timeout")
        assert isinstance(grant, m.TaskGrant), grant
        if grant.reason == "unregistered":
            self._reregister(seen)
        elif grant.reason == "shutdown":
            self.shutdown.set()
        return grant

    def request_slot(self, attempts: int = 2) -> m.TaskGrant:
        """Ask for one external training slot (see :class:`~asyncrl.control.messages.
        SlotRequest`); answered at once. An empty grant says why (``timeout``: never
        answered). Its retries repeat its request id, so a lost reply costs no second
        slot; concurrent calls never share one."""
        msg = m.SlotRequest(server_id=self.server_id, request_id=self._slot_ids.take())
        seen = self._registration()
        grant = self._control_retried(msg, attempts)
        if grant is None:
            self._slot_ids.unanswered(msg.request_id)
            return m.TaskGrant(tasks=[], policy_version=self.announced_version, reason="timeout")
        assert isinstance(grant, m.TaskGrant), grant
        if grant.reason == "unregistered":
            self._reregister(seen)
        return grant

    def give_back_unanswered_slots(self, older_than_s: float) -> int:
        """Slot requests never answered and not repeated since (their group gave up, the
        agent left): a grant whose reply was lost holds a slot of the admission budget, and
        nothing else gives it back while this server lives. Each is asked once more under
        its id, and the slot it gets is given back (a refusal, or a fresh slot when the
        request never arrived, ends it too). Returns how many slots went back."""
        back = 0
        for rid in self._slot_ids.stale(older_than_s):
            msg = m.SlotRequest(server_id=self.server_id, request_id=rid)
            grant = self._control_retried(msg, 1)
            if grant is None:  # still unanswered: asked again next time
                self._slot_ids.unanswered(rid)
                continue
            assert isinstance(grant, m.TaskGrant), grant
            if ids := [t.task_id for t in grant.tasks]:
                self.nack(ids, "slot request never answered: no group waits for its slot")
                back += len(ids)
        return back

    def ack(
        self,
        task_ids: list[str],
        attempts: int = 3,
        filtered: bool = False,
        prompt_too_long: bool = False,
        dealt: list[int] | None = None,
        session: str = "",
    ) -> m.TaskAckReply | None:
        """Acknowledge tasks whose groups were pushed whole (``filtered``: whose groups the
        group filter dropped here; with ``prompt_too_long``, whose prompts were dropped
        before generation; ``dealt``: each one's attempt as this server got it, ``session``
        the coordinator session that dealt them); retried on timeouts (an ack is
        idempotent). None if the coordinator never answered."""
        msg = m.TaskAck(
            server_id=self.server_id,
            task_ids=list(task_ids),
            filtered=filtered,
            prompt_too_long=prompt_too_long,
            attempts=dealt,
            session=session,
        )
        reply = self._control_retried(msg, attempts)
        if reply is None:
            level = logging.INFO if self.shutdown.is_set() else logging.WARNING
            log.log(level, "acknowledgement of %d tasks was never answered", len(task_ids))
            return None
        assert isinstance(reply, m.TaskAckReply), reply
        return reply

    def nack(
        self,
        task_ids: list[str],
        reason: str,
        dealt: list[int] | None = None,
        session: str = "",
        tries: int = 3,
    ) -> bool:
        """Report tasks that failed here before their group was pushed, so the coordinator
        deals them again at once; retried on timeouts. ``dealt``: each task's attempt as
        this server got it, ``session`` the coordinator session that dealt them (a retried
        report then cannot fail a later deal of it). False if never answered (then its
        ``control.task_timeout_s`` takes them back)."""
        msg = m.TaskNack(
            server_id=self.server_id,
            task_ids=list(task_ids),
            reason=reason[:4000],
            attempts=dealt,
            session=session,
        )
        return self._send_retried(msg, tries, f"the failure report of {len(task_ids)} tasks")

    # ------------------------------------------------------------------ the end
    def leave(self, reason: str = "", timeout_s: float = 2.0) -> bool:
        """Tell the coordinator this server stops (its unacknowledged tasks are re-dealt at
        once). Best effort: False when it did not answer."""
        # Its pid, as registered: a late Leave of this process then cannot remove a
        # restarted server of the same id (the launcher's Leaves name theirs too).
        leave = m.Leave(server_id=self.server_id, reason=reason, pid=_pid())
        try:  # the send and the reply get half the time each, as the socket's wait does
            self._call("control", leave, timeout_s / 2, lock_wait_s=timeout_s / 2)
            return True
        except (TimeoutError, RuntimeError):
            return False

    def request_shutdown(self, reason: str = "") -> None:
        """Ask the coordinator to end the run for everyone."""
        self._call("control", m.ShutdownRequest(reason=reason))

    def close(self) -> None:
        """Stop the heartbeat thread and close the sockets. Stopping (:attr:`shutdown`),
        it waits at most half a second for calls still out (the coordinator may be gone
        too: each would hold it for its timeout); a socket still in use is left to the
        process's exit."""
        self._closed.set()
        wait_s = 0.5 if self.shutdown.is_set() else None
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(wait_s or self.heartbeat_s + self._watch_margin_s + 0.5)
        # The watch socket stays open while the heartbeat thread still polls it.
        self._sockets.close(wait_s, watch_in_use=watcher is not None and watcher.is_alive())

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pid() -> int:
    import os

    return os.getpid()
