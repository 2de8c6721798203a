"""The buffer service: :class:`buffer.core.ReplayBuffer` behind two ZeroMQ sockets.

- ``trajectories`` (PULL, bound): rollout servers push trajectory messages. Read only while
  the buffer has room; when it is full the socket is not read, its queue fills and
  producers block at their high-water mark (backpressure, never loss).
- ``batches`` (ROUTER, bound): consumers send :data:`asyncrl.wire.Request` messages from a
  REQ socket. A ``batch_request`` waits in the service (up to its ``wait_s``) until a batch
  can be released, while other clients (stats, shutdown) are still answered. There is one
  training consumer (learner rank 0, under the same consumer id across restarts): its
  ``hello`` starts a session, voids requests it left waiting, and queues the batches it
  had not acknowledged again; from then on the batch requests and acks of any other client
  under its id (an old learner still alive) are refused ``superseded``
  (``buffer/superseded_requests``, :mod:`buffer.consumers`). Other clients (the
  coordinator draining dropped tasks, observers) use the other requests; a ``hello`` of
  theirs leaves the learner's batches alone. What each request is answered is
  :mod:`buffer.answers`'s; this module owns the sockets, the loop and its thread.

The buffer's contents live in memory: they survive a learner restart, not a buffer restart.

Bad input of any kind that reaches the buffer is rejected, counted
(``buffer/rejects/<socket>/<kind>``) and logged once per kind (a trajectory message's line
names its server, a task and the config key to change); the service keeps running. The
groups a refused trajectory message names are reported dropped (``oversize`` or
``invalid``; ``buffer/drops/rejected``), so the coordinator does not deal them again. A
trajectory frame over ``buffer.max_message_mb`` never reaches it: zmq drops it with the
sender's connection, uncounted (rollout servers check the size before they send).

Run it as ``asyncrl-buffer CONFIG`` (see ``buffer/main.py``) or inside another process::

    service = BufferService.from_config(cfg).start()   # a thread; returns once bound
    ...                                                 # service.batches_endpoint, ...
    service.stop()
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from asyncrl import wire
from asyncrl.net import authority, security
from asyncrl.net.serving import RouterService, internal_error
from asyncrl.net.transport import bind, config_endpoint, make_socket, mebibytes
from buffer.answers import Answers
from buffer.core import ReplayBuffer
from buffer.rollout_log import RolloutLog
from buffer.service_stats import ServiceStats, summary

if TYPE_CHECKING:
    from asyncrl.config import Config

log = logging.getLogger(__name__)

POLL_S = 0.05  # longest poll: bounds how late a stop, a wait_s deadline or expiry can be
EXPIRE_EVERY_S = 0.25
READ_BURST = 16  # messages read per wakeup before requests are looked at again


class BufferService:
    """Serves one :class:`ReplayBuffer`; :meth:`run` in the calling thread or :meth:`start`
    a thread. Sockets are created, used and closed by the thread that runs the loop."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        *,
        trajectories: str = "tcp://127.0.0.1:*",
        batches: str = "tcp://127.0.0.1:*",
        limits: wire.Limits = wire.DEFAULT_LIMITS,
        rollout_log: RolloutLog | None = None,
        rcvhwm: int = 1000,
        log_every_s: float = 30.0,
        collect_every_s: float | None = None,
    ):
        self.buffer, self.limits, self.rollout_log = buffer, limits, rollout_log
        self.rcvhwm, self.log_every_s = rcvhwm, log_every_s
        # Run the cyclic garbage collector every so often (when its process turned the
        # automatic runs off: buffer/memory.py collect_on_schedule); None: leave it to Python.
        self.collect_every_s = collect_every_s
        # For an audit's "paused": whether the last read left messages in the socket, and
        # when a read last found it empty (a group pushed before a pause may wait in the
        # queue until the first read after it that drains it).
        self._backlog = False
        self._drained_at = 0.0
        self.trajectories_endpoint = trajectories  # the bound address once started
        self.batches_endpoint = batches
        self.stats = ServiceStats()
        # Names this process's contents: a coordinator that sees a new session knows the
        # groups it acknowledged to the old one are gone.
        self.session = buffer.session
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._answers = Answers(
            buffer, metrics=self.metrics, on_shutdown=self.request_stop, paused=self._unread
        )

    @classmethod
    def from_config(
        cls, cfg: Config, run_directory: Path | None = None, collect_every_s: float | None = None
    ) -> BufferService:
        """A service configured by the ``data``, ``staleness``, ``buffer``, ``endpoints``
        and ``trainer`` groups (the rollout log goes to ``<run dir>/rollouts``)."""
        from asyncrl.config import run_dir

        b = cfg.buffer
        buffer = ReplayBuffer(
            batch_size=cfg.data.train_batch_size,
            capacity_groups=b.capacity_groups,
            max_policy_lag=cfg.staleness.max_policy_lag,
            policy=b.policy,
            max_reuse=b.max_reuse,
            group_timeout_s=b.group_timeout_s,
            seed=cfg.trainer.seed,
        )
        limits = wire.Limits(
            max_message_bytes=mebibytes(b.max_message_mb),
            max_prompt_len=cfg.data.max_prompt_length,
            max_response_len=cfg.data.max_response_length,
            max_request_bytes=mebibytes(cfg.control.max_message_mb),
        )
        directory = run_directory or run_dir(cfg)
        return cls(
            buffer,
            trajectories=config_endpoint(cfg.endpoints, "trajectories"),
            batches=config_endpoint(cfg.endpoints, "batches"),
            limits=limits,
            rollout_log=RolloutLog(directory / "rollouts") if b.log_rollouts else None,
            rcvhwm=b.queued_messages,
            collect_every_s=collect_every_s,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 10.0) -> BufferService:
        """Run the loop in a daemon thread; return once both sockets are bound."""
        self._thread = threading.Thread(
            target=self._run_quietly, name="buffer-service", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"buffer service did not bind within {timeout_s}s")
        if self._error is not None:
            raise RuntimeError(f"buffer service failed to start: {self._error}") from self._error
        return self

    def request_stop(self) -> None:
        """Ask the loop to stop within :data:`POLL_S` (safe from signal handlers)."""
        self._stop.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop a :meth:`start`-ed service and wait for its thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"buffer service did not stop within {timeout_s}s")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for a :meth:`start`-ed service to stop (e.g. after a ``shutdown`` request);
        True once it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def __enter__(self) -> BufferService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run_quietly(self) -> None:
        try:
            self.run()
        except BaseException as e:  # reported by start(), or logged when it happens later
            self._error = e
            self._ready.set()
            log.exception("buffer service crashed")

    def run(self) -> None:
        """Serve until :meth:`request_stop`, SIGTERM (see main) or a ``shutdown`` request.

        Consumes trajectory messages (while the buffer has room) and requests; produces
        replies, batches among them. Waits in a poll of at most :data:`POLL_S`; unblocked by
        a message on either socket. Held requests are answered when a batch can be released
        or their ``wait_s`` runs out; incomplete groups are expired on the way.
        """
        ctx = zmq.Context()
        # A frame over the limits is never read: zmq drops its sender's connection. Larger
        # messages of smaller frames are read, refused (``oversize``) and counted.
        pull = make_socket(
            ctx, zmq.PULL, rcvhwm=self.rcvhwm, max_message_bytes=self.limits.max_message_bytes
        )
        router = None
        try:
            self.trajectories_endpoint = bind(pull, self.trajectories_endpoint)
            # A reply the consumer cannot receive (it died meanwhile) is counted; its batch
            # stays unacknowledged and comes again after the consumer's restart.
            router = RouterService(
                ctx,
                self.batches_endpoint,
                self._decode,
                on_reject=self._reject,
                counts=self.stats.io,
                rcvhwm=self.rcvhwm,
                max_message_bytes=self.limits.max_request_bytes,
                policy=authority.BUFFER,
            )
            self.batches_endpoint = router.endpoint
            log.info(
                "buffer: trajectories on %s, batches on %s",
                self.trajectories_endpoint,
                self.batches_endpoint,
            )
            self._ready.set()
            self._loop(pull, router)
        finally:
            pull.close(0)
            if router is not None:
                router.close()
            ctx.term()
            if self.rollout_log is not None:
                self.rollout_log.close()
            log.info("buffer stopped: %s", summary(self.metrics()))

    # ------------------------------------------------------------------ loop
    def _loop(self, pull: zmq.Socket, router: RouterService[wire.Request]) -> None:
        poller = zmq.Poller()
        poller.register(router.sock, zmq.POLLIN)
        reading = False
        last_tick = last_log = last_collect = time.monotonic()
        self.stats.start(last_tick)
        while not self._stop.is_set():
            room = self.buffer.has_room()
            if room != reading:
                reading = room
                if room:
                    poller.register(pull, zmq.POLLIN)
                else:
                    poller.unregister(pull)
                self.stats.set_paused(not room, time.monotonic())
            events = dict(poller.poll(self._poll_ms()))
            if events.get(router.sock):
                for envelope, msg in router.receive(READ_BURST):
                    self._on_request(router, envelope, msg)
            if reading:  # nothing to read (no event): nothing left unread either
                self._backlog = bool(events.get(pull)) and not self._read_trajectories(pull)
                if not self._backlog:
                    self._drained_at = time.monotonic()
            now = time.monotonic()
            self._answers.serve(router, now)
            if now - last_tick >= EXPIRE_EVERY_S:
                self.buffer.expire(self.stats.reading_clock(now))
                c = self.buffer.counts
                dropped = c["drops/duplicate"] + c["drops/late"] + c["drops/inconsistent"]
                self.stats.update_rates(now, c["trajectories_in"] + dropped)
                last_tick = now
            if self.collect_every_s is not None and now - last_collect >= self.collect_every_s:
                gc.collect()
                last_collect = time.monotonic()
                self.stats.collected(last_collect - now)
            self.stats.check_pause(now)
            if now - last_log >= self.log_every_s:
                log.info("buffer: %s", summary(self.metrics()))
                last_log = now

    def _poll_ms(self) -> int:
        timeout = POLL_S
        deadline = self._answers.held.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        return int(timeout * 1000)

    def _read_trajectories(self, pull: zmq.Socket) -> bool:
        """Read up to :data:`READ_BURST` messages; True when the socket was drained."""
        for _ in range(READ_BURST):
            if not self.buffer.has_room():
                return False
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            # Zero-copy views of zmq's buffers; cheaper to size and decode than Frames.
            self._ingest([f.buffer for f in frames])
        return False

    def _unread(self) -> bool:
        """Whether trajectories may wait unread (an audit's ``paused``): the buffer is full
        or reading is paused (an ack in this loop pass may have made room: reading resumes
        only at the next), the last read left messages in the socket, or no read has
        emptied it since reading last resumed. Groups whose push returned long ago may sit
        in the queue all that time; the coordinator must not deal them again. Under steady
        backpressure, pauses come and go at every batch: each drain in between lets an
        audit through (a window of time since the last pause never did)."""
        resumed = self.stats.resumed_at
        return (
            not self.buffer.has_room()
            or self.stats.paused
            or self._backlog
            or (resumed is not None and self._drained_at < resumed)
        )

    def _ingest(self, frames: list[memoryview]) -> None:
        try:
            packed = wire.decode_packed(frames, self.limits)
        except wire.WireError as e:
            self._refused(frames, e)
            return
        outcomes = self.buffer.add_packed(packed, self.stats.reading_clock(time.monotonic()))
        if self.rollout_log is not None:
            for t, outcome in zip(packed.trajectories, outcomes, strict=True):
                self.rollout_log.append(t, outcome, time.time())
        self.stats.io["bytes_in"] += sum(f.nbytes for f in frames)
        self.stats.io["messages_in"] += 1

    def _refused(self, frames: list[memoryview], err: wire.WireError) -> None:
        """A trajectory message refused: counted, logged (naming its server, a task and
        the config key) and, where its header names its tasks, each reported dropped
        (``oversize``, else ``invalid``) so the coordinator neither keeps them "in buffer"
        nor deals them again (a group refused every time would loop forever)."""
        named = wire.named_tasks(frames[0]) if frames else []
        cause = "oversize" if err.kind == "oversize" else "invalid"
        dropped = [t.task_id for t in named if self.buffer.reject(t.task_id, cause, t.validation)]
        self.stats.reject("trajectories", err, named, len(dropped))

    # ------------------------------------------------------------------ requests
    # What each request is answered: buffer/answers.py. Here, what the socket refuses.
    def _decode(self, body: list[bytes]) -> wire.Request:
        return wire.decode_request(body, self.limits)

    def _reject(self, err: wire.WireError) -> None:
        self.stats.reject("requests", err)

    def _on_request(
        self, router: RouterService[wire.Request], envelope: list[bytes], msg: wire.Request
    ) -> None:
        """Answer ``msg``; a request that raises is answered ``ErrorReply("internal")`` and
        counted (``buffer/request_errors``): the groups the buffer holds outlive it. A batch
        request that raised is no longer held (it would raise at every pass of the loop)."""
        try:
            self._answers.on_request(router, envelope, msg)
        except Exception as e:
            if isinstance(msg, wire.BatchRequest):
                self._answers.held.drop(msg.consumer_id)
            router.reply(envelope, internal_error(router, msg, e))

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """Buffer metrics plus the service's: rejects, throughput, time paused.

        Call it from the loop's thread (requests do) or after the service stopped.
        """
        out = self.buffer.metrics() | self.stats.metrics(time.monotonic())
        out["buffer/pending_requests"] = float(len(self._answers.held))
        out["buffer/superseded_requests"] = float(self._answers.incarnations.refused)
        out.setdefault("buffer/request_errors", 0.0)  # from stats.io once one raised
        if self.rollout_log is not None:
            out["buffer/rollout_log_lost"] = float(self.rollout_log.rows_lost)
        out |= {
            k.replace("security/", "buffer/security/"): v for k, v in security.metrics().items()
        }
        return out
