"""What an earlier start or launch leaves on a Ray run's nodes, without a cluster (the real
agent outside Ray; the launcher's supervisor over stand-in agent handles). Each test is a
review's finding:

- any role's start on the learner's node erased the learner's final exit (5, 2): a buffer
  restarted there just before the learner's exit made the launcher restart the learner;
- a second launch of the run copied its nodes' metrics, logs and start-up lines again from
  their start, so every earlier record was counted twice;
- the endpoint URLs an earlier launch's rollout servers wrote were kept, so a client could
  read the address of a server that is gone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from asyncrl.config import load_config, run_dir
from asyncrl.launch import ray_main, roles
from asyncrl.launch.ray_agent import RoleAgent
from asyncrl.launch.ray_launcher import RaySupervisor
from asyncrl.launch.ray_plan import Placement
from asyncrl.launch.restart_policy import FINAL_EXIT_FILE, HEALTH_STOP, mark_final_exit
from asyncrl.launch.supervise import RestartPolicy, Role
from tests.helpers import launch_inputs, wait_until
from tests.test_launch_ray_faults import _get
from tests.test_launch_ray_nodes import NodeAgent, _kill, _started, _wait
from tests.test_launch_ray_start import _stand_in_ray_launch, _Supervisor

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- the learner's final exit


def _start_and_end(agent: RoleAgent) -> None:
    """``agent``'s role started (a restart: attempt 2) and seen to exit."""
    try:
        agent.start([sys.executable, "-c", "pass"], {}, attempt=2)
        wait_until(lambda: agent.poll() is not None, f"{agent.name}'s exit", 20)
    finally:
        agent.close()


def test_only_the_learners_own_start_clears_its_final_exit_on_its_node(tmp_path):
    """The buffer shares the learner's node (bundle 0): its restart must leave the exit 5
    the learner wrote there for the launcher to read."""
    run = tmp_path / "run"
    mark_final_exit(run, HEALTH_STOP)
    _start_and_end(RoleAgent(str(run), "buffer", "launch-1", os.getcwd()))
    assert (run / FINAL_EXIT_FILE).read_text() == f"{HEALTH_STOP}\n"
    _start_and_end(RoleAgent(str(run), "learner", "launch-1", os.getcwd()))
    assert not (run / FINAL_EXIT_FILE).exists()  # an earlier learner's, not this one's


# ---------------------------------------------------------------- a second launch's copies


@pytest.fixture
def node(tmp_path, monkeypatch) -> Path:
    """The run directory on the learner's node, which does not share the launcher's."""
    for name, fake in (("get", _get), ("wait", _wait), ("kill", _kill)):
        monkeypatch.setattr(ray, name, fake)
    (tmp_path / "node" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs").mkdir(parents=True)
    return tmp_path / "node"


def _launch(run: Path, node: Path, node_id: str) -> RaySupervisor:
    """One launch of the run in ``run``: its learner started on ``node`` and what grew
    there copied back."""
    names = ("buffer", "learner")
    placement = Placement([{"CPU": 1.0}], dict.fromkeys(names, 0), dict.fromkeys(names, 0.0))
    sup = RaySupervisor(
        [Role(n, ["true"]) for n in names], run, RestartPolicy(), placement, None, {}, 60.0
    )
    _started(sup, sup.roles[1], NodeAgent(node, node_id, start=7, poll=None))
    sup._track()
    return sup


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _phase(role: str, event: str, t: float) -> str:
    """A line of ``startup.jsonl``."""
    return json.dumps({"role": role, "event": event, "t": t}) + "\n"


def test_a_second_launch_copies_only_what_its_nodes_wrote_since_the_first(tmp_path, node):
    """The same command resumes the run on the same node (whose Ray id is new: the
    cluster was started again); the learner's metrics and log go on there."""
    run = tmp_path / "run"
    _append(node / "metrics.jsonl", '{"step": 1}\n{"step": 2}\n')
    _append(node / "logs" / "learner.log", "first launch\n")
    _append(node / "startup.jsonl", _phase("learner", "started", 100.0))
    _launch(run, node, "node-1")
    _append(node / "metrics.jsonl", '{"step": 3}\n')
    _append(node / "logs" / "learner.log", "second launch\n")
    (run / "startup.jsonl").write_text(_phase("launch", "launch", 200.0))  # startup.begin
    _append(node / "startup.jsonl", _phase("learner", "started", 201.0))
    _launch(run, node, "node-2")
    assert _steps(run / "metrics.jsonl") == [1, 2, 3]
    assert (run / "logs" / "learner.log").read_text() == "first launch\nsecond launch\n"
    # Every launch starts a timeline of its own: the first one's phases are not in it.
    times = [json.loads(line)["t"] for line in (run / "startup.jsonl").open()]
    assert times == [200.0, 201.0]


def test_a_record_that_cannot_be_written_leaves_the_copies_going(tmp_path, node, caplog):
    """A full disk or a read-only run directory costs the next launch a second copy of
    these lines, never the launcher (the record's write raised out of its supervision)."""
    run = tmp_path / "run"
    (run / ".mirrored.json.tmp").mkdir()  # where the record is written first: unwritable
    _append(node / "metrics.jsonl", '{"step": 1}\n')
    sup = _launch(run, node, "node-1")
    _append(node / "metrics.jsonl", '{"step": 2}\n')
    sup._track()
    assert _steps(run / "metrics.jsonl") == [1, 2]
    assert sum("copied back is not written" in r.message for r in caplog.records) == 1


def test_a_local_copy_set_aside_since_is_copied_whole_again(tmp_path, node):
    """The launcher set its ``metrics.jsonl`` aside (it sees no checkpoint of a learner on
    another node): the new copy holds the node's whole record again, not only its end."""
    run = tmp_path / "run"
    _append(node / "metrics.jsonl", '{"step": 1}\n{"step": 2}\n')
    _launch(run, node, "node-1")
    (run / "metrics.jsonl").rename(run / "metrics.1.jsonl")
    _append(node / "metrics.jsonl", '{"step": 3}\n')
    _launch(run, node, "node-1")
    assert _steps(run / "metrics.jsonl") == [1, 2, 3]


# ---------------------------------------------------------------- endpoint URLs


def test_a_ray_launch_deletes_the_endpoint_urls_an_earlier_launch_left(tmp_path, monkeypatch):
    _stand_in_ray_launch(monkeypatch)
    monkeypatch.setattr(ray_main, "reserve", lambda placement, strategy, timeout_s: "pg")
    monkeypatch.setattr(ray_main, "RaySupervisor", _Supervisor)
    monkeypatch.setattr(ray_main, "Departures", SimpleNamespace(from_config=lambda cfg: None))
    inputs = launch_inputs(tmp_path)
    cfg = load_config(inputs[0], inputs[1:])
    stale = run_dir(cfg) / "openai_endpoints" / "rollout-0.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"server_id": "rollout-0", "url": "http://10.0.0.9:41000/v1"}\n')
    seen: list[bool] = []
    monkeypatch.setattr(roles, "drive", lambda sup, run, cfg: seen.append(stale.exists()) or 0)
    assert ray_main.main_ray(cfg) == 0
    assert seen == [False]  # gone before any role starts
