"""Optional rollout log (``buffer.log_rollouts``): every trajectory the buffer decodes, with
what became of it, appended to parquet files in ``<run dir>/rollouts/``.

Rows are collected in memory and written ``rows_per_file`` at a time (and at close), one
file per chunk, so a crash loses at most one chunk and each file is readable on its own:
``pyarrow.parquet.read_table("<run dir>/rollouts")`` reads them all.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.wire import Trajectory

log = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("group_index", pa.int32()),
        ("group_size", pa.int32()),
        ("outcome", pa.string()),  # added, completed, duplicate, late, inconsistent
        ("validation", pa.bool_()),
        ("data_source", pa.string()),
        ("server_id", pa.string()),
        ("finish_reason", pa.string()),
        ("reward", pa.float64()),
        ("reward_parts", pa.map_(pa.string(), pa.float64())),
        ("version_spans", pa.list_(pa.list_(pa.int64(), 2))),
        ("oldest_version", pa.int64()),
        ("masked_spans", pa.list_(pa.list_(pa.int64(), 2))),  # tool output: (start, length)
        ("episode", pa.int32()),  # the episode of a multi-turn sample
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("created_at", pa.float64()),
        ("finished_at", pa.float64()),
        ("received_at", pa.float64()),  # buffer wall clock
    ]
)


class RolloutLog:
    """Appends trajectories to ``directory/rollouts-<n>.parquet`` in chunks."""

    def __init__(self, directory: str | Path, rows_per_file: int = 4096):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rows_per_file = rows_per_file
        self._rows: list[dict[str, Any]] = []
        # Continue numbering after files of an earlier buffer process in the same run.
        self._n = len(list(self.directory.glob("rollouts-*.parquet")))
        self.rows_written = 0
        # Rows not written: a write that failed (a full disk) turns the log off, rather
        # than end the buffer and the groups and batches it holds.
        self.rows_lost = 0
        self.broken: str | None = None

    def append(self, traj: Trajectory, outcome: str, received_at: float) -> None:
        if self.broken is not None:
            self.rows_lost += 1
            return
        m = traj.meta
        self._rows.append(
            {
                "task_id": m.task_id,
                "group_index": m.group_index,
                "group_size": m.group_size,
                "outcome": outcome,
                "validation": m.validation,
                "data_source": m.data_source,
                "server_id": m.server_id,
                "finish_reason": m.finish_reason,
                "reward": m.reward,
                "reward_parts": list(m.reward_parts.items()),
                "version_spans": [list(s) for s in m.version_spans],
                "oldest_version": m.oldest_version,
                "masked_spans": [list(s) for s in m.masked_spans],
                "episode": m.episode_index,
                "prompt_ids": traj.prompt_ids,
                "response_ids": traj.response_ids,
                "logprobs": traj.logprobs,
                "created_at": m.created_at,
                "finished_at": m.finished_at,
                "received_at": received_at,
            }
        )
        if len(self._rows) >= self.rows_per_file:
            self.flush()

    def flush(self) -> None:
        """Write the collected rows as one new parquet file."""
        if not self._rows:
            return
        path = self.directory / f"rollouts-{self._n:05d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        try:
            pq.write_table(pa.Table.from_pylist(self._rows, schema=SCHEMA), tmp)
            tmp.replace(path)  # a reader never sees half a file
        except (OSError, pa.ArrowException) as e:
            self.rows_lost += len(self._rows)
            self._rows = []
            self.broken = f"{type(e).__name__}: {e}"
            with contextlib.suppress(OSError):  # the folder may be what is gone
                tmp.unlink(missing_ok=True)
            log.warning(
                "rollout log: writing %s failed (%s); the log is off for the rest of this "
                "buffer's life (buffer/rollout_log_lost counts the rows not written), the "
                "buffer goes on; free space there or set buffer.log_rollouts=false",
                path,
                self.broken,
            )
            return
        self._n += 1
        self.rows_written += len(self._rows)
        self._rows = []

    def close(self) -> None:
        self.flush()
        log.info("rollout log: %d trajectories in %s", self.rows_written, self.directory)
