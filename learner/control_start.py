"""What rank 0's control plane (:class:`learner.control_plane.RankZero`) sets up once, as
it starts: the hello to the buffer and the versions its answer sets on the coordinator
(:func:`meet_buffer`), the adaptive lag controller (:func:`lag_controller`), and the run's
metrics logger (:func:`open_metrics`, with the keys its console line shows)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config import Config
from asyncrl.control.admission import replayed_version
from asyncrl.control.lag_controller import LagController
from asyncrl.metrics import MetricsLogger
from learner.control_peer import Restored

if TYPE_CHECKING:
    from asyncrl.control import Coordinator
    from asyncrl.net.buffer_client import BufferClient

log = logging.getLogger(__name__)

CONSOLE_KEYS = (
    "reward/mean",
    "val/score",
    "loss/pg",
    "importance/w_mean",
    "lag/mean",
    "actor/policy_version",
    "timing/step_s",
    "timing/wait_fraction",
)


def meet_buffer(
    cfg: Config,
    buffer: BufferClient,
    coordinator: Coordinator,
    restored: Restored,
    total_steps: int,
) -> None:
    """Say hello to the buffer (waiting up to ``launch.start_timeout_s``) and set the
    coordinator's versions from its answer: above what it has seen on a fresh start,
    through the versions the replay of its unacknowledged batches reproduces on a
    resume."""
    welcome = buffer.hello(
        restored.last_batch_id,
        wait_s=cfg.launch.start_timeout_s,
        session=restored.last_batch_session,
        resumed=restored.path is not None,
    )
    log.info("buffer ready: %d unacknowledged batches come again first", welcome.redelivering)
    if restored.path is None:  # versions go on above what the buffer has seen
        coordinator.at_least(welcome.policy_version)
        return
    redelivered = welcome.redelivering
    if restored.last_batch_session and welcome.session != restored.last_batch_session:
        # The buffer restarted since the checkpoint: the previous life may have trained
        # batches of the old buffer after it, which nothing redelivers, so the replay does
        # not reproduce its pushes. Servers holding them catch up (found by a review:
        # trusted, they served weights off the learner's path under its version numbers).
        log.info(
            "the buffer restarted since the checkpoint (session %s, not %s): no version the "
            "previous learner pushed after it is taken as reproduced by the replay",
            welcome.session,
            restored.last_batch_session,
        )
        redelivered = 0
    through = replayed_version(
        restored.version,
        restored.step,
        redelivered,
        cfg.staleness.sync_every,
        total_steps,
    )
    coordinator.set_replay(through, welcome.session)
    # A version the buffer measured lag against that the replay never reaches (the
    # previous life died pushing it): go on above it, or every new group is stale.
    if welcome.policy_version > through:
        coordinator.at_least(welcome.policy_version)


def lag_controller(cfg: Config, restored: Restored) -> LagController | None:
    """With ``staleness.controller: adaptive``, the controller of the admission window's
    lag (from the checkpoint's state on a resume); None otherwise."""
    if cfg.staleness.controller != "adaptive":
        return None
    st, health = cfg.staleness, cfg.trainer.health
    lag = LagController(
        st.min_policy_lag,
        st.max_policy_lag,
        health.min_ess,
        health.max_mismatch_kl,
        sync_every=st.sync_every,
    )
    if restored.lag_controller is not None:
        lag.load_state_dict(restored.lag_controller)
    return lag


def open_metrics(cfg: Config, run_dir: Path, new_run: bool) -> MetricsLogger:
    """The run's metrics logger. A new run in ``run_dir`` (no checkpoint resumed, or one
    from elsewhere: the run directory's own were moved aside) sets an earlier run's
    ``metrics.jsonl`` aside and opens a new W&B run, so its steps are not appended to the
    earlier run's records (which W&B would drop as going back in time)."""
    return MetricsLogger(
        run_dir,
        cfg.trainer.logger,
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
        config=cfg.model_dump(mode="json"),
        console_keys=CONSOLE_KEYS,
        fresh=new_run,
    )
