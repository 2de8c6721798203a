"""The rollout server: asks the coordinator for tasks, generates without pause, scores, and
streams each group to the buffer the moment it is complete.

One asyncio loop owns the vLLM engine. Everything that blocks runs off the loop, each kind
in its own threads (:mod:`rollout_servers.lanes`: a sync start never queues behind tool
calls or scoring): the coordinator client's calls, scoring (in worker processes of a
:class:`~asyncrl.rewards.RewardPool`) and pushing. The client's heartbeat thread keeps the
server alive in the coordinator's eyes and delivers sync starts and the shutdown. With
``rollout.openai_endpoint.enable`` the same loop also serves outside agents
(:mod:`rollout_servers.openai_api`).

This module owns the loops and a task's lifecycle (slots, push, acknowledgement, failure
report); how a task's group is generated and scored is :mod:`rollout_servers.task_groups`,
and the server's side of the learner's weight pushes :mod:`rollout_servers.server_syncs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from asyncrl.config import Config, run_dir
from asyncrl.control.client import CoordinatorGone
from asyncrl.control.messages import Task, TaskGrant
from asyncrl.launch import startup
from asyncrl.launch.restart_policy import CONFIG_ERROR
from asyncrl.net.transport import RequestRefused
from asyncrl.sandbox.workers import PoolBroken
from asyncrl.wire.base import WireError
from rollout_servers.agent import AgentRunner
from rollout_servers.deadlines import REACH_S
from rollout_servers.groups import (
    PromptTooLong,
    SamplingSettings,
    filtered_out,
    unknown_filter_metric,
)
from rollout_servers.lanes import Lanes
from rollout_servers.openai_api import OpenAIEndpoint
from rollout_servers.protocols import (
    ControlClient,
    GenerationEngine,
    GroupPusher,
    Scorer,
    Tokenizer,
)
from rollout_servers.server_stats import ServerStats
from rollout_servers.server_syncs import WeightSyncs
from rollout_servers.task_groups import TaskGroups

log = logging.getLogger(__name__)

#: How often the task loop reports metrics (they ride on the next heartbeat) and, while
#: its slots are full, looks at the stop flags the heartbeat thread sets.
REPORT_EVERY_S = 1.0
#: How often the task loop logs a progress line.
LOG_EVERY_S = 30.0
#: How long a server waits before it sends again the acknowledgement of a group it dropped
#: (filtered) that the coordinator did not answer (each send already tries three times).
ACK_AGAIN_S = 5.0


class RolloutServer:
    """One rollout server: an engine, a coordinator client, a reward pool, a pusher (what
    it needs of each: :mod:`rollout_servers.protocols`)."""

    def __init__(
        self,
        cfg: Config,
        server_id: str,
        engine: GenerationEngine,
        tokenizer: Tokenizer,
        pool: Scorer,
        pusher: GroupPusher,
        client: ControlClient,
        seeded: bool = True,
        agent: AgentRunner | None = None,
        endpoint: OpenAIEndpoint | None = None,
    ) -> None:
        self.cfg = cfg
        self.server_id = server_id
        self.engine = engine
        self.pusher = pusher
        self.client = client
        self.stats = ServerStats(tokenizer)
        self.metrics = self.stats.metrics  # the counters the loops below add to
        self.lanes = Lanes(scoring_threads=cfg.reward.num_workers)
        self.agent = agent  # runs tool_agent tasks as multi-turn episodes (None: single turn)
        settings = SamplingSettings.from_config(cfg, seeded=seeded)
        self.task_groups = TaskGroups(
            cfg, server_id, engine, tokenizer, pool, self.lanes, settings, self.stats, agent
        )
        self.max_inflight = cfg.rollout.max_inflight
        # False: only the OpenAI endpoint's agents generate here (no dataset tasks).
        self.take_tasks = endpoint is None or cfg.rollout.openai_endpoint.take_tasks
        self.inflight = 0  # sampled responses being generated now
        # Set when responses finish (their slots are free again) or stop() is called.
        self._slots_freed = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.held: dict[str, Task] = {}  # tasks being generated, by id
        self.endpoint = endpoint  # serves outside agents (None: rollout.openai_endpoint off)
        if endpoint is not None:
            endpoint.groups.join_server(self.stats.count_group, self.lanes)
        client.held_tasks = self._held_ids  # said at (re-)registration
        probe = cfg.trainer.health.probe
        self.syncs = WeightSyncs(
            engine, client, self.lanes, self.metrics, probe, self._check_engine
        )
        # Why this server cannot go on (its engine died, its reward or tool workers cannot
        # be replaced): it exits 4, to be restarted.
        self.fatal = ""
        # Why this server can never serve this run (its task requests fail: another config
        # or version than the learner's): it exits 2, not restarted.
        self.config_error = ""

    # ----------------------------------------------------------------- main loop
    async def run(self) -> int:
        """Consumes task grants and sync starts; produces pushed groups and
        acknowledgements. Waits in the coordinator's task long-poll (at most
        ``control.heartbeat_s``) when the admission budget is closed, and for free
        in-flight slots. Unblocked by grants, finished groups, syncs, :meth:`stop`, shutdown
        or the coordinator going away.
        Returns 0 at shutdown, 3 if the coordinator is gone (silent), 4 on a fatal error
        here or a coordinator that answered but refused it (restarted: not a hung learner),
        2 if its task requests fail (a grant it cannot read, a refusal: another config or
        version)."""
        # Marked at each registration, the first and those with a restarted learner's
        # coordinator: the launcher tells a learner hung since this server registered
        # with it from one restarted since (supervise.py, _learner_hung).
        self.client.on_registered = lambda reply: startup.mark(
            run_dir(self.cfg), self.server_id, "registered"
        )
        try:
            reg = await self.lanes.control(self.client.register)
        except CoordinatorGone as e:
            if self.client.shutdown.is_set():  # stopped while it waited: not a fault
                log.info("%s stopped while registering", self.server_id)
                return 0
            log.error("%s; check endpoints.host/endpoints.control and that the learner is up", e)
            return 3
        except RequestRefused as e:  # another config than the learner's: a restart cannot help
            log.error(
                "%s cannot serve this run: %s; start it with the learner's config",
                self.server_id,
                e,
            )
            return CONFIG_ERROR
        self.client.start_watching()
        log.info("%s registered at version %d", self.server_id, reg.policy_version)
        syncs = asyncio.create_task(self.syncs.loop(self._stopping))
        syncs.add_done_callback(self._syncs_ended)
        try:
            if self.endpoint is not None:
                await self.endpoint.start()
            await self._task_loop()
        finally:
            syncs.cancel()
            if self.endpoint is not None:
                await self.endpoint.stop()
            for t in list(self.tasks):
                t.cancel()
            self.lanes.close()
        if self.config_error:
            log.error("%s stops: %s", self.server_id, self.config_error)
            return CONFIG_ERROR
        if self.client.gone.is_set() and self.client.refused:  # answered: not a hung learner
            self.fatal = self.fatal or f"the coordinator answered, but {self.client.refused}"
        if self.fatal:
            log.error("%s stops: %s (its supervisor restarts it)", self.server_id, self.fatal)
            return 4
        return 3 if self.client.gone.is_set() else 0

    def _syncs_ended(self, task: asyncio.Task) -> None:
        """The sync loop ended: at the server's stop, or failed. Failed, the server would
        generate on with weights no sync would load again (and, held for a catch-up,
        never be dealt a task), so it stops, to be restarted."""
        if task.cancelled() or (e := task.exception()) is None:
            return
        self.fatal = self.fatal or f"its weight-sync loop failed ({type(e).__name__}: {e})"
        self._slots_freed.set()  # a task loop waiting for slots sees it now

    def _held_ids(self) -> list[str]:
        ext = self.endpoint.task_ids() if self.endpoint is not None else []
        return list(self.held) + ext

    def _stopping(self) -> bool:
        c = self.client
        if not self.fatal and self.engine.errored:  # died while idle (a server held back
            # for a catch-up would never notice), or a worker is stuck in a sync call
            self.fatal = self.engine.stuck or "the vLLM engine died"
        return c.shutdown.is_set() or c.gone.is_set() or bool(self.fatal)

    def _check_engine(
        self, error: BaseException, was_partial: bool = False, catchup: bool = False
    ) -> None:
        """After a failure: is the engine itself dead (then nothing more can be done here)?
        Weights partly loaded by a broken-off sync hold generation until a catch-up loads
        them whole (one member's death mid-push does not restart every server); a catch-up
        (``catchup``) that fails on them too ends the server (``was_partial``: they were
        partial before). A main round that fails on them does not: the catch-up follows."""
        if self.engine.errored:  # dead, or a worker stuck in a call (RolloutEngine.stuck)
            self.fatal = self.fatal or f"the vLLM engine died ({type(error).__name__}: {error})"
        elif was_partial and catchup and self.engine.partial:
            self.fatal = f"its weights stay partly loaded after a failed catch-up ({error})"

    async def _task_loop(self) -> None:
        """Keeps up to ``rollout.max_inflight`` responses generating: asks for tasks ahead
        of need, never more than the free slots hold.

        Consumes task grants; produces generation tasks (:meth:`_run_task`), metrics
        snapshots for the heartbeat (every ``REPORT_EVERY_S``) and progress lines. Waits in
        the coordinator's task long-poll (at most ``control.heartbeat_s``) while slots are
        free, and on :attr:`_slots_freed` while fewer than a group's ``rollout.n`` are
        free. Unblocked by a grant, a group finishing (or failing), :meth:`stop`, or the
        next report; ends at shutdown, when the coordinator is gone, when the engine
        died, or when a task request fails (a grant it cannot read, a refusal: another
        config than the learner's; the server then exits 2)."""
        last_log = time.monotonic()
        last_report = 0.0
        n = max(self.cfg.rollout.n, 1)
        while not self._stopping():
            if time.monotonic() - last_report >= REPORT_EVERY_S:
                self.client.metrics = self.snapshot()
                last_report = time.monotonic()
            if time.monotonic() - last_log > LOG_EVERY_S:
                self._log_progress()
                last_log = time.monotonic()
            if self._free() < n or not self.take_tasks:
                next_report = last_report + REPORT_EVERY_S - time.monotonic()
                await self._wait_for_slots(max(next_report, 0.0))
                continue
            want = max(1, min(self.client.tasks_per_request, self._free() // n))
            grant = await self._request_grant(want)
            if grant is None:
                return
            if not grant.tasks:
                continue
            self.stats.busy()
            for task in grant.tasks:
                self.inflight += task.n
                self.stats.after_generation.slots(task.n)
                t = asyncio.create_task(self._run_task(task))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)

    async def _request_grant(self, want: int) -> TaskGrant | None:
        """Ask for up to ``want`` tasks within the free slots; None when this server must
        stop: a refusal or a grant it cannot read comes from a config or version other than
        the learner's (:attr:`config_error`: a restart would get the same), a request the
        coordinator failed on is its fault (:attr:`fatal`: restarted)."""
        try:
            # The free slots, not want * n: a validation group may be larger (its
            # val_kwargs.n), and the grant then holds fewer tasks.
            request = functools.partial(self.client.request_tasks, max_samples=self._free())
            return await self.lanes.control(request, want)
        except RequestRefused as e:
            if e.error == "internal":
                self.fatal = f"its task request failed on the coordinator ({e})"
            else:
                self.config_error = (
                    f"its task request was refused ({e}); start it with the learner's "
                    "config and asyncrl version"
                )
        except WireError as e:  # no grant is built past control.max_message_mb
            self.config_error = (
                f"its task grant could not be read ({e}); start it with the learner's "
                "config and asyncrl version"
            )
        return None

    def _free(self) -> int:
        return self.max_inflight - self.inflight

    async def _wait_for_slots(self, timeout_s: float) -> None:
        """Wait until responses finish or :meth:`stop` is called, at most ``timeout_s``: a
        shutdown or a lost coordinator, flagged by the heartbeat thread, wakes no one."""
        self._slots_freed.clear()
        with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from 3.11 on
            await asyncio.wait_for(self._slots_freed.wait(), timeout_s)

    def _free_slots(self, n: int) -> None:
        """Give back ``n`` slots and wake the task loop if it waits for them."""
        self.inflight -= n
        self.stats.after_generation.slots(-n)
        if self.inflight == 0:
            self.stats.idle()
        self._slots_freed.set()

    def stop(self) -> None:
        """Stop taking tasks and end :meth:`run` (SIGTERM): the task loop wakes at once,
        even with its slots full. Call it on the server's event loop."""
        self.client.shutdown.set()
        self._slots_freed.set()

    async def _run_task(self, task: Task) -> None:
        """Generate ``task.n`` responses, score them, push the group, acknowledge it. A
        task that fails before its group is pushed is reported back (dealt again).

        Waits for the engine, the reward workers and the pusher (which blocks while the
        buffer does not read); its slots are given back however it ends."""
        created = time.time()
        pushed = False
        self.held[task.task_id] = task
        try:
            self.metrics["rollout/version_wait_s"] += await self.engine.reach(
                task.dealt_version, REACH_S
            )
            if self.engine.version < task.dealt_version:
                self._missed_version(task)
            group, samples, scores = await self.task_groups.make(task, created)
            metric = self.cfg.algorithm.filter_groups.metric
            if (note := unknown_filter_metric(task, scores, metric)) is not None:
                self.metrics["rollout/filter_metric_unknown"] += 1  # warned once: a config slip
                if self.metrics["rollout/filter_metric_unknown"] == 1:
                    log.warning("%s", note)
            if not group or filtered_out(task, scores, metric):
                # never pushed: the coordinator frees its budget and deals a fresh prompt
                ack = functools.partial(
                    self.client.ack,
                    filtered=True,
                    prompt_too_long=not group,
                    dealt=[task.attempt],
                    session=task.dealt_session,
                )
                # No longer held (its slots are, until the report is answered): a
                # registration meanwhile (a restarted coordinator) would name it, and the
                # new coordinator adopt it as out here after answering this report
                # "unknown", to wait for task_timeout_s on a group that is gone.
                self.held.pop(task.task_id, None)
                await self._report_dropped(ack, task.task_id)
                self.metrics["rollout/groups_filtered"] += bool(group)
                pushed = True  # reported: not a failure to deal again
                return
            with self.stats.after_generation.phase("pushing", task.n):
                self.metrics["rollout/push_wait_s"] += await self.pusher.send_async(group)
            pushed = True
            await self.lanes.control(self.client.ack, [task.task_id])
            self.stats.count_group(samples, scores, task)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one bad task must not stop the server
            self.metrics["rollout/task_errors"] += 1
            if isinstance(e, PoolBroken):
                # Every task would fail alike: exit to be restarted with fresh workers (the
                # stop's log line names the cause).
                self.fatal = self.fatal or str(e)
            elif isinstance(e, PromptTooLong):  # the message names the fix; no traceback
                log.error("task %s: %s", task.task_id, e)
            elif type(e).__name__ == "EngineDeadError" or self.client.shutdown.is_set():
                # The engine's own log has the cause (or the server is stopping, and the
                # engine went first): a traceback of the await adds nothing.
                log.error("task %s failed: %s: %s", task.task_id, type(e).__name__, e)
            else:
                log.exception("task %s failed", task.task_id)
            if not pushed:  # its group never left: the coordinator deals it again
                reason = f"{type(e).__name__}: {e}"
                nack = functools.partial(self.client.nack, session=task.dealt_session)
                await self.lanes.control(nack, [task.task_id], reason, [task.attempt])
            self._check_engine(e)
        finally:
            self.held.pop(task.task_id, None)
            self._free_slots(task.n)

    async def _report_dropped(self, ack: Callable[[list[str]], object], task_id: str) -> None:
        """Acknowledge a group dropped here (filtered, or its prompt too long), again
        :data:`ACK_AGAIN_S` after each unanswered report (itself three tries, each to the
        client's timeout) until the coordinator answers or this server stops. Nothing
        else frees its admission budget: a pushed group's lost ack heals when its group
        trains, a dropped one's only at ``control.task_timeout_s`` (30 min by default),
        and under a filter that drops most groups one stall of the coordinator held much
        of the window that long."""
        while await self.lanes.control(ack, [task_id]) is None:
            if self._stopping():
                return
            await asyncio.sleep(ACK_AGAIN_S)
            self.metrics["rollout/dropped_acks_resent"] += 1

    def _missed_version(self, task: Task) -> None:
        """``task`` starts under older weights than it was dealt for: their sync failed, or
        took over :data:`REACH_S`. The buffer's lag rule judges its group; said once in a
        while, since a server that keeps missing versions looks like a slow load otherwise."""
        self.metrics["rollout/version_wait_missed"] += 1
        missed = self.metrics["rollout/version_wait_missed"]
        if missed == 1 or missed % 50 == 0:
            log.warning(
                "task %s starts under version %d, not %d it was dealt for (the sync failed, or "
                "took over %.0fs); %d such tasks so far (rollout/version_wait_missed)",
                task.task_id,
                self.engine.version,
                task.dealt_version,
                REACH_S,
                int(missed),
            )

    # ----------------------------------------------------------------- metrics
    def snapshot(self) -> dict[str, float]:
        """Current metrics (cumulative counters and recent means)."""
        parts = [self.engine.metrics]
        parts += [p.metrics for p in (self.agent, self.endpoint) if p is not None]
        # The pause clock: the waits the stats count leave out the seconds the sync has.
        return self.stats.snapshot(parts, self.inflight, self.engine.paused_s)

    def _log_progress(self) -> None:
        m = self.snapshot()
        log.info(
            "%s: %d groups, %.0f tokens/s, %d in flight, waited %.1fs for tasks, "
            "%.1fs paused for syncs, reward %.3f",
            self.server_id,
            m["rollout/groups"],
            m["rollout/tokens_per_s"],
            m["rollout/inflight"],
            m["rollout/task_wait_s"],
            m["rollout/sync_pause_s"],
            m.get("rollout/reward_mean", float("nan")),
        )
