"""The Ray launcher's pure parts and its node agent, without a cluster: bundles and roles
planned from a config, the copying of files that grow on a node, and the agent driving a
real process tree (start, poll, stop) with Ray's variables kept out of the role."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

from asyncrl.config import load_config
from asyncrl.launch.ray_agent import RoleAgent
from asyncrl.launch.ray_handles import Mirror
from asyncrl.launch.ray_plan import (
    drop_local_pins,
    learner_roles,
    plan_placement,
    unshared_learner_problem,
)
from asyncrl.launch.roles import commands_text, plan_roles
from asyncrl.metrics import read_metrics
from tests.helpers import wait_until


def _cfg(*overrides: str):
    return load_config("configs/cpu_demo.yaml", list(overrides))


def test_bundle_zero_holds_the_learner_and_the_buffer_then_one_bundle_per_server():
    cfg = _cfg(
        "launch.ray.resources={learner: {trainer_node: 1}, rollout: {gen_node: 0.5}}",
        "launch.ray.rollout_cpus=2",
    )
    roles = plan_roles(cfg, Path("run/config.yaml"))
    p = plan_placement(cfg, roles)
    assert p.bundles == [
        {"CPU": 1.0, "trainer_node": 1.0},
        {"CPU": 2.0, "gen_node": 0.5},
        {"CPU": 2.0, "gen_node": 0.5},
    ]
    assert p.bundle_of == {"buffer": 0, "rollout-0": 1, "rollout-1": 2, "learner": 0}
    assert set(p.gpus_of.values()) == {0.0}  # a CPU run: no GPUs asked for
    text = commands_text(roles, p.bundle_of)
    assert "rollout-1: " in text and "--server-id rollout-1" in text and "# bundle 2" in text


def test_on_cuda_bundles_carry_the_learner_ranks_and_each_servers_tensor_parallel_gpus():
    cfg = _cfg(
        "trainer.device=cuda",
        "trainer.nproc=4",
        "rollout.tensor_model_parallel_size=2",
        "launch.ray.learner_nodes=2",
        "launch.cpus=null",
    )
    roles = learner_roles(cfg, plan_roles(cfg, Path("run/config.yaml")), "10.0.0.7")
    assert [r.name for r in roles] == ["buffer", "rollout-0", "rollout-1", "learner-1", "learner"]
    p = plan_placement(cfg, roles)
    assert [b.get("GPU") for b in p.bundles] == [4.0, 4.0, 2.0, 2.0]
    assert p.bundle_of["learner-1"] == 1 and p.bundle_of["rollout-0"] == 2
    assert (p.gpus_of["buffer"], p.gpus_of["learner"], p.gpus_of["rollout-1"]) == (0.0, 4.0, 2.0)
    learner, other = roles[-1], roles[-2]
    for role, rank in ((learner, 0), (other, 1)):
        assert f"--node-rank={rank}" in role.cmd and "--nnodes=2" in role.cmd
        assert "--master-addr=10.0.0.7" in role.cmd and "--nproc-per-node=4" in role.cmd
        assert role.restart_args == ["trainer.resume_mode=auto"]


def test_a_mirror_appends_only_what_grew(tmp_path):
    node = tmp_path / "node"
    (node / "logs").mkdir(parents=True)
    here = tmp_path / "here"

    def read(rel: str, offset: int, inode: int) -> tuple[int, int, bytes]:
        return RoleAgent.read(SimpleNamespace(run_dir=node), rel, offset, inode)

    mirror = Mirror(here, ("metrics.jsonl", "logs/learner.log"))
    mirror.pull(read)  # nothing there yet
    (node / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror.pull(read)
    with open(node / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n')
    (node / "logs/learner.log").write_text("hello\n")
    mirror.pull(read)
    mirror.pull(read)
    assert (here / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (here / "logs/learner.log").read_text() == "hello\n"


def test_a_mirror_follows_a_node_file_set_aside_or_cut(tmp_path):
    """Found by a review: a learner that begins its run afresh within a launch sets
    ``metrics.jsonl`` aside on its node, and one resumed cuts a half-written last line;
    the mirror went on at its offset, so the launcher's copy kept the old run's records,
    lost the new file's first ones and took the rest from the middle of a line."""
    node, here = tmp_path / "node", tmp_path / "here"
    node.mkdir()

    def read(rel: str, offset: int, inode: int) -> tuple[int, int, bytes]:
        return RoleAgent.read(SimpleNamespace(run_dir=node), rel, offset, inode)

    mirror = Mirror(here, ("metrics.jsonl",))
    records = "".join(f'{{"step": {i}, "loss": 0.5}}\n' for i in (1, 2, 3))
    (node / "metrics.jsonl").write_text(records)
    mirror.pull(read)
    (node / "metrics.jsonl").rename(node / "metrics.1.jsonl")  # the learner sets it aside
    (node / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror.pull(read)
    with open(node / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n{"step": 3, "half')  # then its writer dies mid-line
    mirror.pull(read)
    with open(node / "metrics.jsonl", "r+") as f:  # the resumed learner cuts the half line
        f.truncate(len('{"step": 1}\n{"step": 2}\n'))
    with open(node / "metrics.jsonl", "a") as f:
        f.write('{"step": 3}\n')
    mirror.pull(read)
    assert (here / "metrics.jsonl").read_text() == (node / "metrics.jsonl").read_text()
    assert (here / "metrics.1.jsonl").read_text() == records
    assert [r["step"] for r in read_metrics(here)] == [1, 2, 3]


def test_the_agent_runs_a_role_tree_without_rays_variables_and_stops_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # as inside a Ray worker
    agent = RoleAgent(str(tmp_path), "rollout-0", "launch-1", os.getcwd())
    agent.write({"config.yaml": "a: 1\n"})
    assert (tmp_path / "config.yaml").read_text() == "a: 1\n"
    # The role starts a grandchild in a session of its own, then waits.
    code = (
        "import os, subprocess, sys, time\n"
        "print('ray vars:', sorted(k for k in os.environ if k.startswith('RAY_')), flush=True)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True)\n"
        "print('grandchild:', g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    pid = agent.start([sys.executable, "-c", code], {"X": "1"}, attempt=1)
    assert pid > 0 and agent.poll() is None
    started = re.compile(r"^grandchild: (\d+)$", re.M)  # the log's first line echoes the code
    wait_until(lambda: started.search(agent.tail()), "the role's grandchild", 20)
    assert "ray vars: []" in agent.tail()
    grandchild = int(started.search(agent.tail()).group(1))
    assert grandchild != pid
    agent.sup._track()
    tree = set(agent.role.known) if agent.role else set()
    # the grandchild left the role's session, yet is tracked as its descendant
    assert grandchild in tree, (grandchild, tree)

    def gone(p: int) -> bool:
        return not Path(f"/proc/{p}").exists() or "Z" in Path(f"/proc/{p}/stat").read_text()

    assert not gone(grandchild)
    # its exit code, for the launcher's exit event (a review found none recorded)
    assert agent.stop(grace_s=2.0) == (-signal.SIGTERM, True)
    assert agent.stop(grace_s=2.0) == (None, False)  # nothing running: nothing to record
    assert agent.poll() is None and agent.role is not None and agent.role.proc is None
    for p in tree | {pid}:
        assert gone(p), p
    agent.close()


def test_the_agent_says_a_role_that_ended_on_its_own_was_not_stopped(tmp_path):
    """A role that exited just before the launcher's stop (a server the coordinator told
    to end) was recorded ``stopped_by: launcher``: the agent returned only its exit code."""
    agent = RoleAgent(str(tmp_path), "rollout-1", "launch-1", os.getcwd())
    pid = agent.start([sys.executable, "-c", "pass"], {}, attempt=1)
    wait_until(lambda: "Z" in Path(f"/proc/{pid}/stat").read_text(), "the role ended", 20)
    assert agent.stop(grace_s=2.0) == (0, False)
    agent.close()


def test_under_ray_the_local_launchers_core_and_gpu_pins_are_not_applied():
    """A review planned the roles of the README's Ray example (its config pins rollout-0
    to GPU 2 and rollout-1 to GPU 3): each server's CUDA_VISIBLE_DEVICES overrode the GPUs
    Ray had given its bundle."""
    cfg = _cfg("launch.gpus={learner: [0, 1], rollout: [[2], [3]]}")
    assert cfg.launch.cpus  # the demo pins cores
    lines = drop_local_pins(cfg)
    assert [line.split()[0] for line in lines] == ["launch.cpus", "launch.gpus"]
    assert cfg.launch.cpus is None and cfg.launch.gpus is None
    for role in plan_roles(cfg, Path("run/config.yaml")):
        assert not {"CUDA_VISIBLE_DEVICES", "ASYNCRL_PIN_CPUS"} & set(role.env), role
        assert role.cpus is None
    assert drop_local_pins(cfg) == []


def test_a_learner_over_several_nodes_needs_a_shared_run_directory():
    """Each node's ranks write their shards under the run directory they see and only
    rank 0 renames the folder whole: on unshared disks the checkpoint could not be
    resumed (a review read it through torch's writer). Refused in one line instead."""
    cfg = _cfg("launch.ray.learner_nodes=2")
    roles = learner_roles(cfg, plan_roles(cfg, Path("run/config.yaml")), "10.0.0.7")
    p = plan_placement(cfg, roles)
    for name in ("learner", "learner-1"):
        problem = unshared_learner_problem(name, p, shared=False)
        assert problem is not None and problem.startswith(f"{name} runs on a node")
        assert "trainer.default_local_dir" in problem
        assert unshared_learner_problem(name, p, shared=True) is None
    assert unshared_learner_problem("rollout-0", p, shared=False) is None  # its logs are copied
    one = _cfg()
    single = plan_placement(one, plan_roles(one, Path("run/config.yaml")))
    assert unshared_learner_problem("learner", single, shared=False) is None
