"""The launcher tells the coordinator at once that a rollout server died: the coordinator
honours a ``Leave`` only for the incarnation it names (a restarted server that registered
first keeps its record), the launcher's sender never waits (an absent coordinator costs a
logged, counted failure), and the supervisor sends one for a reaped rollout server, with the
pid of the process that died, and records the answer in ``launch.jsonl``. A stopped launch
signals its rollout servers before the coordinator and the buffer go."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

from asyncrl.control import messages as m
from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource
from asyncrl.launch.departures import Departures
from asyncrl.launch.process_tree import has_exited
from asyncrl.launch.supervise import QuietView, RestartPolicy, Role, Supervisor
from asyncrl.tasks import make_row
from asyncrl.wire.base import encode
from tests.helpers import wait_until


def _state() -> ControlState:
    rows = [
        make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(20)
    ]
    return ControlState(
        TaskLedger(TaskSource(rows, [], seed=1, n=2), Budget(1, 4)),
        SyncBook(),
        heartbeat_s=0.5,
        dead_after_s=8.0,
        store_host="127.0.0.1",
        store_port=1,
    )


def test_a_leave_for_an_earlier_incarnation_is_ignored():
    st = _state()
    st.register(m.Register(server_id="a", pid=100), now=0.0)
    st.register(m.Register(server_id="b", pid=200), now=0.0)
    held = [t.task_id for t in st.grant("a", 4, 0.1).tasks]
    assert held
    # "a" died and restarted as pid 101, which registered before the launcher's Leave came.
    st.register(m.Register(server_id="a", pid=101), now=0.2)
    again = [t.task_id for t in st.grant("b", 8, 0.3).tasks]
    assert set(held) <= set(again)  # the restart gave the old tasks back
    mine = [t.task_id for t in st.grant("a", 4, 0.4).tasks]
    assert not st.leave("a", pid=100)  # about the dead incarnation: ignored
    assert st.servers["a"].pid == 101
    assert st.leave("a", pid=101)  # the registered one: gone, its tasks dealt again at once
    assert "a" not in st.servers
    assert set(mine) <= {t.task_id for t in st.grant("b", 16, 0.5).tasks}
    assert st.leave("a", pid=101) and st.leave("zzz")  # unknown: nothing to do


def _coordinator(ctx: zmq.Context, got: list[m.Leave]) -> tuple[str, threading.Thread]:
    """A stand-in control socket that answers one request Ok and keeps it."""
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        if sock.poll(10_000):
            msg = m.decode_request(sock.recv())
            assert isinstance(msg, m.Leave)
            got.append(msg)
            sock.send(encode(m.Ok()))
        sock.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


def _wait_outcome(dep: Departures, timeout_s: float = 10.0) -> dict:
    out: list[dict] = []
    wait_until(
        lambda: out.extend(dep.poll()) or out, "the Leave's outcome", timeout_s, every_s=0.05
    )
    return out[0]


def test_departures_send_the_pid_and_collect_the_answer():
    ctx = zmq.Context()
    got: list[m.Leave] = []
    addr, thread = _coordinator(ctx, got)
    dep = Departures(addr)
    try:
        dep.send("rollout-0", 4242, "killed by SIGKILL")
        outcome = _wait_outcome(dep)
    finally:
        dep.close()
        thread.join(5)
        ctx.term()
    assert got == [m.Leave(server_id="rollout-0", reason="killed by SIGKILL", pid=4242)]
    assert outcome == {
        "server_id": "rollout-0",
        "pid": 4242,
        "ok": True,
        "tries": 1,
        "launch/leaves/sent": 1.0,
    }


def test_an_absent_coordinator_costs_a_counted_failure_and_no_wait():
    with zmq.Context() as ctx:  # a port nothing listens on
        probe = ctx.socket(zmq.REP)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(0)
    dep = Departures(f"tcp://127.0.0.1:{port}", timeout_s=2.0, give_up_s=0.0)  # one try
    try:
        start = time.monotonic()
        dep.send("rollout-1", 7, "exit code 4")
        # The supervisor is not held up: a send that waited for its reply would take the
        # whole 2 s timeout; half of it leaves a loaded machine room and tells them apart.
        assert time.monotonic() - start < 1.0
        outcome = _wait_outcome(dep)
    finally:
        dep.close()
    assert not outcome["ok"] and "no reply" in outcome["why"] and outcome["tries"] == 1
    assert outcome["launch/leaves/failed"] == 1.0 and dep.counts == {"failed": 1}


class _Recorder:
    """Departures stand-in: keeps what was sent, answers every one as told."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, str]] = []

    def send(self, server_id: str, pid: int, reason: str) -> None:
        self.sent.append((server_id, pid, reason))

    def poll(self) -> list[dict]:
        done = [{"server_id": s, "pid": p, "ok": True} for s, p, _ in self.sent]
        self.sent.clear()
        return done

    def close(self) -> None:
        pass


def test_the_supervisor_tells_of_a_dead_rollout_server_with_its_pid(tmp_path: Path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = Role("rollout-0", sleeper, server_id="rollout-0")
    buffer = Role("buffer", sleeper)
    sup = Supervisor([buffer, server], tmp_path, RestartPolicy(backoff_s=30.0))
    rec = _Recorder()
    sup.departures = rec  # type: ignore[assignment]  # the stand-in has its interface
    (tmp_path / "logs").mkdir()
    try:
        for role in (buffer, server):
            sup.start(role)
            assert role.proc is not None
        pid, other = server.proc.pid, buffer.proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        os.kill(other, signal.SIGKILL)
        wait_until(lambda: has_exited(pid) and has_exited(other), "both to die")
        for role in (buffer, server):
            code = sup._look_at(role)
            assert code == -signal.SIGKILL
            assert code is not None  # for the type checker
            assert sup._end(role, code, QuietView()) is None  # a restart is due
        assert rec.sent == [("rollout-0", pid, f"its process {pid} ended (killed by SIGKILL)")]
        sup._collect_departures()
    finally:
        sup.close()
    leaves = [
        e
        for e in map(json.loads, (tmp_path / "launch.jsonl").read_text().splitlines())
        if e["event"] == "leave"
    ]
    assert [(e["role"], e["pid"], e["ok"]) for e in leaves] == [("rollout-0", pid, True)]


def test_a_stopped_launch_stops_its_rollout_servers_first(tmp_path: Path):
    """Stopping a launch (Ctrl-C) signals the rollout servers before the learner and the
    buffer: a server then leaves while the coordinator answers and its last groups reach
    a live buffer (both gone at once, each of its waits ran out and it overran the grace).
    Each role here writes the moment SIGTERM reached it, and the server takes 0.5 s to go."""
    code = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1], 'w').write(str(time.time())); time.sleep(float(sys.argv[2]))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n"
    )

    def role(name: str, linger_s: float) -> Role:
        return Role(name, [sys.executable, "-c", code, str(tmp_path / name), str(linger_s)])

    roles = [role("buffer", 0.0), role("rollout-0", 0.5), role("learner", 0.0)]
    sup = Supervisor(roles, tmp_path, RestartPolicy())
    (tmp_path / "logs").mkdir()
    try:
        for r in roles:
            sup.start(r)
        time.sleep(1.0)  # the handlers are installed
        sup.stop_all(grace_s=10.0)
    finally:
        sup.close()
    told = {r.name: float((tmp_path / r.name).read_text()) for r in roles}
    assert told["rollout-0"] + 0.4 <= min(told["buffer"], told["learner"]), told
    events = [json.loads(line) for line in (tmp_path / "launch.jsonl").read_text().splitlines()]
    assert {e["role"]: e["exit_code"] for e in events if e["event"] == "exit"} == {
        "buffer": 0,
        "rollout-0": 0,
        "learner": 0,
    }


def test_a_servers_own_leave_names_its_process():
    """Found by a review: a rollout server's own Leave named no process, so a late one
    (its reply lost, the server restarted meanwhile under the same id) removed the
    restarted server's record; the launcher's Leaves already named theirs."""
    from asyncrl.control.client import CoordinatorClient

    ctx = zmq.Context()
    got: list[m.Leave] = []
    addr, thread = _coordinator(ctx, got)
    client = CoordinatorClient(addr, addr, "rollout-0", engine_world_size=0, context=ctx)
    try:
        assert client.leave("stopped", timeout_s=5.0)
    finally:
        client.close()
        thread.join(5)
        ctx.term()
    assert got[0].pid == os.getpid() and got[0].server_id == "rollout-0"
