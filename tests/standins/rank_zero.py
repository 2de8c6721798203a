"""Rank 0's control plane on loopback ports (its coordinator serving in threads), with the
buffer service it talks to and a validation round in flight from the start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import Config, run_dir
from buffer.service import BufferService
from learner.control_peer import Restored
from learner.control_plane import RankZero
from tests.standins.learner import loopback_config


@dataclass
class RankZeroRig:
    """Rank 0's control plane and the buffer service, both on loopback ports of ``cfg``."""

    cfg: Config
    rank0: RankZero
    buffer: BufferService

    def restart_buffer(self) -> BufferService:
        """A new buffer service on the same endpoints (a new session)."""
        self.buffer = BufferService.from_config(self.cfg).start()
        return self.buffer


@contextlib.contextmanager
def validating_rank_zero(
    directory: Path, data: Path, overrides: Sequence[str] = ()
) -> Iterator[RankZeroRig]:
    """A fresh run's rank 0 with a validation round in flight (``val_before_train``), so
    every step and every wait for a batch polls the buffer for its scores; ``data``: a
    folder with ``train.parquet`` and ``val.parquet``; ``overrides``: more config. Stopped,
    buffer included, at exit."""
    cfg, _ = loopback_config(
        directory,
        [
            f"data.train_files={data}/train.parquet",
            f"data.val_files={data}/val.parquet",
            "trainer.val_before_train=true",
            "trainer.test_freq=-1",
            "trainer.logger=[jsonl]",
            "control.heartbeat_s=0.3",
            *overrides,
        ],
    )
    buffer = BufferService.from_config(cfg).start()
    rank0 = RankZero(cfg, run_dir(cfg), Restored(None, None, None), new_run=True)
    rig = RankZeroRig(cfg, rank0, buffer)
    try:
        yield rig
    finally:
        rank0.coordinator.stop()
        rank0.logger.close()
        rank0.buffer.close()
        rig.buffer.stop()
