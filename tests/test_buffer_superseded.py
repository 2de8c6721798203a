"""Two live clients under one consumer id (a hung learner beside its restarted successor):
the last hello's client is served, the other is refused ``superseded`` and stops; no group
is trained twice. Real :class:`BufferService` and :class:`BufferClient` on loopback."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from asyncrl import wire
from asyncrl.net.buffer_client import BufferClient, Superseded
from asyncrl.net.transport import ReqClient, TrajectoryPusher
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from tests.helpers import wait_until
from tests.standins.trajgen import make_group

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def svc() -> Iterator[BufferService]:
    """A service holding 8 complete groups g0..g7, batches of 2."""
    service = BufferService(
        ReplayBuffer(batch_size=2, capacity_groups=100, max_policy_lag=100)
    ).start()
    with TrajectoryPusher(service.trajectories_endpoint) as pusher:
        for i in range(8):
            pusher.send(make_group(f"g{i}", 2))
    with BufferClient(service.batches_endpoint, "observer") as observer:
        wait_until(lambda: observer.stats()["buffer/ready"] >= 8, "8 groups in", 10)
    yield service
    service.stop()


def test_a_stale_learner_is_refused_and_no_group_is_trained_twice(svc, caplog) -> None:
    old = BufferClient(svc.batches_endpoint, "learner", timeout_s=2)
    new = BufferClient(svc.batches_endpoint, "learner", timeout_s=2)
    with old, new, caplog.at_level(logging.WARNING, logger="buffer.consumers"):
        old.hello(None, resumed=False)
        b0 = old.request_batch(0, wait_s=0.5)
        assert b0 is not None
        new.hello(None, resumed=False)  # a successor starts while the old one still runs
        got: Counter[str] = Counter()
        for _ in range(2):
            b = new.request_batch(0, wait_s=0.5)
            assert b is not None
            got.update(b.task_ids)
            # The old one's next request would have the successor's batch resent to it.
            with pytest.raises(Superseded, match="said hello as 'learner'; .* stop it"):
                old.request_batch(0, wait_s=0.5)
        with pytest.raises(Superseded):
            old.ack([b0.batch_id], session=b0.session)
        assert new.ack([], session=b0.session).unknown == []  # the current one is served
        stats = new.stats()
    assert max(got.values()) == 1
    assert stats["buffer/superseded_requests"] == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "stop the stale one" in warned[0]  # once per stale client


def test_the_successor_gets_every_group_once_while_the_old_one_keeps_asking(svc) -> None:
    """Interleaved as two live processes would be: every group reaches the successor once,
    none reaches the old learner after the successor's hello."""
    old = BufferClient(svc.batches_endpoint, "learner", timeout_s=2)
    new = BufferClient(svc.batches_endpoint, "learner", timeout_s=2)
    with old, new:
        old.hello(None, resumed=False)
        assert old.request_batch(0, wait_s=0.5) is not None
        new.hello(None, resumed=False)
        got: list[str] = []
        for _ in range(4):
            b = new.request_batch(0, wait_s=0.5)
            assert b is not None
            got += b.task_ids
            with pytest.raises(Superseded):
                old.request_batch(0, wait_s=0.5, ack=[0])
    assert sorted(got) == [f"g{i}" for i in range(8)]


def test_the_same_client_keeps_its_place_after_a_timeout_and_a_new_socket(svc) -> None:
    """A timeout, or a socket made anew (another routing identity), is the same client:
    its incarnation token belongs to the object, not to the socket."""
    client = BufferClient(svc.batches_endpoint, "learner", timeout_s=0.3)
    with client:
        client.hello(None, resumed=False)
        assert client.request_batch(0, wait_s=0.2) is not None
        fast = svc._answers.metrics
        svc._answers.metrics = lambda: (time.sleep(0.8), fast())[1]  # a stalled service
        with pytest.raises(TimeoutError):
            client.stats()
        svc._answers.metrics = fast
        assert client.request_batch(0, wait_s=0.5) is not None  # the same socket goes on
        client.close()
        ReqClient.__init__(client, svc.batches_endpoint, timeout_s=2)  # a fresh socket
        batch = client.request_batch(0, wait_s=0.5, ack=[0])
        assert batch is not None and batch.batch_id == 2
        assert client.ack([1, 2], session=batch.session).acked == [1, 2]


def test_a_restart_after_the_old_learner_exited_gets_its_batches_again(svc) -> None:
    with BufferClient(svc.batches_endpoint, "learner", timeout_s=2) as old:
        old.hello()
        first = old.request_batch(0, wait_s=0.5)
        assert first is not None
    with BufferClient(svc.batches_endpoint, "learner", timeout_s=2) as new:
        assert new.hello().redelivering == 1
        again = new.request_batch(0, wait_s=0.5)
        assert again is not None and again.redelivered and again.task_ids == first.task_ids
        assert new.ack([again.batch_id], session=again.session).acked == [again.batch_id]


def test_a_client_without_incarnation_tokens_is_still_served(svc) -> None:
    """An older peer sends no ``incarnation`` field: its messages decode (the default) and
    are served as one client, as before."""
    old_hello = {"kind": "hello", "schema": 1, "consumer_id": "learner", "resumed": False}
    request = {"kind": "batch_request", "schema": 1, "consumer_id": "learner",
               "policy_version": 0, "wait_s": 0.5}  # fmt: skip
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.batches_endpoint)
    try:
        for body in (old_hello, request):
            sock.send(msgspec.msgpack.encode(body))
            assert sock.poll(5000), "no reply"
            reply = wire.decode_reply(sock.recv_multipart())
            assert not isinstance(reply, wire.ErrorReply), reply
        assert isinstance(reply, wire.Batch)
    finally:
        sock.close()


def test_a_superseded_learner_ends_with_the_code_the_launcher_does_not_restart(tmp_path, caplog):
    """Exit 1 is restarted: the stale learner, restarted, would say hello and take the
    batches back from its successor, and so on. It ends with the config-error code and one
    line saying why."""
    from asyncrl.launch.restart_policy import CONFIG_ERROR
    from learner.control_peer import NoControl
    from tests.test_resume_modes import _loop

    class StaleControl(NoControl):
        abandoned = False

        def resume(self, state):
            raise Superseded("buffer at tcp://127.0.0.1:1: another learner said hello")

        def abandon(self):
            self.abandoned = True

    loop = _loop(tmp_path / "run", "trainer.total_training_steps=10")
    loop.total, loop.control = 10, StaleControl()  # type: ignore[assignment]
    loop.trainer.full_state_for_push = dict  # type: ignore[attr-defined]
    loop._ended = lambda: False  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="learner.loop"):
        assert loop.run() == CONFIG_ERROR
    assert loop.control.abandoned  # type: ignore[attr-defined]
    assert "this learner ends without a restart" in caplog.text


def test_a_learner_superseded_at_its_last_acknowledgement_ends_the_same_way(tmp_path):
    """Its ending's acknowledgement (after the last step) refused: the error escaped as a
    traceback and exit 1, and the restart said hello again, taking over from the live
    learner."""
    from asyncrl.launch.restart_policy import CONFIG_ERROR
    from learner.control_peer import NoControl
    from tests.test_resume_modes import _loop

    class RefusedAtTheEnd(NoControl):
        def finish(self, *args, **kwargs):
            raise Superseded("buffer at tcp://127.0.0.1:1: another learner said hello")

    loop = _loop(tmp_path / "run", "trainer.total_training_steps=10")
    loop.total, loop.control = 10, RefusedAtTheEnd()  # type: ignore[assignment]
    loop.trainer.full_state_for_push = dict  # type: ignore[attr-defined]
    loop.stopped_by = None
    loop.trainer.world_size = 1  # type: ignore[attr-defined]
    loop._ended = lambda: False  # type: ignore[method-assign]
    loop._one_step = lambda: False  # type: ignore[method-assign]  (the data ran out)
    loop._save = lambda final: None  # type: ignore[method-assign]
    assert loop.run() == CONFIG_ERROR
