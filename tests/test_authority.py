"""Authority per role under CURVE, on real sockets on 127.0.0.1: each node holds only its
own role's secret (the folders ``asyncrl-prepare keys`` writes), a rollout key is served
for a rollout server's own requests and refused (answered ``forbidden``, counted per role)
for the learner's, and without CURVE everything is served as before."""

from __future__ import annotations

import typing
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from asyncrl import wire
from asyncrl.config import load_config
from asyncrl.control import messages as m
from asyncrl.control.client import CoordinatorClient
from asyncrl.control.coordinator import Coordinator
from asyncrl.net import authority, security
from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.serving import RouterService
from asyncrl.net.transport import ReqClient, RequestRefused, TrajectoryPusher
from asyncrl.wire.base import encode
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from tests.helpers import start_coordinator, wait_until
from tests.standins.trajgen import make_traj


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[Path]:
    security.write_keys(tmp_path / "keys")
    yield tmp_path / "keys"
    security.reset()


def _as(keys_dir: Path, role: str) -> None:
    """This process is now ``role``, with only the key files a node of that role gets:
    what it binds or connects from here on uses them (sockets made before keep theirs)."""
    cfg = load_config(
        "configs/cpu_demo.yaml", ["endpoints.auth=curve", f"endpoints.keys_dir={keys_dir}"]
    )
    security.configure(cfg.endpoints, role)


def _refused(key: str) -> float:
    return security.metrics().get(key, 0.0)


def _tags(union: object) -> set[str]:
    return {t.__struct_config__.tag for t in typing.get_args(union)}


def test_each_role_folder_holds_only_what_its_node_needs(keys):
    for role in security.KEY_ROLES:
        files = sorted(p.name for p in (keys / role).iterdir())
        assert files == sorted(security.node_files(role)), role
    secrets = sorted(p.name for p in (keys / "rollout").glob("*_secret"))
    assert secrets == ["rollout.key_secret"]  # no other role's, not the server's
    assert security.Keys.load(keys / "rollout", "rollout").server_secret is None
    with pytest.raises(FileNotFoundError, match="learner.key_secret"):
        security.Keys.load(keys / "rollout", "learner")
    with pytest.raises(FileNotFoundError, match="server.key_secret"):
        security.Keys.load(keys / "rollout", "buffer")  # a serving role needs the server's
    assert security.Keys.load(keys / "buffer", "buffer").server_secret is not None


def test_the_policies_name_every_request_and_the_learner_may_send_all():
    """A request kind added to the wire is refused to every role under CURVE until the
    policy names it: this keeps the tables and the wire in step."""
    assert _tags(wire.Request) == authority.BUFFER_REQUESTS
    assert _tags(m.Request) == authority.COORDINATOR_REQUESTS
    assert authority.BUFFER.allowed == {"learner": authority.BUFFER_REQUESTS}
    assert authority.COORDINATOR.allowed["learner"] == authority.COORDINATOR_REQUESTS
    assert "shutdown" not in authority.COORDINATOR.allowed["rollout"]
    assert "buffer" not in authority.COORDINATOR.allowed


def test_a_rollout_key_pushes_trajectories_but_is_refused_on_the_batch_socket(keys):
    _as(keys / "buffer", "buffer")
    service = BufferService(
        ReplayBuffer(batch_size=1, capacity_groups=16, max_policy_lag=4)
    ).start()
    _as(keys / "rollout", "rollout")
    pusher = TrajectoryPusher(service.trajectories_endpoint, linger_s=0)
    rogue = BufferClient(service.batches_endpoint, "rollout-0", timeout_s=5)
    _as(keys / "learner", "learner")
    learner = BufferClient(service.batches_endpoint, "learner", timeout_s=5)
    try:
        pusher.send([make_traj("t0")])
        for ask in (rogue.hello, rogue.shutdown):
            with pytest.raises(RequestRefused, match="forbidden") as e:
                ask()
            assert "the rollout key may not send" in str(e.value)
            assert "holding the learner key" in str(e.value)
        wait_until(
            lambda: learner.stats().get("buffer/trajectories_in", 0) >= 1,
            "the rollout key's trajectory to reach the buffer",
            10,
        )
        assert learner.stats()["buffer/security/refused/rollout"] == 2
        assert learner.hello().redelivering == 0  # the learner key is served
        learner.shutdown()
        assert service.wait(10), "the learner's shutdown should stop the buffer"
    finally:
        for c in (pusher, rogue, learner):
            c.close()
        service.stop()


@pytest.fixture
def coordinator(keys) -> Iterator[Coordinator]:
    """A coordinator in a learner process (learner key, server secret) under CURVE."""
    _as(keys / "learner", "learner")
    coord = start_coordinator(8, per_version=100)
    try:
        yield coord
    finally:
        coord.stop()


def _client(coord: Coordinator, server_id: str) -> CoordinatorClient:
    return CoordinatorClient(
        coord.tasks_addr, coord.control_addr, server_id, engine_world_size=0, timeout_s=5.0
    )


def test_a_rollout_key_serves_its_server_but_cannot_end_the_run(keys, coordinator):
    _as(keys / "rollout", "rollout")
    server = _client(coordinator, "rollout-0")
    _as(keys / "buffer", "buffer")
    stranger_role = _client(coordinator, "buffer-0")
    _as(keys / "learner", "learner")
    admin = _client(coordinator, "launcher")
    try:
        server.register()
        assert server.heartbeat(wait_s=0) is not None
        grant = server.request_tasks(2, wait_s=0)
        assert grant.tasks, grant.reason
        assert server.ack([t.task_id for t in grant.tasks]) is not None
        before = _refused("security/refused/rollout")
        with pytest.raises(RequestRefused, match="forbidden") as e:
            server.request_shutdown("a tool asked")
        assert "the rollout key may not send shutdown" in str(e.value)
        assert _refused("security/refused/rollout") == before + 1
        assert coordinator.metrics()["security/refused/rollout"] == before + 1
        assert not coordinator.shutdown_requested.is_set()
        with pytest.raises(RequestRefused, match="forbidden"):
            stranger_role.register(wait_s=5)  # the buffer asks no one anything
        admin.request_shutdown("the learner's side ends it")
        wait_until(coordinator.shutdown_requested.is_set, "the learner key's shutdown", 10)
    finally:
        for c in (server, stranger_role, admin):
            c.close()


def test_without_curve_there_is_no_role_and_every_request_is_served():
    security.reset()
    ctx = zmq.Context()
    counts: Counter[str] = Counter()
    service = RouterService(
        ctx,
        "tcp://127.0.0.1:*",
        wire.decode_request,
        on_reject=lambda e: None,
        counts=counts,
        policy=authority.BUFFER,
    )
    client = ReqClient(service.endpoint, timeout_s=5.0)
    try:
        assert not service.authenticated
        client._sock.send_multipart([encode(wire.Shutdown())])
        wait_until(lambda: service.sock.poll(0), "the request to arrive", 5)
        [(_, request)] = list(service.receive())
        assert isinstance(request, wire.Shutdown)
    finally:
        client.close()
        service.close()
        ctx.term()
