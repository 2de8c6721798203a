"""The coordinator service: :class:`~asyncrl.control.state.ControlState` behind two ROUTER
sockets, in a thread of learner rank 0 (or alone, in tests).

Threads:

- the *loop* (:class:`~asyncrl.control.loop.ControlLoop`) owns both sockets: it answers
  requests, holds task requests and heartbeats (long-polls) until there is something to
  say, and declares silent servers dead;
- the *buffer poller* (:func:`~asyncrl.control.loop.poll_buffer`) asks the buffer
  (``endpoints.batches``) every ``drop_poll_s`` which groups it dropped for lag or expiry
  and refunds them;
- the learner's thread calls the public methods below (versions, syncs, steps, shutdown,
  state). They hold the same lock as the loop, briefly; only :meth:`Coordinator.finish_sync`
  and :meth:`Coordinator.shutdown` wait, each with a timeout.

The learner's side of a sync::

    rnd = coord.begin_sync(plan)                    # announces SyncStart to the members
    if rnd.ranks:
        if rnd.new_group:
            group = form_group(store, rnd.generation, 0, rnd.world_size, ...)
        send_weights(group, ..., abandon=rnd.watch.lost_in_send)  # error: finish_sync(rnd, False)
        coord.weights_sent(rnd)                      # staleness.deal_at_send: the window moves
    result = coord.finish_sync(rnd)                  # waits for every member's sync_done
    for server_id in coord.pending_catchups():       # late joiners, failed members
        rnd = coord.begin_catchup(server_id, plan)   # None: it left meanwhile
        ...

Catch-ups send the learner's current weights labelled with the current version: service
them right after a push (before the next optimizer step), or push a new version instead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from asyncrl.control.loop import ControlLoop, poll_buffer
from asyncrl.control.state import ControlState, ValidationProgress
from asyncrl.control.syncs import SyncResult, SyncRound
from asyncrl.net import security
from asyncrl.sync.plan import WeightPlan

log = logging.getLogger(__name__)

LEAVE_GRACE_S = 2.0  # at shutdown, how long told servers get to say they leave
#: After a failed send, the round's close waits this long for reports, seconds: a member
#: with every bucket loads, resumes and reports after its probe (at most 10 s on a server).
AFTER_FAILED_SEND_S = 30.0


class Coordinator:
    """Serves one :class:`ControlState`; :meth:`start` runs it in a thread."""

    def __init__(
        self,
        state: ControlState,
        *,
        tasks_addr: str,
        control_addr: str,
        buffer_addr: str | None = None,
        max_grant: int = 4,
        drop_poll_s: float = 1.0,
        max_message_bytes: int = 0,
    ):
        self._state = state
        self.buffer_addr = buffer_addr
        self.max_grant = max_grant
        self.drop_poll_s = drop_poll_s
        self.max_message_bytes = max_message_bytes
        self.shutdown_requested = threading.Event()  # set by a peer's or our own shutdown
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._stop_polling = threading.Event()  # the buffer poller's: set before the buffer stops
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._loop = ControlLoop(
            state,
            self._cond,
            tasks_addr=tasks_addr,
            control_addr=control_addr,
            max_grant=max_grant,
            on_shutdown_request=self._on_shutdown_request,
            max_message_bytes=max_message_bytes,
        )
        self._shutdown_lock = threading.Lock()
        self._all_told = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 10.0) -> Coordinator:
        """Bind and serve in background threads; returns once both sockets are bound."""
        with self._lock:
            self._state.start_run()
            if self.buffer_addr is None:  # nobody to ask for an inventory
                self._state.recovery.needs_inventory = False
        loop = threading.Thread(target=self._run_quietly, name="coordinator", daemon=True)
        self._threads.append(loop)
        loop.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"coordinator did not bind within {timeout_s}s")
        if self._error is not None:
            raise RuntimeError(f"coordinator failed to start: {self._error}") from self._error
        if self.buffer_addr is not None:
            args = (self.buffer_addr, self._state, self._lock, self._stop_polling, self.drop_poll_s)
            poller = threading.Thread(
                target=poll_buffer,
                args=args,
                kwargs={"max_request_bytes": self.max_message_bytes},
                name="coordinator-drops",
            )
            poller.daemon = True
            self._threads.append(poller)
            poller.start()
        return self

    def _run_quietly(self) -> None:
        try:
            self._loop.run(self._stop, self._ready)
        except BaseException as e:  # reported by start(), or logged when it happens later
            self._error = e
            self._ready.set()
            self._stop.set()
            log.exception("coordinator crashed")

    def _on_shutdown_request(self, reason: str) -> None:
        """A peer asked to end the run: shut down from a thread (this is the loop's)."""
        log.info("shutdown requested: %s", reason)
        self.shutdown_requested.set()
        threading.Thread(target=self.shutdown, args=(reason,), daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving without telling anyone (a crash, as peers see it; tests use it)."""
        self._stop_polling.set()
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def failure(self) -> BaseException | None:
        """Why the coordinator's loop ended on its own (None while it serves, or after
        :meth:`stop`): a learner waiting for batches must not wait for good."""
        return self._error

    @property
    def running(self) -> bool:
        return self._ready.is_set() and not self._stop.is_set()

    @property
    def tasks_addr(self) -> str:
        """The task socket's endpoint (the bound one once started)."""
        return self._loop.tasks_addr

    @property
    def control_addr(self) -> str:
        return self._loop.control_addr

    # ------------------------------------------------------------------ learner API
    @property
    def sync_secret(self) -> str:
        """This session's secret part of the sync groups' store prefix (fixed per session)."""
        return self._state.sync_secret

    @property
    def version(self) -> int:
        with self._lock:
            return self._state.version

    def begin_sync(self, plan: WeightPlan) -> SyncRound:
        """Start pushing the next version (``version + 1``) with bucket plan ``plan``."""
        with self._lock:
            rnd = self._state.versions.begin_sync(plan, time.monotonic())
        log.info(
            "sync %d: version %d to %s (generation %s%s)",
            rnd.sync_id,
            rnd.version,
            rnd.members or "nobody",
            rnd.generation,
            ", new group" if rnd.new_group else "",
        )
        return rnd

    def pending_catchups(self) -> list[str]:
        """Servers that need the current weights before their next task."""
        with self._lock:
            return self._state.versions.pending_catchups(time.monotonic())

    def begin_catchup(self, server_id: str, plan: WeightPlan) -> SyncRound | None:
        """Start a one-off sync of the current version to ``server_id``; None when it no
        longer waits for one. Catch-ups run one at a time, each for up to
        ``sync.timeout_s``: a server listed before the one ahead of it began may have left
        (reaped, silent, stopped) or been caught up since."""
        with self._lock:
            if not self._state.versions.catchup_due(server_id, time.monotonic()):
                log.info("catch-up of %s skipped: it left or was caught up meanwhile", server_id)
                return None
            rnd = self._state.versions.begin_catchup(server_id, plan)
        log.info("catch-up %d: version %d to %s", rnd.sync_id, rnd.version, server_id)
        return rnd

    def weights_sent(self, rnd: SyncRound) -> None:
        """``rnd``'s weights were broadcast without error: a main round opens the admission
        window now, before the members' reports (held task requests are granted at the
        loop's next pass; their servers wait for the new weights before generating)."""
        with self._cond:
            self._state.versions.weights_sent(rnd)

    def finish_sync(
        self, rnd: SyncRound, sent_ok: bool = True, error: str = "", timeout_s: float | None = None
    ) -> SyncResult:
        """Wait for every member's ``sync_done`` (up to ``timeout_s``, default ``sync.timeout_s``;
        :data:`AFTER_FAILED_SEND_S` after a failed send), then close the round: members that
        failed or stayed silent are dropped from the group and will need a catch-up; a main
        round's version is current."""
        timeout_s = self._state.syncs.timeout_s if timeout_s is None else timeout_s
        timeout_s = timeout_s if sent_ok else min(timeout_s, AFTER_FAILED_SEND_S)
        start = time.monotonic()
        with self._cond:
            self._cond.wait_for(
                lambda: not self._state.syncs.waiting_for() or self._stop.is_set(), timeout_s
            )
            result = self._state.versions.finish_sync(sent_ok, error, now=time.monotonic())
        waited = time.monotonic() - start
        level = logging.WARNING if result.failed else logging.INFO
        log.log(
            level,
            "sync %d (version %d) done in %.2fs after the send: ok %s, failed %s",
            rnd.sync_id,
            result.version,
            waited,
            result.ok,
            result.failed,
        )
        return result

    def at_least(self, version: int) -> None:
        """A learner without a checkpoint: its versions go on above ``version``."""
        with self._lock:
            self._state.versions.at_least(version)

    def set_replay(self, through: int, session: str = "") -> None:
        """After a learner restart: its replay of the redelivered batches reaches version
        ``through`` (servers holding versions up to it keep their weights), batches the
        buffer of ``session`` (its welcome's) redelivers."""
        with self._lock:
            self._state.versions.set_replay(through)
            self._state.recovery.replay_session = session

    def adopt(self, version: int) -> bool:
        """The learner replayed its way to ``version``: make it current without a push.
        False when no replay reproduces it (push it instead)."""
        with self._lock:
            return self._state.versions.adopt(version)

    def already_trained(self, task_ids: list[str]) -> set[str]:
        """Those of ``task_ids`` this learner line has trained on already."""
        with self._lock:
            return self._state.ledger.already_trained(task_ids)

    def training(self, task_ids: list[str]) -> None:
        """The learner took a batch of these tasks' groups to train (a buffer restart
        meanwhile does not count them lost)."""
        with self._lock:
            self._state.training(task_ids)

    def in_training(self) -> set[str]:
        """The task ids of the batch the learner trains now (named by :meth:`training`)."""
        with self._lock:
            return set(self._state.in_training)

    def trained(self, task_ids: list[str]) -> None:
        """The learner trained on the groups of these tasks (call before the push that
        follows: the admission window moves by what the pushed weights consumed)."""
        with self._lock:
            self._state.trained(task_ids)

    def accounting(self) -> dict[str, float]:
        """``accounting/<kind>/...``: every task dealt, and where it is now."""
        with self._lock:
            return self._state.ledger.accounting()

    def on_step(self, step: int, weights_step: int | None = None) -> None:
        """The learner finished ``step`` (starts validation rounds per ``test_freq``; the
        servers hold the weights of ``weights_step``, default ``step``)."""
        with self._lock:
            self._state.on_step(step, weights_step)

    def servers(self) -> dict[str, dict[str, Any]]:
        """A snapshot of the registry: per server its version, engine size, tasks held and
        the metrics of its last heartbeat."""
        with self._lock:
            owned = self._state.ledger.owned
            return {
                sid: {
                    "policy_version": r.policy_version,
                    "engine_world_size": r.engine_world_size,
                    "outstanding": sorted(owned.get(sid, ())),
                    "address": r.address,
                    "metrics": dict(r.metrics),
                }
                for sid, r in self._state.servers.items()
            }

    def start_validation(self, step: int) -> bool:
        """Start a validation round now (the end of training), unless one started at this
        step already. True when a round was started."""
        with self._lock:
            return self._state.start_validation(step)

    def training_left(self) -> int | None:
        """None while the dataset has training tasks to deal; then how many training groups
        may still reach the learner (fewer than a batch: training cannot go on)."""
        with self._lock:
            return self._state.training_left()

    def validation_progress(self) -> ValidationProgress:
        """How many validation rounds were started, and how many groups make a round."""
        with self._lock:
            return self._state.validation_progress()

    def validation_generating(self) -> bool:
        """Whether the servers are generating a validation round (dealt or to deal)."""
        with self._lock:
            return self._state.validation_generating()

    def round_states(self, keys: list[str]) -> dict[str, dict[str, str]]:
        """The validation rounds ``keys``: each id's task state (``done``, ``given_up``, ...)."""
        with self._lock:
            return self._state.round_states(keys)

    def rescore(self, task_ids: list[str]) -> int:
        """Deal again these scored validation groups, whose sums the learner never read."""
        with self._lock:
            return self._state.rescore(task_ids)

    def server_metrics(self) -> dict[str, dict[str, float]]:
        """Each registered server's metrics from its last heartbeat (``rollout/...``)."""
        with self._lock:
            return {sid: dict(r.metrics) for sid, r in self._state.servers.items()}

    def server_totals(self) -> dict[str, float]:
        """The servers' counters summed over the run: every process of every server id,
        live or gone (:mod:`~asyncrl.control.server_totals`)."""
        with self._lock:
            return self._state.server_totals.totals()

    def state_dict(self) -> dict[str, Any]:
        """Cursor, budget, owed tasks, sync counter: save it with the learner's checkpoint."""
        with self._lock:
            return self._state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state; call before :meth:`start`."""
        if self._threads:
            raise RuntimeError("load_state_dict must come before start()")
        self._state.load_state_dict(state)

    def set_admission_lag(self, lag: int) -> None:
        """Admit training tasks up to ``lag`` versions ahead of what the learner consumed
        from now on (the adaptive staleness controller); a narrower lag deals nothing new
        until consumption catches up, and nothing dealt is taken back."""
        with self._lock:
            self._state.ledger.budget.max_policy_lag = lag

    def metrics(self) -> dict[str, float]:
        """Every ``coordinator/...`` metric: budget, tasks, servers, syncs, waits."""
        with self._lock:
            return self._state.metrics() | self._loop.metrics() | security.metrics()

    def shutdown(self, reason: str = "training done", wait_s: float = 10.0) -> bool:
        """End the run: tell every registered server, then the buffer, then stop serving.

        Waits up to ``wait_s`` for every server to be told (its held heartbeat is answered
        at once) and then, briefly, for them to leave; returns True when all were told.
        Safe to call more than once and from any thread.
        """
        with self._shutdown_lock:
            if self._stop.is_set():
                return self._all_told
            self.shutdown_requested.set()
            deadline = time.monotonic() + wait_s
            with self._cond:
                self._state.begin_shutdown(reason)
                log.info("shutdown (%s): telling %d servers", reason, len(self._state.servers))
                self._all_told = self._cond.wait_for(self._state.all_told, wait_s)
                # Told servers leave at once; their Leave should still get its reply.
                grace = min(LEAVE_GRACE_S, max(0.0, deadline - time.monotonic()))
                self._cond.wait_for(lambda: not self._state.servers, grace)
                untold = [s for s, r in self._state.servers.items() if not r.told_shutdown]
            if untold:
                log.warning("shutdown: %s could not be told within %gs", untold, wait_s)
            self._stop_polling.set()  # it would only find the buffer gone
            self._shutdown_buffer(max(1.0, deadline - time.monotonic()))
            self.stop()
            return self._all_told

    def _shutdown_buffer(self, timeout_s: float) -> None:
        if self.buffer_addr is None:
            return
        from asyncrl.net.buffer_client import BufferClient

        client = BufferClient(self.buffer_addr, "coordinator", timeout_s=min(timeout_s, 5.0))
        try:
            client.shutdown()
            log.info("shutdown: buffer at %s told", self.buffer_addr)
        except (TimeoutError, RuntimeError, ValueError) as e:
            log.warning("shutdown: buffer at %s did not answer (%s)", self.buffer_addr, e)
        finally:
            client.close()
