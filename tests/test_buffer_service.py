"""The buffer service on real loopback sockets, with stand-in producer and consumer processes
(``tests/standins``) for the rollout servers and the learner that later issues build. The
``asyncrl-buffer`` command as its own process: ``tests/test_buffer_command.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from asyncrl import wire
from asyncrl.net.buffer_client import BufferClient, Superseded
from asyncrl.net.transport import TrajectoryPusher, endpoint
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from learner.validation import per_source
from tests.helpers import wait_until
from tests.standins.harness import (
    finish,
    group_spec,
    read_lines,
    spec_file,
    start_standin,
)
from tests.standins.trajgen import make_group

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def service() -> Iterator:
    """``service(**core_kw, **service_kw)`` starts an in-process service on free ports."""
    started: list[BufferService] = []

    def start(rcvhwm: int = 1000, **kw: object) -> BufferService:
        args = {"batch_size": 2, "capacity_groups": 100, "max_policy_lag": 10}
        svc = BufferService(ReplayBuffer(**(args | kw)), rcvhwm=rcvhwm).start()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


def stats_when(svc: BufferService, ready, timeout_s: float = 20) -> dict[str, float]:
    """The service's stats (over its socket) once ``ready(stats)`` holds."""
    with BufferClient(svc.batches_endpoint, "observer") as client:

        def ready_stats() -> dict[str, float] | None:
            stats = client.stats()
            return stats if ready(stats) else None

        return wait_until(ready_stats, "the buffer's stats", timeout_s, details=client.stats)


def batches_of(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "batch_id" in x]


# ----------------------------------------------------------------------- groups
def test_groups_assembled_from_two_producers_and_incomplete_ones_expire(service, tmp_path) -> None:
    # Long enough for the second producer's process to start after the first's halves.
    svc = service(group_timeout_s=4.0)
    tids = [f"g{i}" for i in range(6)]
    # Each producer sends half the members of every group, one trajectory per message.
    halves = [
        [[{"task_id": t, "index": i, "size": 4}] for t in tids for i in (0, 2)],
        [[{"task_id": t, "index": i, "size": 4}] for t in tids for i in (1, 3)],
    ]
    halves[0] += [[{"task_id": "gx", "index": i, "size": 4}] for i in (0, 2)]
    halves[1] += [[{"task_id": "gx", "index": 1, "size": 4}]]  # member 3 never comes
    producers = [
        start_standin("producer", svc.trajectories_endpoint, spec_file(tmp_path, h, f"p{k}.json"))
        for k, h in enumerate(halves)
    ]
    consumer = start_standin("consumer", svc.batches_endpoint, "--batches", "3")
    for p in producers:
        finish(p)
    got = batches_of(finish(consumer))
    assert sorted(t for b in got for t in b["task_ids"]) == tids
    assert all(b["sizes"] == [4, 4] and b["data_ok"] for b in got)
    stats = stats_when(svc, lambda s: s["buffer/drops/expired"] >= 1)
    assert stats["buffer/drops/expired"] == 1 and stats["buffer/incomplete"] == 0
    assert stats["buffer/trajectories_in"] == 27 and stats["buffer/rejects/total"] == 0
    with BufferClient(svc.batches_endpoint, "coordinator") as client:
        assert client.dropped() == [wire.DroppedTask("gx", "expired")]


def test_duplicate_task_ids_are_dropped(service, tmp_path) -> None:
    svc = service()
    messages = [
        group_spec("a", 2),
        group_spec("a", 2),  # the task re-dealt after its first server was declared dead
        [{"task_id": "b", "index": 0, "size": 2}],
        [{"task_id": "b", "index": 0, "size": 2}],  # a member sent twice
        [{"task_id": "b", "index": 1, "size": 2}],
        group_spec("c", 2),
    ]
    finish(start_standin("producer", svc.trajectories_endpoint, spec_file(tmp_path, messages)))
    consumer = start_standin("consumer", svc.batches_endpoint, "--batches", "1")
    got = batches_of(finish(consumer))
    assert [b["task_ids"] for b in got] == [["a", "b"]]
    stats = stats_when(svc, lambda s: s["buffer/drops/duplicate"] == 3)
    assert stats["buffer/drops/duplicate"] == 3 and stats["buffer/groups_in"] == 3
    assert stats["buffer/ready"] == 1  # c, waiting for a partner; no second a


# ----------------------------------------------------------------------- backpressure
def test_slow_consumer_blocks_producers_without_loss(service, tmp_path) -> None:
    svc = service(capacity_groups=4, rcvhwm=1)
    # ~1.6 MB messages: a few fill the queues and the kernel's socket buffers.
    tids = [f"g{i:02d}" for i in range(40)]
    spec = spec_file(tmp_path, [group_spec(t, 2, response_len=100_000) for t in tids])
    producer = start_standin("producer", svc.trajectories_endpoint, spec, "--hwm", "1")
    consumer = start_standin(
        "consumer", svc.batches_endpoint, "--batches", "20", "--delay-s", "0.1"
    )
    sent = finish(producer)[-1]
    got = batches_of(finish(consumer))
    assert sent["sent"] == 40 and sent["blocked_s"] > 0.5  # the producer waited, blocked
    assert [t for b in got for t in b["task_ids"]] == tids  # everything, once, in order
    assert all(b["data_ok"] for b in got)
    stats = stats_when(svc, lambda s: True)
    assert stats["buffer/size_max"] <= 4 and stats["buffer/paused_s"] > 0.5
    assert stats["buffer/drops/duplicate"] == stats["buffer/rejects/total"] == 0


# ----------------------------------------------------------------------- lag
def test_lag_drops_exactly_the_groups_beyond_the_limit(service, tmp_path) -> None:
    svc = service(max_policy_lag=1)
    messages = [
        group_spec("v0", 2, version=0),  # lag 3 at learner version 3: dropped
        group_spec("v1-3", 2, spans=[(1, 2), (3, 2)]),  # oldest token at 1, lag 2: dropped
        group_spec("v2", 2, version=2),  # lag 1: kept
        group_spec("v3", 2, version=3),
        group_spec("v3b", 2, version=3),
        group_spec("v2b", 2, spans=[(2, 1), (3, 3)]),  # lag 1: kept
    ]
    finish(start_standin("producer", svc.trajectories_endpoint, spec_file(tmp_path, messages)))
    stats_when(svc, lambda s: s["buffer/groups_in"] == 6)
    consumer = start_standin("consumer", svc.batches_endpoint, "--batches", "2", "--version", "3")
    got = batches_of(finish(consumer))
    # Oldest policy version first (the lag-1 groups, in arrival order), then the fresh ones.
    assert [b["task_ids"] for b in got] == [["v2", "v2b"], ["v3", "v3b"]]
    assert [b["lag_histogram"] for b in got] == [{"1": 2}, {"0": 2}]
    with BufferClient(svc.batches_endpoint, "coordinator") as client:
        assert client.dropped() == [
            wire.DroppedTask("v0", "lag"),
            wire.DroppedTask("v1-3", "lag"),
        ]
        stats = client.stats()
    assert stats["buffer/drops/lag"] == 2 and stats["buffer/lag_max"] == 1


# ----------------------------------------------------------------------- validation
def test_validation_groups_never_reach_a_training_batch(service, tmp_path) -> None:
    svc = service()
    messages = []
    for i in range(6):
        messages.append(group_spec(f"train{i}", 2, data_source="countdown"))
        source = "gsm8k" if i % 2 else "countdown"
        messages.append(group_spec(f"val{i}", 3, validation=True, data_source=source, reward=1.0))
    finish(start_standin("producer", svc.trajectories_endpoint, spec_file(tmp_path, messages)))
    consumer = start_standin("consumer", svc.batches_endpoint, "--batches", "3")
    got = batches_of(finish(consumer))
    assert [t for b in got for t in b["task_ids"]] == [f"train{i}" for i in range(6)]
    stats = stats_when(svc, lambda s: s["buffer/val_groups_in"] == 6)
    assert stats["buffer/val_groups_in"] == 6 and stats["buffer/ready"] == 0
    assert not any(v for b in got for v in b["validation"])
    with BufferClient(svc.batches_endpoint, "learner") as client:
        by_round = client.validation().by_round
    assert sorted(by_round) == [f"val{i}" for i in range(6)]  # no round in these ids
    assert all(list(ids) == [key] for key, ids in by_round.items())  # one group each
    stats = per_source(g for ids in by_round.values() for g in ids.values())
    assert set(stats) == {"gsm8k", "countdown"}
    assert stats["gsm8k"].groups == 3 and stats["gsm8k"].trajectories == 9
    assert stats["countdown"].reward_mean == 1.0


# ----------------------------------------------------------------------- consumer restart
def test_killed_consumer_gets_its_unacknowledged_batches_again(service, tmp_path) -> None:
    svc = service()
    tids = [f"t{i:02d}" for i in range(12)]
    spec = spec_file(tmp_path, [group_spec(t, 2) for t in tids])
    finish(start_standin("producer", svc.trajectories_endpoint, spec))
    first = start_standin(
        "consumer", svc.batches_endpoint, "--batches", "4", "--ack", "2", "--hang"
    )
    lines = read_lines(first, 6)  # welcome, 4 batches, done
    os.kill(first.pid, signal.SIGKILL)  # a crash: no goodbye, two batches unacknowledged
    first.wait(10)
    before = batches_of(lines)
    assert [b["batch_id"] for b in before] == [0, 1, 2, 3]

    second = start_standin("consumer", svc.batches_endpoint, "--batches", "4")
    after_lines = finish(second)
    assert after_lines[0]["welcome"]["redelivering"] == 2
    after = batches_of(after_lines)
    assert [(b["batch_id"], b["task_ids"]) for b in after[:2]] == [
        (b["batch_id"], b["task_ids"]) for b in before[2:]
    ]
    assert [b["redelivered"] for b in after] == [True, True, False, False]
    acked = [t for b in before + after if b["acked"] for t in b["task_ids"]]
    assert Counter(acked) == Counter(tids)  # every task id acknowledged exactly once
    stats = stats_when(svc, lambda s: True)
    assert stats["buffer/unacked_batches"] == 0 and stats["buffer/batches_acked"] == 6


def test_a_restarted_consumer_does_not_lose_a_held_request(service) -> None:
    """A request held for a consumer that then restarts must not take a batch with it: it
    is answered ``superseded`` at once (the old client, were it alive, is stale)."""
    svc = service()
    old = BufferClient(svc.batches_endpoint, "learner", timeout_s=0.5)
    old.hello()
    outcome: list[object] = []

    def wait_for_a_batch() -> None:
        try:
            outcome.append(old.request_batch(0, wait_s=2))
        except (TimeoutError, Superseded) as e:
            outcome.append(e)

    waiting = threading.Thread(target=wait_for_a_batch)
    waiting.start()
    stats_when(svc, lambda s: s["buffer/pending_requests"] == 1)
    with BufferClient(svc.batches_endpoint, "learner") as new:
        new.hello()  # the same consumer, restarted: its held request is void
        with TrajectoryPusher(svc.trajectories_endpoint) as pusher:
            for tid in ("a", "b"):
                pusher.send(make_group(tid, 2))
        batch = new.request_batch(0, wait_s=5)
        assert batch is not None and batch.task_ids == ["a", "b"]
    waiting.join()
    assert isinstance(outcome[0], Superseded)  # the void request got no batch
    old.close()


@contextmanager
def learner_fed(
    svc: BufferService, task_ids: str
) -> Iterator[tuple[BufferClient, TrajectoryPusher]]:
    """A consumer "learner" that said hello, and a producer that pushed a group of 2 for
    each of ``task_ids``."""
    with (
        BufferClient(svc.batches_endpoint, "learner") as client,
        TrajectoryPusher(svc.trajectories_endpoint) as pusher,
    ):
        client.hello()
        for tid in task_ids:
            pusher.send(make_group(tid, 2))
        yield client, pusher


def test_an_acknowledgement_carried_on_the_next_request_frees_room_before_it_is_served(
    service,
) -> None:
    """The learner without intermediate checkpoints acknowledges each batch with its next
    request (``BatchRequest.ack``). A full buffer must apply it first: with released,
    unacknowledged batches holding all its room it reads nothing new, so ignoring the
    carried acknowledgement leaves the third request without a batch."""
    svc = service(capacity_groups=4)
    with learner_fed(svc, "abcd") as (client, pusher):
        first = client.request_batch(0, wait_s=5)
        assert first is not None and first.task_ids == ["a", "b"]
        second = client.request_batch(0, wait_s=5, ack=[first.batch_id])
        assert second is not None and second.task_ids == ["c", "d"]
        for tid in "ef":  # room for these only once a carried acknowledgement is applied
            pusher.send(make_group(tid, 2))
        third = client.request_batch(0, wait_s=5, ack=[second.batch_id])
        assert third is not None and third.task_ids == ["e", "f"]
        # Carried again (as after a lost reply): harmless.
        assert client.request_batch(0, wait_s=0.1, ack=[second.batch_id]) is None
        client.ack([third.batch_id])
        stats = client.stats()
    assert stats["buffer/batches_acked"] == 3 and stats["buffer/unacked_batches"] == 0


def test_an_acknowledgement_carried_from_another_buffer_session_is_ignored(service) -> None:
    """A learner whose last batch came from a buffer that has since restarted carries that
    batch's id, which in the new session names another batch: it must not be applied."""
    svc = service()
    with learner_fed(svc, "abcd") as (client, _):
        first = client.request_batch(0, wait_s=5)
        assert first is not None and first.session == svc.session
        client.received = ("an-earlier-buffer", 7)  # its last batch came from there
        client.request_batch(0, wait_s=5, ack=[first.batch_id])
        assert client.stats()["buffer/batches_acked"] == 0
        client.request_batch(0, wait_s=5, ack=[first.batch_id])  # this session's: applied
        stats = client.stats()
    assert stats["buffer/batches_acked"] == 1 and stats["buffer/acks_other_session"] == 1


def test_an_acknowledgement_of_another_buffer_session_is_ignored(service) -> None:
    """The checkpoint's acknowledgement (``Ack``) names the session of its batches: sent
    to a buffer that restarted since, whose batch ids start at 0 again, it must not make
    that buffer forget its own batch of the same id, released and not yet trained."""
    svc = service()
    with learner_fed(svc, "ab") as (client, _):
        first = client.request_batch(0, wait_s=5)
        assert first is not None and first.batch_id == 0
        reply = client.ack([0], session="an-earlier-buffer")
        assert reply.acked == [] and reply.unknown == [0]
        stats = client.stats()
        assert stats["buffer/unacked_batches"] == 1 and stats["buffer/acks_other_session"] == 1
        assert client.ack([0], session=svc.session).acked == [0]
        assert client.stats()["buffer/unacked_batches"] == 0


def test_ipc_endpoints(tmp_path: Path) -> None:
    core = ReplayBuffer(batch_size=1, capacity_groups=10, max_policy_lag=0)
    host = f"ipc://{tmp_path}"
    svc = BufferService(
        core,
        trajectories=endpoint(host, 0, "trajectories"),
        batches=endpoint(host, 0, "batches"),
    )
    with svc, BufferClient(svc.batches_endpoint, "learner") as client:
        assert svc.batches_endpoint == f"ipc://{tmp_path}/batches.sock"
        client.hello()
        with TrajectoryPusher(svc.trajectories_endpoint) as pusher:
            pusher.send(make_group("a", 2))
        batch = client.request_batch(0, wait_s=5)
        assert batch is not None and batch.task_ids == ["a"]


def test_no_batch_reply_after_wait_and_in_process_lifecycle() -> None:
    core = ReplayBuffer(batch_size=2, capacity_groups=10, max_policy_lag=0)
    with BufferService(core) as svc, BufferClient(svc.batches_endpoint, "learner") as client:
        client.hello()
        start = time.monotonic()
        assert client.request_batch(0, wait_s=0.3) is None
        assert 0.25 <= time.monotonic() - start < 3
        assert client.last_wait_s >= 0.25
    assert svc.wait(0)  # stopped by the context manager
