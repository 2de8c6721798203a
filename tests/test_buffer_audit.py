"""The coordinator's audit (``InventoryRequest(ids)``) against a real buffer under
backpressure: an id the buffer has not read yet may only be reported ``unknown`` with
``paused`` set, or the coordinator deals it again (generated twice). Real
:class:`BufferService`, :class:`TrajectoryPusher` and REQ sockets on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from asyncrl import wire
from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.serving import RouterService
from asyncrl.net.transport import TrajectoryPusher
from asyncrl.wire.base import encode
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from tests.helpers import wait_until
from tests.standins.trajgen import make_group

pytestmark = pytest.mark.timeout(60)

IDS = [f"g{i}" for i in range(12)]


@pytest.fixture
def full() -> Iterator[tuple[BufferService, list[zmq.Socket]]]:
    """A buffer of capacity 2 that read g0 and g1 and is full: g2..g11 wait in its socket.
    With two REQ sockets on its batch socket: the learner's and the coordinator's."""
    svc = BufferService(ReplayBuffer(batch_size=2, capacity_groups=2, max_policy_lag=100)).start()
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.REQ) for _ in range(2)]
    with TrajectoryPusher(svc.trajectories_endpoint) as pusher:
        for tid in IDS:
            pusher.send(make_group(tid, 2))
        with BufferClient(svc.batches_endpoint, "observer") as observer:
            wait_until(lambda: observer.stats()["buffer/size"] == 2, "the buffer full", 10)
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(svc.batches_endpoint)
        yield svc, socks
    for s in socks:
        s.close()
    svc.stop()


def _reply(sock: zmq.Socket) -> wire.Reply | wire.Batch:
    assert sock.poll(5000), "no reply"
    return wire.decode_reply(sock.recv_multipart())


def _ask_batch(sock: zmq.Socket, svc: BufferService, last: int | None, wait_s: float) -> None:
    """The learner's batch request, acknowledging batch ``last`` (if any) on the way."""
    msg = wire.BatchRequest(
        consumer_id="learner",
        policy_version=0,
        wait_s=wait_s,
        received_session=svc.session,
        received_through=last,
        ack=[] if last is None else [last],
    )
    sock.send(encode(msg))


def test_an_ack_that_frees_room_does_not_make_queued_groups_look_lost(full) -> None:
    """Each round the learner's request acknowledges its last batch (room again) and the
    audit comes right behind it, as in the coordinator's loop: every id it calls unknown
    is still in the socket queue, so the reply must say paused."""
    svc, (learner, coord) = full
    answer = svc._answers.on_request

    def in_one_burst(
        router: RouterService[wire.Request], envelope: list[bytes], msg: wire.Request
    ) -> None:
        answer(router, envelope, msg)
        if isinstance(msg, wire.BatchRequest):
            time.sleep(0.1)  # the audit arrives meanwhile: read in the same burst, every time

    svc._answers.on_request = in_one_burst
    last: int | None = None
    unknown_seen = 0
    for _ in range(len(IDS) // 2):
        _ask_batch(learner, svc, last, wait_s=0.0)
        coord.send(encode(wire.InventoryRequest(ids=IDS)))
        audit = _reply(coord)
        batch = _reply(learner)
        assert isinstance(audit, wire.InventoryReply)
        if audit.unknown:
            unknown_seen += 1
            assert audit.paused, f"unknown {audit.unknown} reported as lost while queued"
        if isinstance(batch, wire.Batch):
            last = batch.batch_id
    assert unknown_seen == len(IDS) // 2  # the race was there to be lost, every round


def test_once_the_socket_is_drained_an_audit_is_not_paused(full) -> None:
    """The audit still finds lost groups: once a read empties the socket after the last
    pause, ``paused`` is False at once. It read paused for control.dead_after_s (20 s)
    after any pause, and under steady backpressure, where a pause comes at every batch,
    for good: a group that never arrived was never dealt again."""
    svc, (learner, _) = full
    last: int | None = None
    for _ in range(len(IDS) // 2):
        _ask_batch(learner, svc, last, wait_s=1.0)
        batch = _reply(learner)
        assert isinstance(batch, wire.Batch)
        last = batch.batch_id
    assert last is not None
    with BufferClient(svc.batches_endpoint, "observer") as observer:
        observer.ack([last], session=svc.session)  # the buffer empty: reading goes on

        def settled() -> wire.InventoryReply | None:
            reply = observer.inventory([*IDS, "never-sent"])
            return reply if not reply.paused else None

        audit = wait_until(settled, "an audit that is not paused", 3)
    assert audit is not None and audit.unknown == ["never-sent"]


def test_the_full_inventory_of_a_full_buffer_says_it_is_not_reading(full) -> None:
    """Found by a review: after a learner restart the coordinator reconciles its restored
    ledger with the buffer's whole inventory, which did not say the buffer was full. The
    groups still in its socket queue (g2..g11) looked lost and were generated again."""
    svc, _ = full
    with BufferClient(svc.batches_endpoint, "observer") as observer:
        whole = observer.inventory()
    assert sorted(whole.held) == ["g0", "g1"] and whole.paused
