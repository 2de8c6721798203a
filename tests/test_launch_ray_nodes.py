"""The Ray launcher with roles on nodes that do not share its run directory, without a
cluster: its supervisor over stand-in agent handles whose files live in a folder of their
own (the node's disk; Ray's ``get``, ``wait`` and ``kill`` replaced), and the agent's own
refusal of a command or working directory its node lacks. Each test is a review's finding:

- a learner's final exit (5, 2) written on its node under torchrun was not read, and the
  learner was restarted;
- the last lines of a role seen exiting at the wind-down, or stopped, were never copied back;
- a role exiting by itself at the wind-down got no ``exit`` event;
- a replaced agent copied its node's files again from the start (metrics counted twice);
- a node without the launcher's interpreter path was taken for a killed node and the role
  restarted until it gave up with 137.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError, RayTaskError

from asyncrl.launch.ray_agent import RoleAgent
from asyncrl.launch.ray_handles import Agent, NotOnNode
from asyncrl.launch.ray_launcher import NODE_LOST, RaySupervisor
from asyncrl.launch.ray_plan import Placement
from asyncrl.launch.restart_policy import FINAL_EXIT_FILE
from asyncrl.launch.supervise import QuietView, RestartPolicy, Role
from tests.test_launch_ray_faults import Ref, _get


class NodeAgent:
    """An agent's actor handle on a node whose run directory is ``node``: ``read``,
    ``take_final_exit`` and ``ended_since`` are the real agent's on that folder; any other method answers
    ``answers[method]`` (called with the call's arguments if callable; an exception is
    raised by ``ray.get``)."""

    def __init__(self, node: Path, node_id: str = "node-1", **answers: Any):
        self.node = node
        where = {"ip": "10.0.0.2", "node_id": node_id, "hostname": "gen", "shared_run_dir": False}
        self.answers = {"where": where, "stop": (None, False), **answers}  # stop: nothing ran
        self.calls: list[str] = []
        self.killed = False

    def __getattr__(self, method: str) -> SimpleNamespace:
        def remote(*args: Any) -> Ref:
            self.calls.append(method)
            if method in ("read", "take_final_exit", "ended_since"):
                return Ref(getattr(RoleAgent, method)(SimpleNamespace(run_dir=self.node), *args))
            answer = self.answers.get(method)
            return Ref(answer(*args) if callable(answer) else answer)

        return SimpleNamespace(remote=remote)


def _wait(refs: list[Ref], **_: Any) -> tuple[list[Ref], list[Ref]]:
    return refs, []


def _kill(handle: NodeAgent, no_restart: bool = True) -> None:
    handle.killed = True


@pytest.fixture
def node(tmp_path) -> Path:
    (tmp_path / "node" / "logs").mkdir(parents=True)
    return tmp_path / "node"


@pytest.fixture
def sup(tmp_path, monkeypatch) -> RaySupervisor:
    """A Ray supervisor of a buffer and a learner (bundle 0), its run directory ``run``."""
    for name, fake in (("get", _get), ("wait", _wait), ("kill", _kill)):
        monkeypatch.setattr(ray, name, fake)
    names = ("buffer", "learner")
    placement = Placement([{"CPU": 1.0}], dict.fromkeys(names, 0), dict.fromkeys(names, 0.0))
    roles = [Role(n, ["true"]) for n in names]
    policy = RestartPolicy(max_restarts=2, backoff_s=0.0)
    s = RaySupervisor(roles, tmp_path / "run", policy, placement, None, {}, 60.0)
    (tmp_path / "run" / "logs").mkdir(parents=True)
    return s


def _started(sup: RaySupervisor, role: Role, handle: NodeAgent) -> None:
    """``role`` started by ``handle`` as its agent (a new one if it had none)."""
    sup.agents[role.name] = Agent(handle)
    sup.start(role)
    assert sup._look_at(role) is None and sup.agents[role.name].pid is not None


def _events(sup: RaySupervisor) -> list[dict[str, Any]]:
    lines = (sup.run_dir / "launch.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_learners_final_exit_written_on_its_node_ends_the_run(sup, node):
    """Under torchrun the launcher sees 1; the learner wrote 5 (health stop) on its node."""
    learner = sup.roles[1]
    handle = NodeAgent(node, start=7, poll=None)
    _started(sup, learner, handle)
    (node / FINAL_EXIT_FILE).write_text("5\n")
    handle.answers["poll"] = 1
    code = sup._look_at(learner)
    assert code == 1
    assert sup._end(learner, code, QuietView()) == 5  # not restarted
    assert not (node / FINAL_EXIT_FILE).exists()  # forgotten: a later start's is its own
    assert [e["exit_code"] for e in _events(sup) if e["event"] == "gave_up"] == [5]


def _wind_down(sup: RaySupervisor, node: Path) -> None:
    """The learner ends with 0; the buffer, on an unshared node, writes its last line and
    exits as the launcher looks at it during the wind-down."""
    buffer, learner = sup.roles
    log = node / "logs" / "buffer.log"
    log.write_text("buffer up\n")
    _started(sup, buffer, NodeAgent(node, start=8, poll=None))
    _started(sup, learner, NodeAgent(node, "node-0", start=9, poll=0))
    sup._track()

    def exits() -> int:
        with open(log, "a") as f:
            f.write("BUFFER LAST LINE\n")
        return 0

    sup.agents["buffer"].handle.answers["poll"] = exits
    code = sup._look_at(learner)
    assert code == 0 and sup._end(learner, code, QuietView()) == 0


def test_a_role_seen_exiting_at_the_wind_down_has_its_last_lines_copied(sup, node):
    """Copied as its exit is seen: its agent may be gone by the time the run is stopped."""
    buffer = sup.roles[0]
    log = node / "logs" / "buffer.log"
    log.write_text("buffer up\n")
    _started(sup, buffer, NodeAgent(node, start=8, poll=None))
    sup._track()
    with open(log, "a") as f:
        f.write("BUFFER LAST LINE\n")
    sup.agents["buffer"].handle.answers["poll"] = 0
    assert sup._wait_exited([buffer], 1.0) == []  # as the wind-down looks at it
    assert (sup.run_dir / "logs" / "buffer.log").read_text() == "buffer up\nBUFFER LAST LINE\n"


def test_a_role_seen_exiting_at_the_wind_down_has_its_exit_recorded(sup, node):
    _wind_down(sup, node)
    exits = [(e["role"], e["exit_code"]) for e in _events(sup) if e["event"] == "exit"]
    assert exits == [("learner", 0), ("buffer", 0)], exits


def test_the_lines_a_role_writes_as_it_is_stopped_are_copied(sup, node):
    """As at Ctrl-C: a rollout server logs its leaving on SIGTERM."""
    buffer = sup.roles[0]
    log = node / "logs" / "buffer.log"
    log.write_text("serving\n")

    def stop(grace_s: float) -> tuple[int, bool]:
        with open(log, "a") as f:
            f.write("LEFT: 3 tasks handed back\n")
        return 0, True

    _started(sup, buffer, NodeAgent(node, start=8, poll=None, stop=stop))
    sup._track()
    sup.stop_all(grace_s=0.1)
    assert (sup.run_dir / "logs" / "buffer.log").read_text().endswith("LEFT: 3 tasks handed back\n")


def test_a_replaced_agent_on_the_same_node_copies_only_what_is_new(sup, node):
    learner = sup.roles[1]
    metrics = node / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    _started(sup, learner, NodeAgent(node, start=7, poll=None))
    sup._track()
    sup.agents["learner"].handle.answers["poll"] = RayActorError()  # its agent died
    assert sup._look_at(learner) == NODE_LOST and "learner" not in sup.agents
    with open(metrics, "a") as f:  # the restarted learner resumes on the same node
        f.write('{"step": 3}\n')
    _started(sup, learner, NodeAgent(node, start=17, poll=None))
    sup._track()
    steps = [json.loads(line)["step"] for line in (sup.run_dir / "metrics.jsonl").open()]
    assert steps == [1, 2, 3]


def test_a_start_on_a_node_without_the_command_is_a_config_error(sup, node, caplog):
    """Not a lost node: no restart, one line naming the node and the path, exit 2."""
    learner = sup.roles[1]
    line = "learner cannot start on node gen: its command /opt/venv/bin/python does not exist"
    cause = NotOnNode(line)
    handle = NodeAgent(node, start=RayTaskError("start", "tb", cause).as_instanceof_cause())
    sup.agents["learner"] = Agent(handle)
    sup.start(learner)
    with caplog.at_level(logging.ERROR, logger="asyncrl.launch"):
        code = sup._look_at(learner)
        assert code == 2 and sup._end(learner, code, QuietView()) == 2
    assert line in caplog.messages and not handle.killed
    assert not [e for e in _events(sup) if e["event"] == "restart"]
    dead = NodeAgent(node, start=RayActorError())  # a dead agent stays a loss
    sup.agents["learner"] = Agent(dead)
    sup.start(learner)
    assert sup._look_at(learner) == NODE_LOST and dead.killed
    # Any other failure of the start is a loss too, its cause said (a review found only its
    # type's name in the log: the node's log was never made, so nothing else said why).
    denied = PermissionError("[Errno 13] Permission denied: '/runs/x/logs'")
    sup.agents["learner"] = Agent(NodeAgent(node, start=RayTaskError("start", "tb", denied)))
    sup.start(learner)
    with caplog.at_level(logging.WARNING, logger="asyncrl.launch"):
        assert sup._look_at(learner) == NODE_LOST
    assert "Permission denied: '/runs/x/logs'" in caplog.text


def test_the_agent_refuses_a_command_or_directory_its_node_lacks(tmp_path):
    missing = str(tmp_path / "not-on-this-node")
    agent = RoleAgent(str(tmp_path / "run"), "learner", "launch-1", missing)
    try:
        with pytest.raises(NotOnNode, match=f"working directory {missing} does not exist"):
            agent.start([sys.executable, "-c", "pass"], {}, attempt=1)
    finally:
        agent.close()
    agent = RoleAgent(str(tmp_path / "run"), "learner", "launch-1", os.getcwd())
    try:
        exe = f"{missing}/bin/python"
        with pytest.raises(NotOnNode, match=f"learner cannot start on node .*: its command {exe}"):
            agent.start([exe, "-m", "learner.main"], {}, attempt=1)
        with pytest.raises(NotOnNode, match="its command no-such-tool-here does not exist"):
            agent.start(["no-such-tool-here"], {}, attempt=1)
    finally:
        agent.close()


def test_a_buffer_let_go_after_the_ending_recorded_on_an_unshared_node_is_not_restarted(sup, node):
    """Found by a review: the learner records the run's ending (``complete.json``) on its
    own node, then stops the buffer. Where that node does not share the run directory, the
    launcher looked for the file in its own copy, found none, and 30 s on restarted the
    buffer as after a crash (with its restarts used up, failing a complete run)."""
    import json
    import time

    from asyncrl.config.ending import COMPLETE_FILE
    from asyncrl.launch.supervise import EARLY_EXIT_GRACE_S

    buffer, learner = sup.roles
    _started(sup, buffer, NodeAgent(node, start=8, poll=0))
    _started(sup, learner, NodeAgent(node, "node-0", start=9, poll=None))
    buffer.left_at = time.monotonic() - EARLY_EXIT_GRACE_S - 1
    assert sup._left_early(buffer)  # no ending recorded: restarted as after a crash
    buffer.left_at = time.monotonic() - EARLY_EXIT_GRACE_S - 1
    (node / COMPLETE_FILE).write_text(json.dumps({"step": 6}) + "\n")
    assert not (sup.run_dir / COMPLETE_FILE).exists()  # written on the learner's node only
    assert not sup._left_early(buffer)
