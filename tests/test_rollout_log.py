"""The buffer's optional rollout log (``buffer.log_rollouts``) over a real service on
127.0.0.1: a write that fails (a full disk, a folder gone) turns the log off with one
warning and a count, and the buffer goes on serving what it holds (it ended before, with
every held group and unacknowledged batch)."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import TrajectoryPusher
from buffer.core import ReplayBuffer
from buffer.rollout_log import RolloutLog
from buffer.service import BufferService
from tests.helpers import wait_until
from tests.standins.trajgen import make_group

pytestmark = pytest.mark.timeout(60)


def test_a_failed_write_turns_the_log_off_and_the_buffer_goes_on(tmp_path, caplog) -> None:
    folder = tmp_path / "rollouts"
    rollout_log = RolloutLog(folder, rows_per_file=4)  # two groups of 2 a file
    buffer = ReplayBuffer(batch_size=2, capacity_groups=64, max_policy_lag=10)
    with (
        BufferService(buffer, rollout_log=rollout_log) as svc,
        TrajectoryPusher(svc.trajectories_endpoint) as pusher,
        BufferClient(svc.batches_endpoint, "learner", timeout_s=5) as client,
    ):
        client.hello(None, wait_s=10)

        def groups_in(n: int) -> None:
            wait_until(lambda: client.stats()["buffer/groups_in"] >= n, f"{n} groups in", 10)

        for g in ("a", "b"):
            pusher.send(make_group(g, 2))
        groups_in(2)
        assert pq.read_table(folder).num_rows == 4  # the first file, written
        shutil.rmtree(folder)
        folder.write_text("not a folder")  # every later write fails
        with caplog.at_level("WARNING", logger="buffer.rollout_log"):
            for g in ("c", "d", "e", "f"):
                pusher.send(make_group(g, 2))
            groups_in(6)
        assert "the log is off" in caplog.text and "buffer.log_rollouts=false" in caplog.text
        stats = client.stats()
        assert stats["buffer/rollout_log_lost"] == 8  # c and d's failed file, then e and f
        got = [client.request_batch(0, wait_s=5) for _ in range(3)]
        assert [b.task_ids for b in got if b is not None] == [["a", "b"], ["c", "d"], ["e", "f"]]
