"""``asyncrl-launch --ray`` end to end on a local two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``, every address 127.0.0.1): node "trainer" offers the custom
resource ``trainer_node``, node "gen" offers ``gen_node``, and the config ties the learner's
bundle to the first and the rollout servers' bundles to the second.

- the demo runs to its last step, each role on its node (from the launcher's records of
  where each process ran), and validation rises as in the local demo;
- the rollout servers' node is removed mid-run and a new one added: the servers restart on
  it under their ids, the run finishes, and every task is accounted for.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from tests.e2e_helpers import (
    RUN,
    assert_learned,
    launch_cmd,
    role_logs,
    run_overrides,
    trained_steps,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

TRAINER = {"trainer_node": 1.0}
GEN = {"gen_node": 2.0}


@pytest.fixture
def cluster(monkeypatch):
    """Two Ray nodes on this machine, on loopback only (Ray otherwise takes the machine's
    network address for its own services)."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": TRAINER,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    c.gen = c.add_node(num_cpus=2, resources=GEN, node_ip_address="127.0.0.1")
    try:
        yield c
    finally:
        c.shutdown()


def _ray_overrides(cluster) -> list[str]:
    return [
        f"launch.ray.address={cluster.address}",
        "launch.ray.resources={learner: {trainer_node: 1}, rollout: {gen_node: 1}}",
        "launch.ray.start_timeout_s=120",
        "launch.cpus=null",  # both "nodes" share this machine's two cores
    ]


def _starts(run: Path) -> list[dict]:
    events = [json.loads(line) for line in (run / "launch.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "start"]


@pytest.mark.timeout(900)
def test_the_demo_runs_under_ray_with_each_role_on_its_node(
    tmp_path, demo_model, arithmetic_data, cluster
):
    overrides = run_overrides(tmp_path, demo_model, arithmetic_data, 60)
    cmd = [*launch_cmd(overrides), *_ray_overrides(cluster), "trainer.test_freq=30", "--ray"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    run = tmp_path / RUN
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:] + role_logs(run)
    nodes = {e["role"]: e["node_id"] for e in _starts(run)}
    head = cluster.head_node.node_id
    assert nodes == {
        "buffer": head,
        "learner": head,
        "rollout-0": cluster.gen.node_id,
        "rollout-1": cluster.gen.node_id,
    }, nodes
    assert "endpoints" in (run / "config.yaml").read_text()
    records = read_metrics(run)
    assert [r["step"] for r in trained_steps(records)] == list(range(1, 61))
    assert_learned(records)
    assert "# bundle 1" in (run / "commands.txt").read_text()


@pytest.mark.timeout(900)
def test_the_rollout_node_is_lost_and_replaced_mid_run(
    tmp_path, demo_model, arithmetic_data, cluster
):
    steps = 40
    overrides = run_overrides(tmp_path, demo_model, arithmetic_data, steps)
    cmd = [
        *launch_cmd(overrides),
        *_ray_overrides(cluster),
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "control.heartbeat_s=0.5",
        "control.dead_after_s=8",
        "launch.restart_backoff_s=1",
        "--ray",
    ]
    out_path = tmp_path / "launch.out"
    run = tmp_path / RUN
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:

        def at_step(n: int) -> bool:
            if proc.poll() is not None:
                raise AssertionError(out_path.read_text()[-3000:] + role_logs(run))
            return run.exists() and any(r["step"] >= n for r in trained_steps(read_metrics(run)))

        wait_until(lambda: at_step(8), "step 8", 400, every_s=0.5)
        lost = cluster.gen.node_id
        cluster.remove_node(cluster.gen)
        new = cluster.add_node(num_cpus=2, resources=GEN, node_ip_address="127.0.0.1")
        proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    text = out_path.read_text()
    assert proc.returncode == 0, text[-3000:] + role_logs(run)
    servers = [e for e in _starts(run) if e["role"].startswith("rollout")]
    for name in ("rollout-0", "rollout-1"):
        where = [e["node_id"] for e in servers if e["role"] == name]
        assert where[0] == lost and where[-1] == new.node_id, (name, where)
    records = read_metrics(run)
    assert [r["step"] for r in trained_steps(records)] == list(range(1, steps + 1))
    acct = [r for r in records if "accounting/train/dealt" in r][-1]
    assert acct["accounting/train/unaccounted"] == 0, acct
    assert acct["accounting/train/trained"] == steps * 16, acct
