"""``asyncrl-launch --ray`` end to end on a local two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``, every address 127.0.0.1): node "trainer" offers the custom
resource ``trainer_node``, node "gen" offers ``gen_node``, and the config ties the learner's
bundle to the first and the rollout servers' bundles to the second.

- the demo runs to its last step, each role on its node (from the launcher's records of
  where each process ran), and validation rises as in the local demo;
- the rollout servers' node is removed mid-run and a new one added: the servers restart on
  it under their ids, the run finishes, and every task is accounted for;
- the learner split over two "nodes" (``launch.ray.learner_nodes=2``: two torchruns of one
  rank each, meeting at bundle 0's node) trains to the end.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asyncrl.metrics import read_metrics
from tests.e2e_helpers import (
    RUN,
    assert_learned,
    launch_cmd,
    role_logs,
    run_overrides,
    trained_steps,
    wait_for_step,
)
from tests.helpers import free_ports

pytestmark = pytest.mark.slow

TRAINER = {"trainer_node": 2.0}  # room for two learner bundles
GEN = {"gen_node": 2.0}


@dataclass
class TwoNodes:
    cluster: Any  # ray.cluster_utils.Cluster
    gen: Any  # the rollout servers' node

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id


@pytest.fixture
def cluster(monkeypatch):
    """Two Ray nodes on this machine, on loopback only (Ray otherwise takes the machine's
    network address for its own services)."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Read by Ray at its import, which another test module may have done before this one
    # (the cluster then waited minutes for a GCS on the machine's network address).
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)

    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": TRAINER,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )
    nodes = TwoNodes(c, c.add_node(num_cpus=2, resources=GEN, node_ip_address="127.0.0.1"))
    try:
        yield nodes
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
    head = cluster.head_id
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
        wait_for_step(proc, run, out_path, 8, 400)
        lost = cluster.gen.node_id
        cluster.cluster.remove_node(cluster.gen)
        new = cluster.cluster.add_node(num_cpus=2, resources=GEN, node_ip_address="127.0.0.1")
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


@pytest.mark.timeout(600)
def test_a_learner_on_two_nodes_meets_at_bundle_zero(
    tmp_path, demo_model, arithmetic_data, cluster
):
    steps = 6
    overrides = run_overrides(tmp_path, demo_model, arithmetic_data, steps)
    cmd = [
        *launch_cmd(overrides),
        *_ray_overrides(cluster),
        "launch.ray.learner_nodes=2",
        f"launch.ray.rdzv_port={free_ports(1)[0]}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "--ray",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    run = tmp_path / RUN
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + role_logs(run)
    starts = {e["role"]: e for e in _starts(run)}
    assert {"learner", "learner-1"} <= starts.keys(), starts
    for name in ("learner", "learner-1"):
        assert starts[name]["node_id"] == cluster.head_id
    commands = (run / "commands.txt").read_text()
    assert "--nnodes=2" in commands and "--node-rank=1" in commands
    records = read_metrics(run)
    assert [r["step"] for r in trained_steps(records)] == list(range(1, steps + 1))
    # Both ranks took part, one under each torchrun.
    assert "learner rank 0/2" in (run / "logs" / "learner.log").read_text()
    assert "learner rank 1/2" in (run / "logs" / "learner-1.log").read_text()
