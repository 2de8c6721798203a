"""The end of a run when a rollout server was restarted late: the coordinator left with the
learner, so the restarted server can never register. A review's runs ended 30 s late: the
launcher waited for it as for the servers finishing their work, SIGTERM reached a server
that heard it only between 5 s registration attempts, then it sent a Leave to no one, and
the launcher killed it. Real processes and 127.0.0.1 sockets, no vLLM."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from asyncrl.control.client import CoordinatorClient, CoordinatorGone
from asyncrl.launch import startup, supervise
from asyncrl.launch.supervise import QuietView, RestartPolicy, Role, Supervisor
from rollout_servers import main as rollout_main
from tests.helpers import free_port

# A server that registered: it finishes its work a while after the learner is done.
REGISTERED = r"""
import sys, time
from pathlib import Path
from asyncrl.launch import startup
run = Path(sys.argv[1])
startup.mark(run, "rollout-1", "registered")
(run / "rollout-1.up").touch()
while not (run / "learner.done").exists():
    time.sleep(0.05)
time.sleep(1.0)
"""
NEVER_REGISTERED = "import time; time.sleep(60)"  # a restart still looking for the coordinator
LEARNER = r"""
import sys, time
from pathlib import Path
run = Path(sys.argv[1])
while not (run / "rollout-1.up").exists():
    time.sleep(0.05)
(run / "learner.done").touch()
"""


@pytest.mark.timeout(60)
def test_a_server_that_never_registered_is_stopped_at_once_at_the_end(tmp_path, monkeypatch):
    """The learner exits 0: rollout-0 (whose only ``registered`` mark is an earlier
    attempt's) is stopped at once, rollout-1 (registered) is left to finish on its own."""
    monkeypatch.setattr(supervise, "AFTER_LEARNER_S", 20.0)
    monkeypatch.setattr(supervise, "POLL_S", 0.1)
    earlier = {"role": "rollout-0", "event": "registered", "t": time.time() - 60}
    (tmp_path / startup.STARTUP_FILE).write_text(json.dumps(earlier) + "\n")
    (tmp_path / "logs").mkdir()
    roles = [
        Role(name, [sys.executable, "-c", code, str(tmp_path)], server_id=server_id)
        for name, code, server_id in (
            ("rollout-0", NEVER_REGISTERED, "rollout-0"),
            ("rollout-1", REGISTERED, "rollout-1"),
            ("learner", LEARNER, None),
        )
    ]
    sup = Supervisor(roles, tmp_path, RestartPolicy())
    try:
        sup.start_all()
        start = time.monotonic()
        assert sup.run(QuietView()) == 0
        took = time.monotonic() - start
    finally:
        sup.close()
    exits = {
        e["role"]: (e["exit_code"], e.get("stopped_by"))
        for e in map(json.loads, (tmp_path / "launch.jsonl").read_text().splitlines())
        if e["event"] == "exit"
    }
    # rollout-0 stopped by the launcher's SIGTERM; rollout-1 finished on its own, and its
    # exit, recorded as the launcher reaps it, says so (it said "stopped_by: launcher").
    assert exits == {"rollout-0": (-15, "launcher"), "rollout-1": (0, None), "learner": (0, None)}
    assert took < 10.0, f"the run ended {took:.1f}s after its start"


@pytest.mark.timeout(30)
def test_a_registration_hears_sigterm_at_once():
    """No coordinator: SIGTERM (``shutdown``) during a 5 s registration attempt ends the
    registration within a fraction of a second, not at the attempt's end."""
    addr = f"tcp://127.0.0.1:{free_port()}"  # nothing listens
    client = CoordinatorClient(addr, addr, "rollout-0", engine_world_size=0, timeout_s=5.0)
    failed: list[BaseException] = []

    def register() -> None:
        try:
            client.register(wait_s=30.0)
        except CoordinatorGone as e:
            failed.append(e)

    try:
        attempt = threading.Thread(target=register)
        attempt.start()
        time.sleep(0.5)
        client.shutdown.set()
        stopped = time.monotonic()
        attempt.join(10)
        assert time.monotonic() - stopped < 1.0
        assert failed, "the registration did not give up"
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_a_server_that_never_registered_sends_no_leave():
    """A Leave from a server that never registered costs a timeout waiting for a
    coordinator that is gone (the launcher's grace ran out, then SIGKILL); it has nothing
    to leave. The stand-in coordinator counts the requests it gets, answering none."""
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(addr)
    client = CoordinatorClient(addr, addr, "rollout-0", engine_world_size=0, timeout_s=1.0)
    client.shutdown.set()  # SIGTERM before it registered

    class Pusher:
        def close(self, linger_s: float) -> None:
            pass

    try:
        asyncio.run(rollout_main._leave_and_close(client, Pusher()))
        assert not silent.poll(500), "a Leave was sent"
    finally:
        client.close()
        silent.close()


@pytest.mark.timeout(30)
def test_a_registration_the_coordinator_answers_after_the_sigterm_is_left_again():
    """The stand-in coordinator registers the server but answers after its SIGTERM: the
    server gives the registration up (it never registered, so it sends no Leave), and the
    registration's own thread, reading the late ``Registered``, tells the coordinator the
    server left. Before, the coordinator kept a ghost until ``control.dead_after_s``."""
    from asyncrl.control import messages as m

    ctx = zmq.Context.instance()
    coordinator = ctx.socket(zmq.ROUTER)
    coordinator.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    coordinator.bind(addr)
    client = CoordinatorClient(addr, addr, "rollout-0", engine_world_size=0, timeout_s=5.0)
    threading.Timer(0.3, client.shutdown.set).start()  # SIGTERM while the reply is due
    got: list[object] = []

    def serve() -> None:
        while coordinator.poll(5000):
            *route, frame = coordinator.recv_multipart()
            request = m.decode_request(frame)
            got.append(request)
            if isinstance(request, m.Register):
                time.sleep(1.0)  # busy: the reply comes after the SIGTERM
                reply = m.Registered(
                    server_id=request.server_id,
                    session="s1",
                    policy_version=0,
                    sync_store_host="",
                    sync_store_port=0,
                    generation="",
                    heartbeat_s=0.2,
                    dead_after_s=3,
                    catchup=False,
                )
            else:
                reply = m.Ok()
            coordinator.send_multipart([*route, m.encode(reply)])
            if isinstance(request, m.Leave):
                return

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with pytest.raises(CoordinatorGone):
            client.register()
        assert client.registered is None  # the server believes it never registered
        server.join(10)
        assert [type(r).__name__ for r in got] == ["Register", "Leave"]
    finally:
        client.close()
        coordinator.close()


def test_marked_since_ignores_an_earlier_attempts_mark(tmp_path: Path):
    startup.mark(tmp_path, "rollout-0", "registered")
    now = time.time()
    assert startup.marked_since(tmp_path, "rollout-0", "registered", now - 60)
    assert not startup.marked_since(tmp_path, "rollout-0", "registered", now + 1)
    assert not startup.marked_since(tmp_path, "rollout-1", "registered", now - 60)


SLOW_TO_STOP = (
    "import signal, time\nsignal.signal(signal.SIGTERM, lambda *a: None)\ntime.sleep(1.5)\n"
)


@pytest.mark.timeout(60)
def test_a_role_that_ends_while_the_servers_stop_is_not_recorded_as_stopped(tmp_path):
    """The stop takes the learner and the buffer as they are once the servers' wait is
    over: a buffer that ended on its own meanwhile is neither signalled nor recorded as
    stopped by the launcher (it was, from the list taken before that wait)."""
    (tmp_path / "logs").mkdir()
    roles = [
        Role("rollout-0", [sys.executable, "-c", SLOW_TO_STOP], server_id="rollout-0"),
        Role("buffer", [sys.executable, "-c", "import time; time.sleep(0.7)"]),
    ]
    sup = Supervisor(roles, tmp_path, RestartPolicy())
    try:
        sup.start_all()
        time.sleep(0.3)  # both running
        sup.stop_all(grace_s=6.0)
    finally:
        sup.close()
    exits = {
        e["role"]: (e["exit_code"], e.get("stopped_by"))
        for e in map(json.loads, (tmp_path / "launch.jsonl").read_text().splitlines())
        if e["event"] == "exit"
    }
    assert exits == {"rollout-0": (0, "launcher"), "buffer": (0, None)}
