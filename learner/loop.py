"""The learner's service loop: batches in, training steps, weight pushes, checkpoints.

Rank 0 hosts the control plane (:mod:`learner.control_plane`: the coordinator, the weight
pusher, the buffer client, the metrics logger); the other ranks hold a no-op stand-in for
it, so this loop reads the same on every rank. Every rank trains on the same global batch
(rank 0 receives it from the buffer and broadcasts it to the others).

Per step: request a batch for the current policy version (waiting, visibly, while the
buffer has none) -> train -> every ``staleness.sync_every`` steps gather the full weights
and push them as the next version (after a restart, not the versions its replay of the
redelivered batches reproduces: the servers hold them) -> every ``trainer.save_freq`` steps checkpoint, then
acknowledge the batches the checkpoint contains (with ``save_freq <= 0``, no intermediate
checkpoint: each batch is acknowledged once trained). At the end: final checkpoint, an HF export
that vLLM loads, and the coordinator ends the run (servers and buffer exit). When the data
is spent (every epoch dealt, fewer than a batch of groups left) training ends early there.
Each step's metrics pass the health alarms (:mod:`learner.health`); with
``trainer.health.action: stop`` the first alarm ends the run with a checkpoint but no
export or final validation, and the learner exits 5 (the launcher does not restart it).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from asyncrl.config import Config
from asyncrl.config import run_dir as run_dir_of
from asyncrl.config.ending import (
    complete_line,
    data_spent_at,
    ended_whole,
)
from asyncrl.config.inputs import total_training_steps
from asyncrl.config.resumed import settings_of
from asyncrl.control.admission import push_due
from asyncrl.launch import startup
from asyncrl.launch.restart_policy import CONFIG_ERROR, HEALTH_STOP
from asyncrl.net.buffer_client import Superseded
from learner import fsdp, lora
from learner.control_peer import BatchRef, ControlPeer, EndedAlone, NoControl
from learner.control_plane import RankZero
from learner.export import exported_step
from learner.health import Alarm, HealthMonitor, learner_probe
from learner.metrics import reward_part_metrics
from learner.restore import clear_the_way, restore
from learner.rollouts import Rollout

ENDED_PROBE_S = 10.0  # how long a learner of an ended run asks for a buffer to tell

log = logging.getLogger(__name__)


def to_rollouts(batch: Any) -> list[Rollout]:
    """Wire trajectories of a buffer batch -> the trainer's rollouts (grouped by task id),
    each with the temperature it was sampled at when its server said (NaN behaviour
    logprobs, positions vLLM did not report, stay NaN: the loss drops and counts them;
    multi-turn samples bring their loss mask and episode)."""
    return [
        Rollout(
            prompt_ids=t.prompt_ids.tolist(),
            response_ids=t.response_ids.tolist(),
            behaviour_logprobs=t.logprobs.tolist(),
            reward=t.meta.reward,
            group_id=t.meta.task_id,
            version_spans=[tuple(s) for s in t.meta.version_spans],
            temperature=t.meta.temperature,
            loss_mask=t.loss_mask().tolist() if t.meta.masked_spans else None,
            episode=t.meta.episode,
        )
        for t in batch.trajectories
    ]


class LearnerLoop:
    """See the module docstring; ``run()`` returns the process exit code.

    Construction loads the model, restores the latest checkpoint (``trainer.resume_mode``)
    and, on rank 0, starts the control plane from the checkpoint's state."""

    def __init__(self, cfg: Config):
        from learner.trainer import Trainer

        self.cfg = cfg
        self._marked: set[str] = set()  # start-up phases already marked
        self.run_dir = run_dir_of(cfg)
        self.total = total_training_steps(cfg)
        # Before the model loads: a start that dies while it loads is restarted under
        # auto, which must find this start's checkpoint (torchrun's RANK: no group yet).
        cleared = clear_the_way(cfg, self.run_dir, int(os.environ.get("RANK", "0")))
        self.trainer = Trainer(cfg, total_steps=self.total)
        start = restore(cfg, self.trainer, self.run_dir, cleared)
        self.restored = start.restored
        self.new_run = start.new_run  # whether this start begins a new run here
        self._mark("model_ready")
        self.control: ControlPeer = self._control_plane()
        self._mark("coordinator_up")
        self.last_batch_id = self.restored.last_batch_id
        self.last_batch_session = self.restored.last_batch_session
        self.unacked: list[BatchRef] = []  # batches trained on since the last checkpoint
        self.health = HealthMonitor(cfg.trainer.health)
        self.health.load_state_dict(start.health)
        self.stopped_by: Alarm | None = None  # the alarm that ended the run (action: stop)

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Consumes batches; produces steps, pushes, checkpoints and metrics. Waits for
        batches (reported every 30 s while it lasts) and for sync reports (bounded by
        ``sync.timeout_s``). Unblocked by the buffer releasing a batch."""
        if self.trainer.step >= self.total or self._ended():
            return self._complete_already()
        try:
            # What a server that does not hold these weights catches up to before the first
            # push: one older than the checkpoint, or, after a restart without one, a
            # server that outlived the previous learner with weights nobody has any more.
            self.control.resume(self.trainer.full_state_for_push())
            # The coordinator may have gone on above the checkpoint's version (servers and
            # a buffer that outlived a learner with no checkpoint): count from there, or
            # lags read negative and a checkpoint before the first push saves a version
            # below the coordinator's.
            version = self.control.version(self.trainer.policy_version)
            self.trainer.policy_version = _broadcast_int(version, self.trainer)
            started = self.trainer.step
            with startup.startup_heap_frozen():
                while self.trainer.step < self.total and self._one_step():
                    pass
            # A run its health alarms stopped saves its checkpoint only: its weights are
            # the ones that alarmed, and an export would replace the final/ of an earlier
            # end (an extended run's) with them. Its ending comes when a launch resumes it.
            done = self.stopped_by is None
            if done:
                self._push_final(started)
            self._save(final=done)
        except Superseded as e:  # another learner said hello under this run's consumer id
            return self._superseded(e)
        except Exception:
            # A failure (out of memory, a failed push or save) is restarted by the launcher
            # from the last checkpoint: the peers stay up for the next learner, as after a
            # crash. Ending the run here would stop them for good (they exit 0).
            self.control.abandon()
            raise
        except BaseException:  # Ctrl-C of a learner started by hand: the run ends now,
            # without the validation rounds in flight (nobody reads their scores)
            self.control.finish(self.trainer.step, validate=False, wait_rounds=False)
            raise
        try:
            self._finish(validate=done, complete=done)
        except Superseded as e:  # its last acknowledgement refused: another took over
            return self._superseded(e)
        if self.stopped_by is not None:
            log.error(
                "the run stopped at step %d on %s (trainer.health.action=stop); its "
                "checkpoint is saved: fix the cause, then launch again to resume",
                self.trainer.step,
                self.stopped_by.metric,
            )
            return HEALTH_STOP
        return 0

    def _push_final(self, started: int) -> None:
        """The data ran out after a step that did not push (``staleness.sync_every`` > 1):
        push its weights, so that the final validation round measures the policy the run
        ends with and exports (``started``: the step this learner started at; a learner
        that trained nothing pushes nothing). A collective: every rank gathers. Its metrics
        (the previous push's results among them, which no later push collects) are a
        record of their own at that step."""
        t = self.trainer
        if t.step > started and not push_due(t.step, self.cfg.staleness.sync_every, self.total):
            log.info("data spent after step %d: its weights are pushed for the final round", t.step)
            self.control.log_step(t.step, self._push(), t.policy_version)

    def _superseded(self, e: Superseded) -> int:
        """Another learner said hello under this run's consumer id: end without a restart
        (restarted, this one would take the batches back, and both would train them)."""
        self.control.abandon()
        log.error("%s: this learner ends without a restart (exit %d)", e, CONFIG_ERROR)
        return CONFIG_ERROR

    def _control_plane(self) -> ControlPeer:
        """Rank 0's control plane; a no-op stand-in on the other ranks. A run whose ending
        is done needs it only to tell the peers started for it that there is nothing to
        do: with no buffer answering (a learner killed after telling them left no one),
        there is no one to tell, and no buffer to wait for."""
        ended = self._ended()  # a collective: every rank asks
        if self.trainer.rank != 0:
            return NoControl()
        if ended and not _buffer_answers(self.cfg, ENDED_PROBE_S):
            log.info(
                "no buffer answered within %gs: no peer to tell the run is over", ENDED_PROBE_S
            )
            return EndedAlone(self.cfg)
        return RankZero(self.cfg, self.run_dir, self.restored, new_run=self.new_run)

    def _ended(self) -> bool:
        """Whether the restored checkpoint is where the run ended whole, with nothing left
        to train (:func:`ended_whole`: its last step, or its data spent at as many epochs
        as asked now); rank 0's view, on every rank."""
        t = self.trainer
        return bool(_broadcast_int(int(ended_whole(self.cfg, self.run_dir, t.step)), t))

    def _complete_already(self) -> int:
        """A finished run started again resumes its final checkpoint (``auto``). When its
        ending was done (:func:`ended_at`: export, final validation), it says so and ends
        the run at once, without waiting on the rounds its checkpoint held (reported before
        it ended). A run cut short in its ending (the learner, or the whole launch, killed
        after the final checkpoint) gets what it missed: the export if ``final/`` is
        missing, and the final validation, with the servers caught up to these weights."""
        t = self.trainer
        ended = self._ended()
        if ended:
            log.warning("%s", complete_line(t.step, self.total, data_spent_at(self.run_dir)))
        else:
            log.warning(
                "the run's last checkpoint is its final step %d, but its ending was cut "
                "short: finishing it (export if missing, final validation)",
                t.step,
            )
        self._export(only_missing=True)
        if not ended:
            self.control.resume(t.full_state_for_push())  # what servers catch up to
        self._finish(validate=not ended, wait_rounds=not ended, complete=True)
        return 0

    def _finish(self, **how: bool) -> None:
        """Rank 0 ends the run (:meth:`ControlPeer.finish` ``**how``); every other rank
        waits until it has (:func:`learner.broadcast.hold_ranks`), even when it fails."""
        from learner.broadcast import hold_ranks, share_waiting

        t = self.trainer
        try:
            self.control.finish(t.step, keepalive=lambda: share_waiting(t.world_size), **how)
        finally:
            hold_ranks(t.rank, t.world_size)

    def _one_step(self) -> bool:
        """One learner step; False when the data is spent and no batch will come."""
        c, t = self.cfg, self.trainer
        start = time.monotonic()
        batch = self._next_batch()
        if batch is None:
            return False
        waited = time.monotonic() - start
        self._mark("first_batch")
        rollouts = to_rollouts(batch)
        # Lag counts pushes: with sync_every > 1 a batch at lag 0 is this many updates
        # behind the weights it trains (a push follows every sync_every-th step).
        since_push = t.step % c.staleness.sync_every
        metrics = t.train_step(rollouts, c.rollout.temperature)  # advances t.step
        metrics["lag/steps_since_push"] = float(since_push)
        self._mark("first_step")
        metrics.update(batch.metrics)  # the buffer's own counters (buffer/...)
        parts = [tr.meta.reward_parts for tr in batch.trajectories]
        metrics.update(reward_part_metrics(parts, rollouts, t.max_len))
        self._account(batch, rollouts)
        metrics["timing/wait_batch_s"] = waited
        metrics["timing/step_s"] = time.monotonic() - start
        metrics["timing/wait_fraction"] = waited / max(metrics["timing/step_s"], 1e-9)
        metrics.update(startup.collector_metrics("learner"))
        if push_due(t.step, c.staleness.sync_every, self.total):
            metrics.update(self._push())
        self.control.steer_lag(t.step, metrics)  # before the save: it keeps the decision
        alarms = self.health.check(metrics)
        metrics.update(self.health.metrics())
        if t.rank == 0:
            for alarm in alarms:
                log.warning("%s", alarm.line(t.step))
        # The step's record is written before its checkpoint: a learner that dies between
        # the two trains the step again (a second record, which the readers supersede),
        # where the other order lost its record for good.
        self.control.log_step(t.step, metrics, t.policy_version)
        if c.trainer.save_freq > 0 and t.step % c.trainer.save_freq == 0 and t.step < self.total:
            self._save()
        self.control.after_step(t.step)
        stop = bool(alarms) and c.trainer.health.action == "stop"
        # Rank 0 alone sees a push's probe metrics: its decision holds for every rank.
        if _broadcast_int(int(stop), t):
            self.stopped_by = alarms[0] if alarms else Alarm("rank 0", "an alarm", 0.0, "", "")
            return False
        return True

    def _mark(self, event: str) -> None:
        """The start-up timeline (:mod:`asyncrl.launch.startup`): rank 0, each phase once."""
        if self.trainer.rank == 0 and event not in self._marked:
            self._marked.add(event)
            startup.mark(self.run_dir, "learner", event)

    # ------------------------------------------------------------------ batches
    def _next_batch(self) -> Any:
        """Rank 0 waits for the buffer's next batch and broadcasts it to the other ranks
        (None on every rank when the data is spent)."""
        from learner.broadcast import share_batch, share_waiting

        t = self.trainer
        alive = (lambda: share_waiting(t.world_size)) if t.world_size > 1 else None
        payload = self.control.wait_batch(t.policy_version, t.step, keepalive=alive)
        return share_batch(payload, t.rank, t.world_size)

    def _account(self, batch: Any, rollouts: list[Rollout]) -> None:
        """Tell the coordinator what was trained (before the push: the admission window
        moves by what the pushed weights consumed), and the buffer what it may forget."""
        batch_id = batch.batch_id
        self.last_batch_id, self.last_batch_session = batch_id, batch.session
        self.control.trained(sorted({str(r.group_id) for r in rollouts}))  # the task ids
        if self.cfg.trainer.save_freq > 0:
            self.unacked.append((batch.session, batch_id))  # acked by the checkpoint
        else:
            # No intermediate checkpoint: a restart could not resume to this batch, so the
            # buffer has no reason to keep it. Held, it would count against the buffer's
            # capacity until the buffer stopped releasing batches (the run hung). It goes
            # with the next batch request; a learner that dies first restarts without a
            # checkpoint, and the buffer takes the batch's groups back into its pool.
            self.control.acknowledge_on_next_request([(batch.session, batch_id)])

    # ------------------------------------------------------------------ pushes
    def _push(self) -> dict[str, float]:
        """Gather the full weights (every rank), push them as the next version (rank 0),
        and take the coordinator's version on every rank."""
        start = time.monotonic()
        tensors = self.trainer.full_state_for_push()
        # What the servers must score after loading these weights (the post-sync probe).
        probe = learner_probe(self.trainer) if self.cfg.trainer.health.probe else []
        target = self.trainer.policy_version + 1
        pushed = self.control.push(tensors, target, probe)
        out = {"timing/gather_s": time.monotonic() - start, **pushed}
        version = self.control.version(self.trainer.policy_version)
        self.trainer.policy_version = _broadcast_int(version, self.trainer)
        return out

    # ------------------------------------------------------------------ checkpoints
    def _save(self, final: bool = False) -> None:
        extra = {
            "last_batch_id": self.last_batch_id,
            "last_batch_session": self.last_batch_session,
            "settings": settings_of(self.cfg),  # what a resume compares its own with
            "health": self.health.state_dict(),
            **self.control.checkpoint_extra(self.trainer.step),
        }
        self.trainer.save(self.run_dir, extra=extra)
        self.control.acknowledge(self.unacked)
        self.unacked = []
        if final:
            self._export()

    def _export(self, only_missing: bool = False) -> None:
        """``final/``, an HF export that vLLM loads (with LoRA: merged), and with LoRA the
        adapter alone in peft's format (``final_adapter/``). ``only_missing``: those not
        there (a run cut short in its ending); rank 0 looks, every rank gathers."""
        t = self.trainer
        final, adapter = self.run_dir / "final", self.run_dir / "final_adapter"
        # Each export's mark, written last, names its step: one of another step (an earlier
        # run's, an abandoned branch's, one cut short) is not this run's and is made again.
        merged = not (only_missing and _broadcast_int(int(exported_step(final) == t.step), t))
        alone = bool(self.cfg.model.lora_rank) and not (
            only_missing and _broadcast_int(int(exported_step(adapter) == t.step), t)
        )
        # Every gather before rank 0 writes: the other ranks wait in the next collective,
        # and a long write (a large model, a slow disk) would outlast its timeout.
        state = (
            fsdp.full_state(t.model, keep=t.rank == 0, only=lora.is_adapter_key) if alone else None
        )
        if merged:
            self.control.export(t.export_state(), final, t.step)
        if state is not None and t.rank == 0:  # the adapter's tensors alone, in peft's format
            lora.export_adapter(state, self.cfg.model, adapter, step=t.step)


def _buffer_answers(cfg: Config, wait_s: float) -> bool:
    """Whether the run's buffer answers within ``wait_s`` (without starting a session)."""
    from asyncrl.net.buffer_client import BufferClient
    from asyncrl.net.transport import config_endpoint, mebibytes

    probe = BufferClient(
        config_endpoint(cfg.endpoints, "batches"),
        "learner-probe",
        max_message_bytes=mebibytes(cfg.control.max_message_mb),
    )
    try:
        probe.wait_ready(wait_s)
        return True
    except TimeoutError:
        return False
    finally:
        probe.close()


def _broadcast_int(value: int, trainer: Any) -> int:
    if trainer.world_size == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.broadcast(t, 0)
    return int(t.item())
