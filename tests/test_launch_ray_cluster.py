"""The Ray launcher's supervisor on a real one-node Ray cluster on 127.0.0.1
(``ray.cluster_utils.Cluster``), each role's agent starting a real process:

- every role it stops gets its ``exit`` event in ``launch.jsonl``, as under the local
  launcher (a review's SIGTERM to a Ray launch left none);
- a buffer whose port another process holds (the Ray launcher claims no ports) fails the
  run at once in one line, exit 2, without the three restarts a review saw."""

from __future__ import annotations

import json
import signal
import socket
import sys

import pytest

from asyncrl.launch.ray_launcher import RaySupervisor
from asyncrl.launch.ray_main import reserve
from asyncrl.launch.ray_plan import Placement
from asyncrl.launch.supervise import QuietView, RestartPolicy, Role
from tests.helpers import endpoint_overrides, wait_until

pytestmark = pytest.mark.timeout(180)

# A role that waits for SIGTERM, and one that ignores it (killed after the grace).
WAITS = "import time; time.sleep(120)"
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('SIGTERM', 'ignored', flush=True); time.sleep(120)"  # the log echoes the code
)


@pytest.fixture
def ray_cluster(monkeypatch):
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Read by Ray at its import, which another test module may have done before this one
    # (then the cluster waited for a GCS on the machine's network address, for minutes).
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_the_ray_launcher_records_the_exit_of_each_role_it_stops(tmp_path, ray_cluster):
    placement = Placement([{"CPU": 1.0}], {"buffer": 0, "learner": 0}, {"buffer": 0, "learner": 0})
    pg = reserve(placement, "PACK", 60)
    assert pg is not None
    roles = [
        Role("buffer", [sys.executable, "-c", WAITS]),
        Role("learner", [sys.executable, "-c", STUBBORN]),
    ]
    sup = RaySupervisor(roles, tmp_path, RestartPolicy(), placement, pg, {}, start_timeout_s=60)
    sup.begin()
    try:
        for role in roles:
            sup.start(role)
        for role in roles:
            wait_until(
                lambda r=role: sup._look_at(r) is None and sup.agents[r.name].pid is not None,
                f"{role.name} started",
                60,
            )
        log = tmp_path / "logs" / "learner.log"
        wait_until(lambda: "SIGTERM ignored" in log.read_text(), "the learner's handler", 30)
        sup.stop_all(grace_s=2.0)
    finally:
        sup.close()
    events = [json.loads(line) for line in (tmp_path / "launch.jsonl").read_text().splitlines()]
    exits = [(e["role"], e["exit_code"], e["stopped_by"]) for e in events if e["event"] == "exit"]
    assert sorted(exits) == [
        ("buffer", -signal.SIGTERM, "launcher"),
        ("learner", -signal.SIGKILL, "launcher"),
    ], events


def test_a_buffer_whose_port_is_taken_fails_a_ray_run_at_once(tmp_path, ray_cluster):
    placement = Placement([{"CPU": 1.0}], {"buffer": 0}, {"buffer": 0})
    pg = reserve(placement, "PACK", 60)
    overrides = [*endpoint_overrides(), f"trainer.default_local_dir={tmp_path}"]
    port = int(next(o for o in overrides if o.startswith("endpoints.batches=")).split("=")[1])
    cmd = [sys.executable, "-m", "buffer.main", "configs/cpu_demo.yaml", *overrides]
    policy = RestartPolicy(max_restarts=3, backoff_s=0.1)
    sup = RaySupervisor([Role("buffer", cmd)], tmp_path, policy, placement, pg, {}, 60)
    sup.begin()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        try:
            sup.start_all()
            assert sup.run(QuietView()) == 2
        finally:
            sup.close()
    events = [json.loads(line) for line in (tmp_path / "launch.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] != "launch"] == ["start", "gave_up"], events
    log = (tmp_path / "logs" / "buffer.log").read_text().strip().splitlines()
    assert log[-1].endswith(
        f"buffer: cannot listen at endpoints.batches={port} on 127.0.0.1: address already in "
        "use (another run, or a process left of an earlier one?): stop it, or choose a free port"
    ), log[-5:]
