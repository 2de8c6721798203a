"""The learner's service loop: batches in, training steps, weight pushes, checkpoints.

Rank 0 hosts the control plane: the coordinator (tasks, admission, registration, syncs),
the weight-sync store, and the buffer client. Every rank trains on the same global batch
(rank 0 receives it from the buffer and broadcasts it to the others).

Per step: request a batch for the current policy version (waiting, visibly, while the
buffer has none) -> train -> every ``staleness.sync_every`` steps gather the full weights
and push them as the next version -> every ``trainer.save_freq`` steps checkpoint, then
acknowledge the batches the checkpoint contains (with ``save_freq <= 0``, no intermediate
checkpoint: each batch is acknowledged once trained). At the end: final checkpoint, an HF export
that vLLM loads, and the coordinator ends the run (servers and buffer exit).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncrl.config import run_dir as run_dir_of
from asyncrl.progress import accounting_lines
from learner.batching import Rollout
from learner.validation import ValidationTracker

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0  # how often a long wait for a batch is reported


def to_rollouts(batch: Any) -> list[Rollout]:
    """Wire trajectories of a buffer batch -> the trainer's rollouts (grouped by task id),
    each with the temperature it was sampled at when its server said (NaN behaviour
    logprobs, positions vLLM did not report, stay NaN: the loss drops and counts them)."""
    return [
        Rollout(
            prompt_ids=t.prompt_ids.tolist(),
            response_ids=t.response_ids.tolist(),
            behaviour_logprobs=t.logprobs.tolist(),
            reward=t.meta.reward,
            group_id=t.meta.task_id,
            version_spans=[tuple(s) for s in t.meta.version_spans],
            temperature=t.meta.temperature,
        )
        for t in batch.trajectories
    ]


class LearnerLoop:
    """See the module docstring; ``run()`` returns the process exit code."""

    def __init__(self, cfg: Any):
        from learner.trainer import Trainer

        self.cfg = cfg
        self.run_dir = run_dir_of(cfg)
        self.trainer = Trainer(cfg)
        self.rank0 = self.trainer.rank == 0
        self.total = cfg.trainer.total_training_steps
        self.unacked: list[int] = []  # batch ids trained on since the last checkpoint
        self.last_batch_id: int | None = None
        self.pushed: dict[str, Any] | None = None  # rank 0: last pushed weights, for catch-ups
        self.control = None
        if self.rank0:
            self.control = _RankZero(cfg, self.run_dir)

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Consumes batches; produces steps, pushes, checkpoints and metrics. Waits for
        batches (reported every 30 s while it lasts) and for sync reports (bounded by
        ``sync.timeout_s``). Unblocked by the buffer releasing a batch."""
        self._resume()
        done = False
        try:
            while self.trainer.step < self.total:
                self._one_step()
            self._save(final=True)
            done = True
        finally:
            if self.rank0:
                self.control.finish(self, validate=done)
        return 0

    def _one_step(self) -> None:
        c, t = self.cfg, self.trainer
        start = time.monotonic()
        batch_id, rollouts, batch_metrics = self._next_batch()
        waited = time.monotonic() - start
        metrics = t.train_step(rollouts, c.rollout.temperature)  # advances t.step
        self.last_batch_id = batch_id
        if c.trainer.save_freq > 0:
            self.unacked.append(batch_id)  # acknowledged by the checkpoint that holds it
        elif self.rank0:
            # No intermediate checkpoint: a restart could not resume to this batch, so the
            # buffer has no reason to keep it. Held, it would count against the buffer's
            # capacity until the buffer stopped releasing batches (the run hung).
            self.control.acknowledge([batch_id])
        metrics.update(batch_metrics)
        if self.rank0:  # before the push: the admission window moves by what it consumed
            self.control.coordinator.trained(sorted({r.group_id for r in rollouts}))
        metrics["timing/wait_batch_s"] = waited
        metrics["timing/step_s"] = time.monotonic() - start
        metrics["timing/wait_fraction"] = waited / max(metrics["timing/step_s"], 1e-9)
        if t.step % c.staleness.sync_every == 0 or t.step == self.total:
            metrics.update(self._push())
        if c.trainer.save_freq > 0 and t.step % c.trainer.save_freq == 0 and t.step < self.total:
            self._save()
        if self.rank0:
            if self.pushed is not None:  # late or restarted servers get the current weights
                self.control.serve_catchups(self.pushed)
            # A server that registered with a higher version raised the coordinator's: the
            # catch-up labelled these same weights with it, so the learner adopts it.
            t.policy_version = max(t.policy_version, self.control.coordinator.version)
            self.control.after_step(t.step, metrics, t.policy_version)

    # ------------------------------------------------------------------ batches
    def _next_batch(self) -> tuple[int, list[Rollout], dict[str, float]]:
        """Rank 0 waits for the buffer's next batch and broadcasts it to the other ranks."""
        from learner.broadcast import share_batch

        payload = None
        if self.rank0:
            payload = self.control.wait_batch(self.trainer.policy_version, self)
        batch = share_batch(payload, self.trainer.rank, self.trainer.world_size)
        # The buffer's own counters (buffer/...); the trainer reports this batch's lag.
        metrics = dict(batch.metrics)
        return batch.batch_id, to_rollouts(batch), metrics

    # ------------------------------------------------------------------ pushes
    def _push(self) -> dict[str, float]:
        """Gather the full weights (every rank) and push them as the next version (rank 0)."""
        start = time.monotonic()
        tensors = self.trainer.full_state_for_push()
        out: dict[str, float] = {"timing/gather_s": time.monotonic() - start}
        if self.rank0:
            self.pushed = tensors
            result = self.control.push(tensors)
            self.trainer.policy_version = result.version
            out["timing/weight_sync_s"] = time.monotonic() - start
            out["sync/failed_members"] = len(result.failed)
        self.trainer.policy_version = _broadcast_int(self.trainer.policy_version, self.trainer)
        return out

    # ------------------------------------------------------------------ checkpoints
    def _save(self, final: bool = False) -> None:
        extra = {"last_batch_id": self.last_batch_id}
        if self.rank0:
            extra["coordinator"] = self.control.coordinator.state_dict()
        path = self.trainer.save(self.run_dir, extra=extra)
        if self.rank0:
            self.control.acknowledge(self.unacked)
            log.info(
                "checkpoint %s saved (step %d, version %d)",
                path,
                self.trainer.step,
                self.trainer.policy_version,
            )
        self.unacked = []
        if final:
            self._export()

    def _export(self) -> None:
        from learner.checkpoint import export_hf

        tensors = self.trainer.full_state_for_push()
        if self.rank0:
            out = self.run_dir / "final"
            export_hf(out, tensors, self.cfg.model.path)
            log.info("final policy exported to %s (HF format)", out)

    def _resume(self) -> None:
        """Continue from the latest checkpoint (``resume_mode=auto``) or a given one, then
        push the restored weights under a version above any a server reports."""
        from learner.checkpoint import latest_checkpoint

        mode = self.cfg.trainer.resume_mode
        path = None
        if mode == "auto":
            path = latest_checkpoint(self.run_dir)
        elif mode == "resume_path":
            path = self.cfg.trainer.resume_from_path
        acked_through = None
        if path is not None:
            extra = self.trainer.load(path)
            acked_through = extra.get("last_batch_id")
            self.last_batch_id = acked_through
            log.info(
                "resumed from %s at step %d, version %d",
                path,
                self.trainer.step,
                self.trainer.policy_version,
            )
        if self.rank0:
            saved = extra.get("coordinator") if path else None
            self.control.start(saved, acked_through, resumed=path is not None)
        if path is not None:
            self._push()  # servers may hold older weights than the checkpoint's


def _broadcast_int(value: int, trainer: Any) -> int:
    if trainer.world_size == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.broadcast(t, 0)
    return int(t.item())


class _RankZero:
    """What only rank 0 holds: coordinator, sync store and pusher, buffer client, logger."""

    def __init__(self, cfg: Any, run_dir):
        self.cfg = cfg
        self.run_dir = run_dir
        self.coordinator = None
        self.buffer = None
        self.pusher = None
        self.plan = None
        self.validation = ValidationTracker()
        self.logger = None
        self.started = time.monotonic()

    def start(self, saved_state: dict | None, acked_through: int | None, resumed: bool) -> None:
        from asyncrl.config import write_resolved
        from asyncrl.control.setup import coordinator_from_config, store_host, sync_backend
        from asyncrl.metrics import MetricsLogger
        from asyncrl.sync_sender import WeightPusher
        from asyncrl.transport import BufferClient, config_endpoint
        from asyncrl.weight_sync import open_store

        c = self.cfg
        write_resolved(c, self.run_dir)
        store = open_store(
            store_host(c.endpoints.host),
            c.endpoints.sync_store,
            is_host=True,
            timeout_s=c.sync.timeout_s,
        )
        self.coordinator = coordinator_from_config(c, saved_state=saved_state).start()
        self.pusher = WeightPusher(
            self.coordinator,
            store,
            backend=sync_backend(c.trainer.device),
            timeout_s=c.sync.timeout_s,
        )
        self.buffer = BufferClient(config_endpoint(c.endpoints, "batches"), "learner")
        welcome = self.buffer.hello(acked_through, wait_s=c.launch.start_timeout_s)
        log.info("buffer ready: %d unacknowledged batches come again first", welcome.redelivering)
        self.logger = MetricsLogger(
            self.run_dir,
            c.trainer.logger,
            project=c.trainer.project_name,
            experiment=c.trainer.experiment_name,
            config=c.model_dump(mode="json"),
            console_keys=CONSOLE_KEYS,
            fresh=not resumed,
        )

    def wait_batch(self, version: int, loop: LearnerLoop):
        """The next batch from the buffer. Waits as long as it takes (the rollout servers
        may be starting), logging every 30 s; serves catch-ups meanwhile."""
        start = last_log = time.monotonic()
        silent_since = None
        while True:
            try:
                batch = self.buffer.request_batch(version, wait_s=1.0)
                silent_since = None
            except TimeoutError:  # the buffer died or restarts: keep asking, say so
                batch, silent_since = None, silent_since or time.monotonic()
            if batch is not None:
                return batch
            if loop.pushed is not None:
                self.serve_catchups(loop.pushed)
            self.poll_validation(loop.trainer.step, version)
            if time.monotonic() - last_log > WAIT_LOG_S:
                last_log = time.monotonic()
                log.info(
                    "waiting for a batch for %.0fs (%s)%s",
                    last_log - start,
                    _brief(self.coordinator.metrics()),
                    f"; the buffer at {self.buffer.addr} silent for {last_log - silent_since:.0f}s"
                    if silent_since
                    else "",
                )

    def push(self, tensors: dict[str, Any]):
        from asyncrl.weight_sync import plan_buckets, plan_to_wire, specs_of

        if self.plan is None:
            self.plan = plan_buckets(specs_of(tensors), int(self.cfg.sync.bucket_mb * 2**20))
            self.plan_wire = plan_to_wire(self.plan)
        return self.pusher.push(tensors, self.plan, self.plan_wire)

    def serve_catchups(self, tensors: dict[str, Any]) -> None:
        if self.plan is not None and self.coordinator.pending_catchups():
            self.pusher.serve_catchups(tensors, self.plan, self.plan_wire)

    def acknowledge(self, batch_ids: list[int]) -> None:
        if not batch_ids:
            return
        try:
            self.buffer.ack(batch_ids)
        except TimeoutError as e:  # a buffer that died took these batches with it anyway
            log.warning("acknowledging batches %s: %s", batch_ids, e)

    def poll_validation(self, step: int, version: int) -> None:
        done = self.validation.add(self.buffer.validation(), self.coordinator)
        if done:
            self.logger.log(step, done)

    def after_step(self, step: int, metrics: dict[str, float], version: int) -> None:
        self.coordinator.on_step(step)
        self.poll_validation(step, version)
        metrics["actor/policy_version"] = version
        metrics.update(self.coordinator.metrics())
        metrics.update(_rollout_summary(self.coordinator.server_metrics()))
        self.logger.log(step, metrics)

    def finish(self, loop: LearnerLoop, validate: bool) -> None:
        """Validate the final policy (when training completed and validation is on), then
        end the run for everyone. Waits for the round up to ``launch.start_timeout_s``."""
        t = self.cfg.trainer
        if validate and (t.val_before_train or t.test_freq > 0):
            self.coordinator.start_validation(loop.trainer.step)
        deadline = time.monotonic() + self.cfg.launch.start_timeout_s
        while self.validation.pending(self.coordinator) and time.monotonic() < deadline:
            self.poll_validation(loop.trainer.step, loop.trainer.policy_version)
            time.sleep(0.5)
        accounting = self.coordinator.accounting()
        self.logger.log(loop.trainer.step, accounting)
        for line in accounting_lines([accounting]):
            log.info("%s", line)
        self.coordinator.shutdown("training done")
        self.logger.close()
        self.buffer.close()


CONSOLE_KEYS = ("reward/mean", "val/score", "loss/pg", "importance/w_mean",
                "lag/mean", "actor/policy_version", "timing/step_s",
                "timing/wait_fraction")  # fmt: skip


def _rollout_summary(servers: dict[str, dict[str, float]]) -> dict[str, float]:
    """The rollout servers' heartbeat metrics, summed (rates) or averaged (fractions)."""
    reports = [m for m in servers.values() if m]
    if not reports:
        return {}
    out = {"rollout/tokens_per_s": sum(m.get("rollout/tokens_per_s", 0.0) for m in reports)}
    # Cumulative totals over the servers: rates and waits over any window come from their
    # differences (the benchmarks' steady-state figures).
    for key in ("rollout/tokens", "rollout/task_wait_s", "rollout/sync_pause_s"):
        out[key] = sum(m.get(key, 0.0) for m in reports)
    out["rollout/servers_reporting"] = len(reports)
    for key in ("rollout/wait_fraction", "rollout/reward_mean", "rollout/response_length_mean"):
        values = [m[key] for m in reports if key in m]
        if values:
            out[key] = sum(values) / len(values)
    return out


def _brief(metrics: dict[str, float]) -> str:
    keys = ("coordinator/budget/dealt", "coordinator/budget/limit", "coordinator/servers/alive")
    return ", ".join(f"{k.rsplit('/', 1)[-1]}={metrics[k]:.0f}" for k in keys if k in metrics)
