"""A trajectory message the buffer refuses (over ``data.max_response_length``, invalid) is
reported to the coordinator as a drop of each task it names, once, and its warning names
the server, the task and the key to change; so a group refused every time is not dealt
again and again. Real :class:`BufferService`, :class:`TrajectoryPusher` and
:class:`BufferClient` on loopback."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest

from asyncrl import wire
from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import RequestRefused, TrajectoryPusher
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from tests.helpers import wait_until
from tests.standins.trajgen import make_group

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def svc() -> Iterator[BufferService]:
    service = BufferService(
        ReplayBuffer(batch_size=100, capacity_groups=100, max_policy_lag=100),
        limits=wire.Limits(max_response_len=1000),
    ).start()
    yield service
    service.stop()


def test_refused_groups_are_reported_dropped_once_and_named_in_the_warning(svc, caplog) -> None:
    too_long = make_group("toolong", 2, response_len=2000, server_id="srv-7")
    # A member whose group_index is past its group_size: invalid, whatever the limits.
    one = make_group("bad", 1)[0]
    bad = [msgspec.structs.replace(one, meta=msgspec.structs.replace(one.meta, group_index=3))]
    half = make_group("half", 2)  # member 0 fits; member 1 is over the limit
    long_half = make_group("half", 2, response_len=2000)
    with (
        caplog.at_level(logging.WARNING, logger="buffer.service_stats"),
        TrajectoryPusher(svc.trajectories_endpoint) as pusher,
        BufferClient(svc.batches_endpoint, "coordinator") as coordinator,
    ):
        for message in ([*too_long], bad, half[:1], long_half[1:], [*too_long], half[1:]):
            pusher.send_frames(wire.encode_trajectories(message, check=False))
        pusher.send(make_group("ok", 2))
        wait_until(lambda: coordinator.stats()["buffer/groups_in"] == 1, "the good group", 10)
        dropped = coordinator.drain().dropped
        audit = coordinator.inventory(["toolong", "bad", "half", "ok"])
        stats = coordinator.stats()
    assert sorted((d.task_id, d.cause) for d in dropped) == [
        ("bad", "invalid"),
        ("half", "oversize"),
        ("toolong", "oversize"),  # once, though sent twice
    ]
    assert audit.unknown == []  # known: the audit does not deal them again either
    assert stats["buffer/drops/rejected"] == 3
    assert stats["buffer/drops/late"] == 1  # half's member 1 that fitted came after
    assert stats["buffer/rejects/trajectories/oversize"] == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    oversize = [w for w in warned if "oversize" in w]
    assert len(oversize) == 1  # then only counted
    for part in ("server srv-7", "task toolong", "data.max_response_length"):
        assert part in oversize[0], oversize[0]


def test_a_version_no_lag_can_be_measured_against_is_refused_and_the_buffer_serves_on():
    """A member whose version is near 2**64 decoded, and the lag of its group against the
    learner's version crashed the buffer's thread when a batch encoded it (every group
    it held lost). Versions are bounded on the wire: refused as ``invalid``, counted, and
    a learner asking at such a version is refused the same way."""
    huge = wire.Trajectory.build(
        task_id="huge", prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5],
        policy_version=2**64 - 1, group_size=1, group_index=0,
    )  # fmt: skip
    svc = BufferService(ReplayBuffer(batch_size=1, capacity_groups=10, max_policy_lag=4)).start()
    try:
        with (
            TrajectoryPusher(svc.trajectories_endpoint) as pusher,
            BufferClient(svc.batches_endpoint, "learner", timeout_s=5) as learner,
        ):
            pusher.send_frames(wire.encode_trajectories([huge], check=False))
            pusher.send(make_group("ok", 1))
            learner.hello(wait_s=5)
            with pytest.raises(RequestRefused, match="invalid"):
                learner.request_batch(2**63, wait_s=0.5)
            batch = learner.request_batch(0, wait_s=5)
            stats = learner.stats()
    finally:
        svc.stop()
    assert batch is not None and batch.task_ids == ["ok"]
    assert stats["buffer/rejects/trajectories/invalid"] == 1
    assert stats["buffer/rejects/requests/invalid"] == 1


def test_a_request_the_buffer_fails_on_is_answered_and_counted(svc, monkeypatch, caplog):
    """A bug on one request's path is answered ``internal`` and logged with its traceback;
    the service, and the groups it holds, carry on."""

    def broken() -> None:
        raise RuntimeError("a bug on the inventory's path")

    monkeypatch.setattr(svc.buffer, "inventory", broken)
    with (
        caplog.at_level(logging.ERROR, logger="buffer.service"),
        TrajectoryPusher(svc.trajectories_endpoint) as pusher,
        BufferClient(svc.batches_endpoint, "coordinator", timeout_s=5) as coordinator,
    ):
        pusher.send(make_group("kept", 1))
        wait_until(lambda: coordinator.stats()["buffer/groups_in"] == 1, "the group", 10)
        with pytest.raises(RequestRefused, match="internal.*RuntimeError: a bug"):
            coordinator.inventory()
        assert coordinator.inventory(["kept", "other"]).unknown == ["other"]
        assert coordinator.stats()["buffer/request_errors"] == 1
    assert any("a inventory request on" in r.getMessage() for r in caplog.records)


def test_a_batch_request_the_buffer_fails_on_is_let_go_and_the_buffer_serves_on(monkeypatch):
    """A batch request is held, and served again at every pass of the loop: one whose
    release raised was answered ``internal``, stayed held, raised again outside the guard
    and ended the buffer's thread. It is answered, counted and let go; once the defect is
    gone the same learner gets its batch."""
    svc = BufferService(ReplayBuffer(batch_size=1, capacity_groups=10, max_policy_lag=4)).start()
    release, calls = svc.buffer.release, []

    def broken_after_the_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # on arrival: nothing to release yet, the request is held
            return release(*args, **kwargs)
        raise RuntimeError("a bug on the release path")  # at a later pass of the loop

    monkeypatch.setattr(svc.buffer, "release", broken_after_the_first)
    try:
        with (
            TrajectoryPusher(svc.trajectories_endpoint) as pusher,
            BufferClient(svc.batches_endpoint, "learner", timeout_s=5) as learner,
        ):
            learner.hello(wait_s=5)
            pushed = threading.Timer(0.5, pusher.send, [make_group("g", 1)])
            pushed.start()  # while the request is held: the loop's own pass releases
            with pytest.raises(RequestRefused, match="internal.*a bug on the release path"):
                learner.request_batch(0, wait_s=3)
            pushed.join()
            time.sleep(0.3)  # several passes of the loop
            assert learner.stats()["buffer/request_errors"] == 1
            monkeypatch.setattr(svc.buffer, "release", release)
            batch = learner.request_batch(0, wait_s=5)
    finally:
        svc.stop()
    assert batch is not None and batch.task_ids == ["g"]
