"""What ``asyncrl-launch --ray`` does when its cluster misbehaves, without a cluster: the
launcher's supervisor over stand-in agent handles (Ray's ``get``, ``wait`` and ``kill``
replaced), and the launch's checks before it joins Ray.

- an agent that answers a poll late is asked again; one given up on is killed, so that its
  role never runs twice (a review's restart started a second copy beside the first);
- bundle 0 placed again on another node ends the run in one line (its restarted roles
  bound the lost node's address and crash-looped);
- a bundle that finds no node ends the run after ``launch.max_restarts`` tries in a row,
  however long each try (it retried for ever when a try outlasted the restart window);
- a run directory held by another launch, and a cluster address nobody answers, are
  refused in one line before Ray is joined.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from asyncrl.config import load_config, run_dir
from asyncrl.launch import ray_main
from asyncrl.launch.local import main
from asyncrl.launch.ports import hold_run_dir
from asyncrl.launch.ray_handles import SLOW_POLLS, Agent
from asyncrl.launch.ray_launcher import ENDED, NODE_LOST, RaySupervisor
from asyncrl.launch.ray_main import cluster_problem
from asyncrl.launch.ray_plan import Placement
from asyncrl.launch.supervise import QuietView, RestartPolicy, Role
from tests.helpers import free_port, launch_inputs

UNPLACED = object()  # the answer of a start whose bundle found no node


class Ref:
    def __init__(self, answer: Any):
        self.answer = answer


class FakeAgent:
    """An agent's actor handle: ``handle.<method>.remote(...)`` is answered with
    ``answers[method]`` (an exception is raised by ``ray.get``); calls are recorded."""

    def __init__(self, **answers: Any):
        self.answers = answers
        self.calls: list[str] = []
        self.killed = False

    def __getattr__(self, method: str) -> SimpleNamespace:
        def remote(*args: Any) -> Ref:
            self.calls.append(method)
            return Ref(self.answers.get(method))

        return SimpleNamespace(remote=remote)


def _get(ref: Ref, timeout: float | None = None) -> Any:
    if isinstance(ref.answer, BaseException):
        raise ref.answer
    return ref.answer


def _wait(refs: list[Ref], **_: Any) -> tuple[list[Ref], list[Ref]]:
    return [r for r in refs if r.answer is not UNPLACED], [r for r in refs if r.answer is UNPLACED]


def _kill(handle: FakeAgent, no_restart: bool = True) -> None:
    handle.killed = True


@pytest.fixture
def sup(tmp_path, monkeypatch) -> RaySupervisor:
    """A Ray supervisor of a buffer and a learner (bundle 0) and one server (bundle 1)."""
    for name, fake in (("get", _get), ("wait", _wait), ("kill", _kill)):
        monkeypatch.setattr(ray, name, fake)
    names = ("buffer", "rollout-0", "learner")
    placement = Placement(
        [{"CPU": 1.0}, {"CPU": 1.0}],
        {"buffer": 0, "rollout-0": 1, "learner": 0},
        dict.fromkeys(names, 0.0),
    )
    roles = [Role(n, ["true"]) for n in names]
    # A window shorter than any try: the restart policy alone would never give up.
    policy = RestartPolicy(max_restarts=2, window_s=1e-9, backoff_s=0.0)
    s = RaySupervisor(roles, tmp_path, policy, placement, None, {}, start_timeout_s=60.0)
    (tmp_path / "logs").mkdir()
    s.host = "10.0.0.1"
    return s


def _where(ip: str) -> dict[str, Any]:
    return {"ip": ip, "node_id": f"node-{ip}", "hostname": ip, "shared_run_dir": True}


def test_a_slow_agent_is_asked_again_and_a_lost_one_is_killed(sup):
    role = sup.roles[1]
    slow = FakeAgent(poll=GetTimeoutError("slow"))
    sup.agents[role.name] = Agent(slow, pid=4242)
    for _ in range(SLOW_POLLS - 1):
        assert sup._look_at(role) is None
        assert sup.agents[role.name].handle is slow and not slow.killed
    slow.answers["poll"] = None  # it answers again: its slow polls start over
    assert sup._look_at(role) is None and sup.agents[role.name].slow == 0
    slow.answers["poll"] = GetTimeoutError("slow")
    codes = [sup._look_at(role) for _ in range(SLOW_POLLS)]
    assert codes == [None] * (SLOW_POLLS - 1) + [NODE_LOST]
    # Given up on: killed (its watchdog takes the role), so the restart runs it once.
    assert slow.killed and role.name not in sup.agents and role.last_pid == 4242
    dead = FakeAgent(poll=RayActorError())
    sup.agents[role.name] = Agent(dead, pid=4343)
    assert sup._look_at(role) == NODE_LOST and dead.killed  # dead: at once


def test_stopping_records_each_stopped_roles_exit(sup):
    """A review's SIGTERM to the Ray launcher left no ``exit`` event in launch.jsonl for the
    roles it stopped (the local launcher writes one per role): the agent's answer to
    ``stop`` is its role's exit code and whether it signalled the role; an agent that gives
    none counts as killed. A role that ended on its own just before the stop (a server the
    coordinator told to) was recorded as stopped by the launcher all the same."""
    answers = {
        "buffer": (0, True),
        "rollout-0": RayActorError(),
        "rollout-1": (0, False),  # it had ended on its own
        "learner": (-15, True),
    }
    for pid, (name, answer) in enumerate(answers.items(), 1):
        sup.agents[name] = Agent(FakeAgent(stop=answer), pid=pid)
    sup.agents["idle"] = Agent(FakeAgent(stop=(None, False)))  # no role running: no event
    sup.stop_all(grace_s=0.1)
    events = [json.loads(line) for line in (sup.run_dir / "launch.jsonl").read_text().splitlines()]
    exits = {
        e["role"]: (e["exit_code"], e.get("stopped_by")) for e in events if e["event"] == "exit"
    }
    assert exits == {
        "buffer": (0, "launcher"),
        "rollout-0": (NODE_LOST, "launcher"),
        "rollout-1": (0, None),
        "learner": (-15, "launcher"),
    }, events


def test_bundle_zero_started_on_another_node_ends_the_run_in_one_line(sup, monkeypatch, caplog):
    agents = {
        "learner": FakeAgent(start=11, where=_where("10.0.0.1")),  # where the run meets
        "buffer": FakeAgent(start=12, where=_where("10.0.0.9")),  # re-placed elsewhere
    }
    monkeypatch.setattr(
        sup, "agent", lambda r: sup.agents.setdefault(r.name, Agent(agents[r.name]))
    )
    learner, buffer = sup.roles[2], sup.roles[0]
    sup.start(learner)
    assert sup._look_at(learner) is None and sup.agents["learner"].pid == 11
    sup.start(buffer)
    code = sup._look_at(buffer)
    assert code == ENDED
    with caplog.at_level(logging.ERROR, logger="asyncrl.launch"):
        assert sup._end(buffer, code, QuietView()) == ENDED
    assert (
        "buffer started on 10.0.0.9, not on 10.0.0.1 (endpoints.host): bundle 0's node was "
        "lost; run the same command again to resume from the last checkpoint"
    ) in caplog.messages
    assert all("stop" in a.calls for a in agents.values())  # every role stopped


def test_a_bundle_that_never_finds_a_node_ends_the_run(sup, monkeypatch, caplog):
    handles: list[FakeAgent] = []

    def agent(r: Role) -> Agent:
        if r.name not in sup.agents:
            handles.append(FakeAgent(start=UNPLACED))
            sup.agents[r.name] = Agent(handles[-1])
        return sup.agents[r.name]

    monkeypatch.setattr(sup, "agent", agent)
    role = sup.roles[1]
    ends = []
    for _ in range(sup.policy.max_restarts + 1):
        sup.start(role)
        sup.agents[role.name].since -= sup.start_timeout_s + 1  # each try waited it out
        code = sup._look_at(role)
        assert code is not None
        with caplog.at_level(logging.ERROR, logger="asyncrl.launch"):
            ends.append(sup._end(role, code, QuietView()))
    assert ends == [None] * sup.policy.max_restarts + [ENDED]
    assert all(h.killed for h in handles) and not sup.agents
    line = "rollout-0: bundle 1 ({'CPU': 1.0}) found no node in 3 tries of launch.ray."
    assert any(m.startswith(line) for m in caplog.messages), caplog.messages


# ---------------------------------------------------------------- before Ray is joined


@pytest.fixture
def inputs(tmp_path) -> list[str]:
    """A config that passes the launcher's checks (the roles never start)."""
    return launch_inputs(tmp_path)


def _never(address: str) -> None:
    raise AssertionError(f"joined Ray at {address}")


@pytest.mark.timeout(60)
def test_a_ray_launch_refuses_a_run_directory_another_launch_holds(inputs, monkeypatch, capsys):
    """A review's second --ray launch wrote over the first one's config.yaml."""
    monkeypatch.setattr(ray_main, "connect", _never)
    held = hold_run_dir(run_dir(load_config(inputs[0], inputs[1:])))
    try:
        assert main([*inputs, "--ray"]) == 2
    finally:
        held.close()
    assert "in use by another asyncrl-launch" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_ray_address_nobody_answers_is_refused_in_one_line(inputs, capsys):
    """A review's launch hung in ray.init, retrying with only Ray's warnings."""
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    assert main([*inputs, "--ray", f"launch.ray.address={address}"]) == 2
    assert time.monotonic() - start < 10
    assert (
        f"asyncrl-launch: no Ray cluster at {address}: start one with `ray start --head`, or "
        "use launch.ray.address=auto\n"
    ) in capsys.readouterr().err


def test_only_a_cluster_address_is_probed():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert cluster_problem(f"127.0.0.1:{port}") is None
        assert cluster_problem(f"ray://127.0.0.1:{port}") is None
    assert cluster_problem(f"ray://127.0.0.1:{port}", timeout_s=1.0) is not None
    assert cluster_problem("auto") is None and cluster_problem("local") is None


def test_auto_never_joins_another_launchs_private_ray_instance(monkeypatch):
    """Found by a review: Ray's own ``address="auto"`` joins any Ray instance it finds
    running, another launch's private one included, and that launch's end
    (``ray.shutdown()``) took this run's actors with it. ``auto`` now gives Ray no address:
    ``RAY_ADDRESS``, the last ``ray start`` cluster, else a new local instance."""
    import ray

    from asyncrl.launch.ray_main import connect

    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    connect("auto")
    connect("10.1.2.3:6379")
    assert calls[0].get("address") is None
    assert calls[1]["address"] == "10.1.2.3:6379"


def test_the_rollout_servers_are_stopped_first_as_under_the_local_launcher(sup, monkeypatch):
    """Found by a review: the Ray launcher stopped every role at once, so a server's leave
    and its last groups met a coordinator and a buffer already going; the local launcher
    stops the servers first, for up to half the grace."""
    order: list[str] = []

    class Ordered(FakeAgent):
        def __init__(self, name: str) -> None:
            super().__init__(stop=(0, True))
            self.name = name

        def __getattr__(self, method: str) -> SimpleNamespace:
            if method == "stop":
                order.append(self.name)
            return super().__getattr__(method)

    def waits(refs: list[Ref], **kw: Any) -> tuple[list[Ref], list[Ref]]:
        order.append(f"wait {kw.get('timeout')}")
        return _wait(refs)

    monkeypatch.setattr(ray, "wait", waits)
    for pid, name in enumerate(("buffer", "rollout-0", "learner", "rollout-1"), 1):
        sup.agents[name] = Agent(Ordered(name), pid=pid)
    sup.stop_all(grace_s=10.0)
    assert order[:3] == ["rollout-0", "rollout-1", "wait 5.0"], order
    assert sorted(order[3:5]) == ["buffer", "learner"] and order[5].startswith("wait "), order


def test_ray_by_the_flag_reads_every_rule_as_the_backend_does(inputs, capsys, monkeypatch):
    """Found by a review: ``launch.nice`` is refused under ``launch.backend=ray`` (Ray's
    roles get cores of their own), but ``--ray`` over the local backend passed it, and the
    roles ran without it while ``commands.txt`` said ``# nice``."""
    from asyncrl.launch import ray_main

    monkeypatch.setattr(ray_main, "main_ray", lambda cfg: 0)  # passed: no cluster started
    with pytest.raises(SystemExit) as ended:
        main([*inputs, "--ray", "launch.nice.learner=10"])
    assert ended.value.code == 2
    assert "launch.nice applies to the local launcher" in capsys.readouterr().err
