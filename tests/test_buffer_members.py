"""Groups whose members come one message each (a producer of our wire format other than
our rollout servers may send them so), over the real buffer service on 127.0.0.1: the
reading never stops for incomplete groups, since that would also keep out the members
that complete them, and a pause at capacity does not age a group whose member waits in
the socket (it expired, and the member came late)."""

from __future__ import annotations

import pytest

from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import TrajectoryPusher
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from tests.helpers import wait_until
from tests.standins.trajgen import make_group, make_traj

pytestmark = pytest.mark.timeout(60)


def _stats_when(client: BufferClient, ready, what: str) -> dict[str, float]:
    def check() -> dict[str, float] | None:
        stats = client.stats()
        return stats if ready(stats) else None

    stats = wait_until(check, what, 15, details=client.stats)
    assert stats is not None
    return stats


def test_open_groups_at_the_bound_still_get_their_members() -> None:
    buffer = ReplayBuffer(batch_size=1, capacity_groups=2, max_policy_lag=5, group_timeout_s=30)
    with (
        BufferService(buffer) as svc,
        TrajectoryPusher(svc.trajectories_endpoint) as pusher,
        BufferClient(svc.batches_endpoint, "observer", timeout_s=5) as client,
    ):
        for tid in ("a", "b"):  # two groups open: incomplete groups at their bound
            pusher.send([make_traj(tid, 0, 2)])
        _stats_when(client, lambda s: s["buffer/incomplete"] == 2, "two open groups")
        pusher.send([make_traj("c", 0, 2)])  # a third group past the bound: refused
        for tid in ("a", "b"):
            pusher.send([make_traj(tid, 1, 2)])
        stats = _stats_when(client, lambda s: s["buffer/groups_in"] == 2, "a and b complete")
    assert stats["buffer/incomplete"] == 0 and stats["buffer/drops/overflow"] == 1
    assert stats["buffer/drops/expired"] == 0 and stats["buffer/drops/late"] == 0


def test_a_pause_at_capacity_does_not_age_an_open_group() -> None:
    buffer = ReplayBuffer(batch_size=1, capacity_groups=1, max_policy_lag=5, group_timeout_s=1.0)
    with (
        BufferService(buffer) as svc,
        TrajectoryPusher(svc.trajectories_endpoint) as pusher,
        BufferClient(svc.batches_endpoint, "learner", timeout_s=5) as client,
    ):
        client.hello(None, wait_s=10)
        pusher.send([make_traj("c", 0, 2)])  # read: c is open
        pusher.send(make_group("x", 2))  # read: the buffer is full, the reading pauses
        pusher.send([make_traj("c", 1, 2)])  # waits in the socket
        _stats_when(client, lambda s: s["buffer/size"] == 1, "x held")
        # The pause outlasts c's group_timeout_s (1 s) twice over.
        _stats_when(client, lambda s: s["buffer/paused_s"] >= 2.0, "a pause of 2 s")
        batch = client.request_batch(0, wait_s=5)
        assert batch is not None and batch.task_ids == ["x"]
        client.ack([batch.batch_id])  # room again: the reading goes on
        stats = _stats_when(client, lambda s: s["buffer/groups_in"] == 2, "c complete")
    assert stats["buffer/paused_s"] >= 2.0
    assert stats["buffer/drops/expired"] == 0 and stats["buffer/drops/late"] == 0
