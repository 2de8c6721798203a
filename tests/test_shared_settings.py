"""A rollout server started by hand with another value of a key it must share with the
learner (``asyncrl.config.shared``) is refused when it registers, naming each key, and
exits 2 (not restarted); before, a server with a longer ``data.max_response_length``
registered, and the buffer refused its groups as oversize for the rest of the run (a
walkthrough: 103 rejected messages, a stalled step, a learner that would not end). Over
real sockets: a real coordinator and real coordinator clients on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import load_config
from asyncrl.config.shared import SHARED_KEYS, settings_problems, shared_settings
from asyncrl.control.client import CoordinatorClient
from asyncrl.launch.restart_policy import CONFIG_ERROR
from asyncrl.net.transport import RequestRefused
from tests.helpers import start_coordinator


def test_every_shared_key_is_read_from_the_demo_configs():
    for path in ("configs/cpu_demo.yaml", "configs/cpu_agent_endpoint.yaml"):
        settings = shared_settings(load_config(path))
        assert list(settings) == list(SHARED_KEYS)
    demo = shared_settings(load_config("configs/cpu_demo.yaml"))
    longer = shared_settings(load_config("configs/cpu_demo.yaml", ["data.max_response_length=8"]))
    assert settings_problems(demo, longer) == [
        "data.max_response_length=8 on the server but 4 on the learner"
    ]
    # A key only one side knows (another version of the code) is not judged.
    assert settings_problems(demo, {"data.max_response_length": "4", "new.key": "1"}) == []
    # Paths may differ from machine to machine for the same files: not compared.
    moved = load_config("configs/cpu_demo.yaml", ["model.path=/elsewhere/tiny-demo"])
    assert settings_problems(demo, shared_settings(moved)) == []


def test_the_coordinator_refuses_a_server_whose_shared_settings_differ():
    learner = shared_settings(load_config("configs/cpu_demo.yaml"))
    server = shared_settings(
        load_config("configs/cpu_demo.yaml", ["data.max_response_length=8", "rollout.n=4"])
    )
    coord = start_coordinator(8, per_version=8, settings=learner)
    clients = []
    try:
        for settings in (server, learner, {}):
            client = CoordinatorClient(
                coord.tasks_addr, coord.control_addr, "rollout-0", engine_world_size=0
            )
            client.settings = settings
            clients.append(client)
        with pytest.raises(RequestRefused) as refused:
            clients[0].register(wait_s=5)
        assert "config_mismatch" in str(refused.value)
        assert "data.max_response_length=8 on the server but 4 on the learner" in str(refused.value)
        assert "rollout.n=4 on the server but 8 on the learner" in str(refused.value)
        assert coord.metrics()["coordinator/servers"] == 0  # not registered
        assert clients[1].register(wait_s=5).session  # the same settings
        assert clients[2].register(wait_s=5).session  # none sent (older code): not judged
    finally:
        for client in clients:
            client.close()
        coord.stop()


def test_a_refused_server_exits_2(monkeypatch):
    """The server's run ends at the refusal with the launcher's "do not restart" code."""
    from rollout_servers.server import RolloutServer

    class Refusing:
        def register(self) -> None:
            raise RequestRefused("refused register: config_mismatch: rollout.n=4 ...")

    class Lanes:
        async def control(self, fn, *args):
            return fn(*args)

    server = object.__new__(RolloutServer)
    server.client, server.lanes, server.server_id = Refusing(), Lanes(), "rollout-0"  # type: ignore[assignment]
    assert asyncio.run(server.run()) == CONFIG_ERROR


def test_a_whole_float_and_its_int_are_one_setting():
    """The endpoint test's server, started from the resolved config file, read
    ``model.lora_alpha`` as 16.0 where the learner's default was 16: refused as a
    mismatch. Whole numbers compare alike, nested ones too; other values still differ."""
    learner = load_config(None, [])
    server = load_config(None, ["model.lora_alpha=16.0"])
    server.reward.overlong_buffer.penalty_factor = 0.0  # nested: the learner's default is 0
    assert settings_problems(shared_settings(learner), shared_settings(server)) == []
    other = load_config(None, ["model.lora_alpha=16.5"])
    (line,) = settings_problems(shared_settings(learner), shared_settings(other))
    assert line == "model.lora_alpha=16.5 on the server but 16 on the learner"
