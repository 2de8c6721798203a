"""Rank 0's control plane (:class:`RankZero`): the coordinator (tasks, admission,
registration, syncs), the weight pushes (:mod:`learner.weight_push`), the buffer client, the validation
tracker and the metrics logger, behind the loop's view of them
(:class:`learner.control_peer.ControlPeer`; the other ranks get
:class:`~learner.control_peer.NoControl`).

The coordinator owns the policy version; :meth:`ControlPeer.version` reports it and the
loop copies it into the trainer (for its checkpoints and lag metrics) in one place.

What the plane sets up once as it starts (the buffer's hello, the adaptive lag controller,
the metrics logger) is :mod:`learner.control_start`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.config import Config, ConfigError
from asyncrl.config.ending import mark_ended
from asyncrl.config.inputs import total_training_steps
from asyncrl.control.admission import weights_step
from asyncrl.launch.progress import accounting_lines
from learner.broadcast import KEEPALIVE_S
from learner.control_peer import BatchRef, Restored
from learner.control_start import lag_controller, meet_buffer, open_metrics
from learner.metrics import rollout_summary
from learner.validation import ValidationTracker, never_coming
from learner.weight_push import WeightPushes

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0  # how often a long wait for a batch is reported


class RankZero:
    """Rank 0's control plane, started at construction (from a checkpoint's state when
    ``restored`` holds one): the coordinator serves servers from here on, and the buffer
    has answered (it resends the batches after ``restored.last_batch_id``). ``new_run``:
    this start begins a new run in ``run_dir`` (see
    :func:`learner.control_start.open_metrics`)."""

    def __init__(self, cfg: Config, run_dir: Path, restored: Restored, *, new_run: bool):
        from asyncrl.config import write_resolved
        from asyncrl.control.setup import coordinator_from_config, store_host, sync_backend
        from asyncrl.net.buffer_client import BufferClient
        from asyncrl.net.transport import config_endpoint, mebibytes
        from asyncrl.sync.groups import open_store
        from asyncrl.sync.sender import WeightPusher

        self.cfg = cfg
        self.run_dir = run_dir
        self.train_batch_size = cfg.data.train_batch_size
        self.validating = cfg.trainer.val_before_train or cfg.trainer.test_freq > 0
        self.final_wait_s = cfg.launch.start_timeout_s
        self.total_steps = total_training_steps(cfg)  # reads the data when it is null
        self.validation = ValidationTracker()
        if restored.validation is not None:
            self.validation.load_state_dict(restored.validation)
        self._ack_next: list[BatchRef] = []  # see acknowledge_on_next_request
        self._ack_again: list[BatchRef] = []  # acknowledgements that got no answer
        write_resolved(cfg, run_dir)
        store = open_store(
            store_host(cfg.endpoints.host),
            cfg.endpoints.sync_store,
            is_host=True,
            timeout_s=cfg.sync.timeout_s,
        )
        self.coordinator = coordinator_from_config(cfg, saved_state=restored.coordinator)
        self.lag = lag_controller(cfg, restored)  # staleness.controller: adaptive
        if self.lag is not None:
            self.coordinator.set_admission_lag(self.lag.lag)
        self.coordinator.start()
        # A validation round was in flight at the last after_step: the step that follows
        # shares the servers with it (see steer_lag). At a start, the round before training
        # or, on a resume, the one the checkpoint's step started (its tasks restored).
        self._round_in_flight = self.coordinator.validation_generating()
        pusher = WeightPusher(
            self.coordinator,
            store,
            backend=sync_backend(cfg.trainer.device),
            timeout_s=cfg.sync.timeout_s,
            bucket_bytes=int(cfg.sync.bucket_mb * 2**20),
            deal_at_send=cfg.staleness.deal_at_send,
            max_message_bytes=mebibytes(cfg.control.max_message_mb),
        )
        self.pushes = WeightPushes(cfg, self.coordinator, pusher)
        self.buffer = BufferClient(
            config_endpoint(cfg.endpoints, "batches"),
            "learner",
            max_message_bytes=mebibytes(cfg.control.max_message_mb),
        )
        meet_buffer(cfg, self.buffer, self.coordinator, restored, self.total_steps)
        self.logger = open_metrics(cfg, run_dir, new_run)
        if restored.path is not None and not new_run:
            self.logger.mark_resumed(restored.step, restored.records_lost_after(run_dir))

    # ------------------------------------------------------------------ batches
    def wait_batch(
        self, version: int, step: int, keepalive: Callable[[], None] | None = None
    ) -> Any:
        """The next batch from the buffer, or None when the data is spent (every epoch dealt
        and fewer than a batch of groups left anywhere). Consumes the buffer's releases;
        waits as long as it takes (the rollout servers may be starting), logging every 30 s
        while it lasts; serves catch-ups and validation polls meanwhile, and calls
        ``keepalive`` every :data:`KEEPALIVE_S` (the other learner ranks wait one more
        round), and sends again the acknowledgements that got no answer. Unblocked by the
        buffer releasing a batch."""
        start = last_log = last_alive = time.monotonic()
        silent_since = None
        while True:
            if self._ack_again:  # a full buffer may wait for them to release anything
                self.acknowledge([])
            try:
                # Carried acknowledgements name batches of the session of the last batch
                # received, which the request names too: the buffer checks it.
                ack = [batch_id for _, batch_id in self._ack_next]
                sent = time.monotonic()  # silent since the first unanswered send, not its timeout
                batch = self.buffer.request_batch(version, wait_s=1.0, ack=ack)
                silent_since, self._ack_next = None, []
            except TimeoutError:  # the buffer died or restarts: keep asking, say so
                batch, silent_since = None, silent_since or sent
            batch = self._untrained(batch)
            if batch is not None:
                self.coordinator.training([g.task_id for g in batch.groups])
                return batch
            left = self.coordinator.training_left()
            if left is not None and left < self.train_batch_size:
                log.warning(
                    "the training data is spent after step %d: %d groups left, fewer than "
                    "data.train_batch_size=%d (%s)",
                    step,
                    left,
                    self.train_batch_size,
                    _spent_fix(self.cfg),
                )
                return None
            self.pushes.serve_catchups()
            self._poll_validation(step)
            if (failure := self.coordinator.failure) is not None:
                raise RuntimeError(
                    f"the coordinator stopped ({type(failure).__name__}: {failure}): no task "
                    "can be dealt, so no batch will come; the learner exits (a launcher "
                    "restarts it from its last checkpoint)"
                )
            if keepalive is not None and time.monotonic() - last_alive > KEEPALIVE_S:
                keepalive()
                last_alive = time.monotonic()
            if time.monotonic() - last_log > WAIT_LOG_S:
                last_log = time.monotonic()
                silent = (
                    f"; the buffer at {self.buffer.addr} silent for {last_log - silent_since:.0f}s"
                    if silent_since
                    else ""
                )
                metrics = self.coordinator.metrics()
                log.info(
                    "waiting for a batch for %.0fs (%s)%s%s",
                    last_log - start,
                    _brief(metrics),
                    silent,
                    self._no_agents(metrics),
                )

    def _no_agents(self, metrics: dict[str, float]) -> str:
        """For a wait's log line: a run that trains only on its agents' groups, while no
        agent holds a slot, says where its agents must connect."""
        oe = self.cfg.rollout.openai_endpoint
        if not oe.enable or oe.take_tasks or metrics.get("accounting/external/in_flight"):
            return ""
        return (
            "; no agent holds an endpoint slot: this run trains only on the groups agents "
            f"open at its OpenAI endpoint (URLs in {self.run_dir / 'openai_endpoints'}); is "
            "an agent running?"
        )

    def _untrained(self, batch: Any) -> Any:
        """``batch`` without the groups these weights already trained on (None if nothing is
        left; then it is acknowledged at once). Such a group is a late copy that reached a
        buffer restarted since its first copy was trained: that buffer could not know it."""
        if batch is None or self.cfg.buffer.max_reuse > 1:  # reuse trains a group again
            return batch
        seen = self.coordinator.already_trained(batch.task_ids)
        if not seen:
            return batch
        log.warning(
            "%d groups of batch %d were trained before: left out", len(seen), batch.batch_id
        )
        groups = [g for g in batch.groups if g.task_id not in seen]
        if groups:
            return msgspec.structs.replace(batch, groups=groups)
        self.acknowledge([(batch.session, batch.batch_id)])  # nothing to train or resume to
        return None

    def trained(self, task_ids: list[str]) -> None:
        """Before the push: the admission window moves by what the pushed weights consumed."""
        self.coordinator.trained(task_ids)

    def acknowledge(self, batches: list[BatchRef]) -> None:
        """Acknowledge these batches now, with any waiting for the next request: one
        :class:`~asyncrl.wire.Ack` per buffer session (a buffer that restarted since
        ignores the earlier session's, whose ids name other batches there)."""
        by_session: dict[str, list[int]] = {}
        for session, batch_id in self._ack_again + self._ack_next + batches:
            by_session.setdefault(session, []).append(batch_id)
        self._ack_next, self._ack_again = [], []
        for session, batch_ids in by_session.items():
            try:
                self.buffer.ack(batch_ids, session=session or None)
            except TimeoutError as e:
                # Sent again until answered: a live buffer keeps unacknowledged batches, and
                # full of them it releases nothing more (a restarted one ignores them).
                log.warning("acknowledging batches %s: %s; sending them again", batch_ids, e)
                self._ack_again += [(session, b) for b in batch_ids]

    def acknowledge_on_next_request(self, batches: list[BatchRef]) -> None:
        """Acknowledge these batches with the next batch request (one round trip a step
        fewer), or with :meth:`acknowledge` or :meth:`finish`, whichever comes first."""
        self._ack_next += batches

    # ------------------------------------------------------------------ weights, versions
    def resume(self, tensors: dict[str, Any]) -> None:
        """The weights at start (restored, or initial): what a server that does not hold
        them catches up to before the first push (one older than the checkpoint, or one
        that outlived a learner restarted without a checkpoint). Not pushed: servers that
        hold newer versions hold what the replay reproduces (recovery.py). The plan of
        every push is built from them now: one the servers could not read stops the run
        here, not at its first push, as a config error (a restart would fail the same way)."""
        try:
            self.pushes.pusher.plan_for(tensors)
        except ValueError as e:  # over control.max_message_mb, or a dtype no sync carries
            raise ConfigError([str(e)]) from None
        self.pushes.pushed = tensors

    def push(
        self, tensors: dict[str, Any], target: int, probe: list[float] | None = None
    ) -> dict[str, float]:
        """Push ``tensors`` as the next version (:meth:`WeightPushes.push`)."""
        return self.pushes.push(tensors, target, probe)

    def version(self, current: int) -> int:
        """The coordinator's version: the last push (announced: it may still be in
        flight), or higher when a server registered with a higher one (its catch-up
        labelled these same weights with it)."""
        return max(self.coordinator.version, self.pushes.pushing_version)

    def checkpoint_extra(self, step: int) -> dict[str, Any]:
        self.pushes.wait()  # the coordinator's state with the pushed version current
        # A validation round due at this step starts before the state is taken: a resume
        # from this checkpoint then deals it, rather than never validating this step and
        # starting a later round under this one's ids (after_step will not start it twice).
        self.coordinator.on_step(step, self._weights_step(step))
        coordinator = self.coordinator.state_dict()
        # The buffer's scored groups, read after the coordinator's state: every validation
        # task that state holds as scored is then among the groups saved (a buffer that
        # dies with the rest would not score it again). A poll left unanswered may miss
        # some: their round is reported without them after launch.start_timeout_s.
        self._poll_validation(step)
        return {
            "coordinator": coordinator,
            "validation": self.validation.state_dict(),  # rounds reported, groups of the rest
            "lag_controller": self.lag.state_dict() if self.lag is not None else None,
            # A round reported after this (by a learner that then died) is reported again
            # by the resumed one: the records' readers drop what came after it.
            "saved_at": time.time(),
        }

    def export(self, tensors: dict[str, Any], out: Path, step: int) -> None:
        from learner.export import export_final

        export_final(self.cfg, tensors, out, step)

    # ------------------------------------------------------------------ steps, the end
    def _poll_validation(self, step: int) -> None:
        progress = self.coordinator.validation_progress()
        if not self.validation.pending(progress):
            return  # no round in flight: nothing to ask the buffer this step
        keys = self.validation.missing(progress)
        # Read before the request: an id scored by then is in the reply, unless the buffer
        # that scored it died (the coordinator drained its report before the learner read
        # its sums): then it is scored again, or its round never completes.
        states = self.coordinator.round_states(keys)
        try:
            reply = self.buffer.validation(keys)
        except TimeoutError:  # the buffer restarts: its scores are kept per round, ask later
            log.info("the buffer did not answer the validation poll; asking again later")
            return
        # The coordinator hears of scored validation groups from the buffer's own reports;
        # one this poll saw may not have reached it yet. Said here too, a group the
        # learner counted is never dealt again when the buffer dies before that report.
        self.coordinator.trained([tid for groups in reply.by_round.values() for tid in groups])
        for done in self.validation.add(reply.by_round, progress, never_coming(states)):
            self.logger.log(step, done)
        scored = {k: [t for t, st in ids.items() if st == "done"] for k, ids in states.items()}
        if lost := self.validation.lacking(scored):
            self.coordinator.rescore(lost)

    def log_step(self, step: int, metrics: dict[str, float], version: int) -> None:
        """The step's record, with the coordinator's and the servers' metrics: written
        before the step's checkpoint (a learner that dies between them trains the step
        again and writes a second record, which the readers supersede)."""
        metrics["actor/policy_version"] = version
        metrics.update(self.coordinator.metrics())
        servers = self.coordinator.server_metrics()
        metrics.update(rollout_summary(servers, self.coordinator.server_totals()))
        self.logger.log(step, metrics)

    def after_step(self, step: int) -> None:
        """After the step's checkpoint (a round due at a checkpoint step starts with the
        save, and its servers score it while the checkpoint is written): catch-ups, the
        validation round due, and the scores of the rounds in flight."""
        self.pushes.serve_catchups()
        test_freq = self.cfg.trainer.test_freq
        if test_freq > 0 and step % test_freq == 0:
            # The round is dealt at the version this step's push makes current: with
            # sync.overlap_push that push may still be in flight, and the round was dealt
            # partly before it (at the older weights) and partly after.
            self.pushes.wait()
        self.coordinator.on_step(step, self._weights_step(step))
        self._poll_validation(step)
        self._round_in_flight = self.coordinator.validation_generating()

    def _weights_step(self, step: int) -> int:
        """The step whose weights the servers hold after ``step``'s push (a validation
        round started now measures them: ``val/step``)."""
        every = self.cfg.staleness.sync_every
        return weights_step(step, every, self.total_steps)

    def steer_lag(self, step: int, metrics: dict[str, float]) -> None:
        """The adaptive controller's next admission lag (``staleness/lag_limit``), from
        the step's metrics. Called before the step's checkpoint, which then holds this
        step's decision: the step is not trained again after a resume, so a decision
        taken after the save would be lost with it."""
        if self.lag is None:
            metrics["staleness/lag_limit"] = float(self.cfg.staleness.max_policy_lag)
            return
        # A round being generated at the step's start or still now took server time that a
        # wider lag cannot give back: the controller does not widen on that step's wait. A
        # round scored but not yet read (or never complete) holds nothing.
        validating = self._round_in_flight or self.coordinator.validation_generating()
        new = self.lag.step(step, metrics, validating=validating)
        if new is not None:
            self.coordinator.set_admission_lag(new)
            log.info("admission lag %d (%s)", new, self.lag.last_reason)
        metrics["staleness/lag_limit"] = float(self.lag.lag)

    def finish(
        self,
        step: int,
        validate: bool,
        wait_rounds: bool = True,
        complete: bool = False,
        keepalive: Callable[[], None] = lambda: None,
    ) -> None:
        """Validate the final policy (when training completed and validation is on), then
        end the run for everyone. Waits for the push in flight, then (``wait_rounds``) for
        the rounds in flight while their groups come in, at most ``launch.start_timeout_s``
        without one. ``complete``: the run ended
        whole; recorded (:func:`mark_ended`) before the peers are told, so that a learner
        killed after telling them is not started again into an ending that needs them.
        ``keepalive``: called every 30 s while the rounds are waited for (the other ranks
        wait in a collective for this ending: :func:`learner.broadcast.hold_ranks`)."""
        try:
            self.pushes.wait()
        except RuntimeError as e:  # the run ends all the same: tell everyone
            log.error("%s", e)
        final_push = self.pushes.take_results()  # no later push collects them
        if validate and self.validating:
            self.coordinator.start_validation(step)
        start = time.monotonic()
        deadline, said = start + (self.final_wait_s if wait_rounds else 0.0), start
        seen = self.validation.collected()
        while time.monotonic() < deadline and self.validation.pending(
            self.coordinator.validation_progress()
        ):
            self.pushes.serve_catchups()  # a server (re)started now validates these weights
            self._poll_validation(step)
            if wait_rounds and (now := self.validation.collected()) != seen:
                # Bounded without progress, not in all: a large final round (long answers,
                # val_kwargs.n of 32) outlasts any fixed wait while its groups come in.
                seen, deadline = now, time.monotonic() + self.final_wait_s
            time.sleep(0.5)
            if time.monotonic() - said >= KEEPALIVE_S / 2:  # every 30 s: what it waits for
                said = time.monotonic()
                keepalive()
                log.info(
                    "ending: waiting %.0fs so far for validation rounds %s (at most "
                    "launch.start_timeout_s=%gs without a group scored)",
                    said - start,
                    ", ".join(self.validation.missing(self.coordinator.validation_progress())),
                    self.final_wait_s,
                )
        missing = self.validation.missing(self.coordinator.validation_progress())
        if missing and wait_rounds:
            log.warning(
                "validation rounds %s incomplete after launch.start_timeout_s=%gs without a "
                "group scored: ending without their scores (a server or the buffer lost "
                "their groups)",
                ", ".join(missing),
                self.final_wait_s,
            )
        accounting = self._settled_accounting(deadline)
        self.logger.log(step, {**final_push, **accounting})
        for line in accounting_lines([accounting]):
            log.info("%s", line)
        if complete:  # short of the total only where the data was spent
            spent = self.cfg.trainer.total_epochs if step < total_training_steps(self.cfg) else None
            mark_ended(self.run_dir, step, spent)
        self.acknowledge([])  # what waited for a next request that will not come
        self.coordinator.shutdown("training done")
        self.logger.close()
        self.buffer.close()

    def abandon(self) -> None:
        """The learner fails and will be restarted: stop serving without telling anyone,
        as a crash would (the servers and the buffer wait for the next learner; every
        batch not acknowledged comes again). Never raises: the failure is the news."""
        for close in (self.coordinator.stop, self.logger.close, self.buffer.close):
            try:
                close()
            except Exception:
                log.exception("while leaving the run to the next learner")

    def _settled_accounting(self, deadline: float) -> dict[str, float]:
        """The final accounting, once the last validation round shows as scored: the learner
        reads a round's scores from the buffer's groups, and the coordinator marks its groups
        scored on its own poll of the buffer, up to one ``drop_poll_s`` later. Waits at most
        two polls (and never past ``deadline``); a round still missing then is reported as
        it stands."""
        end = min(deadline, time.monotonic() + 2 * self.coordinator.drop_poll_s + 0.5)
        while True:
            accounting = self.coordinator.accounting()
            if not accounting.get("accounting/val/in_buffer") or time.monotonic() >= end:
                return accounting
            time.sleep(0.1)


def _spent_fix(cfg: Config) -> str:
    """What to change when the data ran out before ``trainer.total_training_steps``."""
    if cfg.trainer.total_training_steps is not None:
        return (
            "raise trainer.total_epochs, or set trainer.total_training_steps: null to stop "
            "where the data ends"
        )
    # Derived from the rows in the files: those dropped at a server never train.
    why = "rows dropped as too long (data.filter_overlong_prompts) or given up"
    if cfg.algorithm.filter_groups.enable:
        why += ", groups dropped by algorithm.filter_groups (and rows it passes over)"
    return (
        "raise trainer.total_epochs; the total derived from the data counts every row, "
        f"and {why} did not train"
    )


def _brief(metrics: dict[str, float]) -> str:
    keys = ("coordinator/budget/dealt", "coordinator/budget/limit", "coordinator/servers")
    return ", ".join(f"{k.rsplit('/', 1)[-1]}={metrics[k]:.0f}" for k in keys if k in metrics)
