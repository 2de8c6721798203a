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


def _exits(run: Path) -> dict[str, tuple[int, str | None]]:
    """Each role's exit in ``launch.jsonl``: (exit code, who stopped it)."""
    return {
        e["role"]: (e["exit_code"], e.get("stopped_by"))
        for e in map(json.loads, (run / "launch.jsonl").read_text().splitlines())
        if e["event"] == "exit"
    }


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
    exits = _exits(tmp_path)
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
    got: list[object] = []

    def serve() -> None:
        while coordinator.poll(5000):
            *route, frame = coordinator.recv_multipart()
            request = m.decode_request(frame)
            got.append(request)
            if isinstance(request, m.Register):
                client.shutdown.set()  # SIGTERM while the reply is due
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


# A server that hears SIGTERM but ends 1.5 s later; it says so once its handler is in.
SLOW_TO_STOP = r"""
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, lambda *a: None)
(Path(sys.argv[1]) / "handler.up").touch()
time.sleep(1.5)
"""
# A buffer that ends on its own 0.7 s after the server's handler is in.
ENDS_SOON = r"""
import sys, time
from pathlib import Path
while not (Path(sys.argv[1]) / "handler.up").exists():
    time.sleep(0.02)
time.sleep(0.7)
"""


@pytest.mark.timeout(60)
def test_a_role_that_ends_while_the_servers_stop_is_not_recorded_as_stopped(tmp_path):
    """The stop takes the learner and the buffer as they are once the servers' wait is
    over: a buffer that ended on its own meanwhile is neither signalled nor recorded as
    stopped by the launcher (it was, from the list taken before that wait)."""
    (tmp_path / "logs").mkdir()
    roles = [
        Role(
            "rollout-0", [sys.executable, "-c", SLOW_TO_STOP, str(tmp_path)], server_id="rollout-0"
        ),
        Role("buffer", [sys.executable, "-c", ENDS_SOON, str(tmp_path)]),
    ]
    sup = Supervisor(roles, tmp_path, RestartPolicy())
    try:
        sup.start_all()
        deadline = time.monotonic() + 30
        while not (tmp_path / "handler.up").exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # both running, the server's SIGTERM handler in
        sup.stop_all(grace_s=6.0)
    finally:
        sup.close()
    exits = _exits(tmp_path)
    assert exits == {"rollout-0": (0, "launcher"), "buffer": (0, None)}


def _server_and_learner(
    tmp_path: Path, monkeypatch, server: str, learner: str, policy: RestartPolicy
) -> list[dict]:
    """Supervise rollout-0 and the learner, each running a script given the run directory,
    to the run's end (which must be 0); the launch's events."""
    monkeypatch.setattr(supervise, "AFTER_LEARNER_S", 1.0)
    monkeypatch.setattr(supervise, "POLL_S", 0.1)
    (tmp_path / "logs").mkdir()
    roles = [
        Role("rollout-0", [sys.executable, "-c", server, str(tmp_path)], server_id="rollout-0"),
        Role("learner", [sys.executable, "-c", learner, str(tmp_path)]),
    ]
    sup = Supervisor(roles, tmp_path, policy)
    try:
        sup.start_all()
        assert sup.run(QuietView()) == 0
    finally:
        sup.close()
    return [json.loads(line) for line in (tmp_path / "launch.jsonl").read_text().splitlines()]


# A hung learner: its coordinator came up, then its process stopped answering. Its second
# start ends the run once the restarted server is back.
HUNG_LEARNER = r"""
import sys, time
from pathlib import Path
from asyncrl.launch import startup
run = Path(sys.argv[1])
if not (run / "learner.1").exists():
    startup.mark(run, "learner", "coordinator_up")  # before the server may give up
    (run / "learner.1").touch()
    time.sleep(60)  # hung: nothing answers
while not (run / "rollout-0.2").exists():
    time.sleep(0.05)
"""
# A server that registered, then heard nothing for its patience: exit 3 (coordinator gone).
GAVE_UP = r"""
import sys, time
from pathlib import Path
from asyncrl.launch import startup
run = Path(sys.argv[1])
while not (run / "learner.1").exists():  # it registers once the coordinator is up
    time.sleep(0.05)
startup.mark(run, "rollout-0", "registered")
if not (run / "rollout-0.1").exists():
    (run / "rollout-0.1").touch()
    sys.exit(3)
(run / "rollout-0.2").touch()
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_hung_learner_is_named_and_restarted_when_a_server_gives_up_on_it(tmp_path, monkeypatch):
    """Found by a hang hunt: a learner that stopped answering was never named; the servers
    that gave up on its coordinator (exit 3) were restarted until their restarts ran out,
    and the run failed naming a server. Now a registered server's exit 3 while the learner,
    its coordinator up, still runs, kills the learner for a restart."""
    policy = RestartPolicy(backoff_s=0.1)
    events = _server_and_learner(tmp_path, monkeypatch, GAVE_UP, HUNG_LEARNER, policy)
    hung = [e for e in events if e["event"] == "hung"]
    assert len(hung) == 1 and hung[0]["role"] == "learner" and hung[0]["told_by"] == "rollout-0"
    starts = [e["role"] for e in events if e["event"] == "start"]
    assert starts.count("learner") == 2 and starts.count("rollout-0") == 2


@pytest.mark.timeout(60)
def test_a_learner_still_loading_or_a_server_that_never_registered_is_left_alone(tmp_path):
    """A server's exit 3 also comes from a coordinator it never reached (a wrong address),
    and from a learner still loading a big model past the server's patience: neither is
    a hung learner, and the learner keeps running."""
    (tmp_path / "logs").mkdir()
    server = Role("rollout-0", [sys.executable, "-c", "pass"], server_id="rollout-0")
    learner = Role("learner", [sys.executable, "-c", "import time; time.sleep(30)"])
    sup = Supervisor([server, learner], tmp_path, RestartPolicy())
    try:
        sup.start_all()
        sup._learner_hung(server)  # neither mark: left alone
        startup.mark(tmp_path, "rollout-0", "registered")
        sup._learner_hung(server)  # the learner's coordinator never came up: still loading
        time.sleep(0.5)  # a kill would have landed by now
        assert learner.proc is not None and learner.proc.poll() is None
        assert '"hung"' not in (tmp_path / "launch.jsonl").read_text()
        startup.mark(tmp_path, "learner", "coordinator_up")
        sup._learner_hung(server)
        assert learner.proc.wait(10) == -9  # hung: killed for a restart
    finally:
        sup.close()


# A server that registered, then gave up on the coordinator (exit 3), at once, every start.
GIVES_UP = r"""
import sys
from pathlib import Path
from asyncrl.launch import startup
run = Path(sys.argv[1])
startup.mark(run, "rollout-0", "registered")
with open(run / "gave_up", "a") as f:
    f.write("x")
sys.exit(3)
"""
# A learner that loads (never marks coordinator_up) until the server gave up four times
# (three restarts, more than max_restarts), then ends 0.
LOADING = r"""
import sys, time
from pathlib import Path
gave_up = Path(sys.argv[1]) / "gave_up"
deadline = time.monotonic() + 40
while time.monotonic() < deadline:
    if gave_up.exists() and len(gave_up.read_text()) >= 4:
        break
    time.sleep(0.05)
"""


@pytest.mark.timeout(60)
def test_servers_that_give_up_on_a_loading_learner_are_not_out_of_restarts(tmp_path, monkeypatch):
    """Found by a review: a learner loading past the servers' patience (its coordinator
    not up in its current start) had them exit 3 again and again, each exit counted among
    their restarts in a row, and the run failed naming a server after max_restarts, while
    the learner only loaded. Those restarts are not counted now."""
    monkeypatch.setattr(supervise, "POLL_S", 0.1)
    (tmp_path / "logs").mkdir()
    roles = [
        Role("rollout-0", [sys.executable, "-c", GIVES_UP, str(tmp_path)], server_id="rollout-0"),
        Role("learner", [sys.executable, "-c", LOADING, str(tmp_path)]),
    ]
    sup = Supervisor(roles, tmp_path, RestartPolicy(max_restarts=1, backoff_s=0.1))
    try:
        sup.start_all()
        assert sup.run(QuietView()) == 0
    finally:
        sup.close()
    events = [json.loads(line) for line in (tmp_path / "launch.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "gave_up"]
    restarts = [e for e in events if e["event"] == "restart" and e["role"] == "rollout-0"]
    assert len(restarts) >= 3 and all(e.get("learner_loading") for e in restarts)
    assert not [e for e in events if e["event"] == "hung"]


def test_a_learner_that_exited_or_awaits_its_restart_is_not_serving(tmp_path):
    """Seen in CI: the learner ended while a server gave up on it (exit 3), and that exit,
    looked at before the learner's, used the server's last restart. A learner that has
    exited (its exit not yet looked at) or waits for its restart does not serve either;
    one whose coordinator came up in its current start does."""
    (tmp_path / "logs").mkdir()
    learner = Role("learner", [sys.executable, "-c", "import time; time.sleep(30)"])
    sup = Supervisor([learner], tmp_path, RestartPolicy())
    try:
        assert not sup._learner_loading()  # never started, no restart due
        sup.start(learner)
        assert sup._learner_loading()  # loading: no coordinator_up yet
        startup.mark(tmp_path, "learner", "coordinator_up")
        assert not sup._learner_loading()
        assert learner.proc is not None
        learner.proc.kill()
        learner.proc.wait(10)
        assert sup._learner_loading()  # exited, not yet reaped here
        sup.reap(learner)
        learner.restart_at = time.monotonic() + 60
        assert sup._learner_loading()  # waiting for its restart
    finally:
        sup.close()


# A learner whose first start crashes once a server registered with it; its second start
# comes up and ends the run once the server is back.
CRASHES_ONCE = r"""
import sys, time
from pathlib import Path
from asyncrl.launch import startup
run = Path(sys.argv[1])
startup.mark(run, "learner", "coordinator_up")
if not (run / "learner.1").exists():
    (run / "learner.1").touch()
    while not (run / "rollout-0.1").exists():
        time.sleep(0.05)
    sys.exit(1)
(run / "learner.2").touch()
while not (run / "rollout-0.2").exists():
    time.sleep(0.05)
"""
# A server registered with the first learner that gives up on it (exit 3) through its
# restart, its exit reaching the launcher after the second learner's coordinator came up.
OUTLASTED = r"""
import sys, time
from pathlib import Path
from asyncrl.launch import startup
run = Path(sys.argv[1])
if not (run / "rollout-0.1").exists():
    while not (run / "learner.1").exists():
        time.sleep(0.05)
    startup.mark(run, "rollout-0", "registered")
    (run / "rollout-0.1").touch()
    while not (run / "learner.2").exists():
        time.sleep(0.05)
    time.sleep(0.3)
    sys.exit(3)
startup.mark(run, "rollout-0", "registered")
(run / "rollout-0.2").touch()
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_server_that_gave_up_through_a_learner_restart_does_not_get_the_new_one_killed(
    tmp_path, monkeypatch
):
    """Found by a review: a server registered with a learner that crashed gave up on it
    (exit 3) through its restart and load, and its exit reached the launcher just after
    the new learner's coordinator came up. Both marks the hang check reads were there (the
    server's registration, with the old learner), so the new, healthy learner was killed
    as hung. Only a registration with the learner running now tells of a hang; the
    server's restart is not counted."""
    policy = RestartPolicy(backoff_s=0.1)
    events = _server_and_learner(tmp_path, monkeypatch, OUTLASTED, CRASHES_ONCE, policy)
    assert not [e for e in events if e["event"] == "hung"]
    starts = [e["role"] for e in events if e["event"] == "start"]
    assert starts.count("learner") == 2 and starts.count("rollout-0") == 2
    (restart,) = [e for e in events if e["event"] == "restart" and e["role"] == "rollout-0"]
    assert restart["exit_code"] == 3 and restart.get("learner_loading")


# A learner that records the run's ending, then closes its metrics (a W&B upload) until
# the server's crash in its teardown is past.
ENDS_SLOWLY = r"""
import sys, time
from pathlib import Path
from asyncrl.config.ending import mark_ended
run = Path(sys.argv[1])
while not (run / "rollout-0.2").exists():
    time.sleep(0.05)
mark_ended(run, 10)
while not (run / "rollout-0.crashed").exists():
    time.sleep(0.05)
time.sleep(1.0)
"""
# A server that crashes early (its one restart used), then in its teardown at the end.
CRASHES_AT_THE_END = r"""
import sys, time
from pathlib import Path
run = Path(sys.argv[1])
if not (run / "rollout-0.1").exists():
    (run / "rollout-0.1").touch()
    sys.exit(1)
(run / "rollout-0.2").touch()
while not (run / "complete.json").exists():
    time.sleep(0.05)
(run / "rollout-0.crashed").touch()
sys.exit(1)
"""


@pytest.mark.timeout(60)
def test_a_server_crashing_after_the_ending_is_recorded_does_not_fail_the_run(
    tmp_path, monkeypatch
):
    """Found by a review: a rollout server that crashed in its teardown after the learner
    recorded the run's ending, its restarts used up, failed the complete run (exit 1) and
    had the learner stopped in its metrics' close; with restarts left, it was restarted
    into a run that ends. It is let go, as a buffer is: the learner's exit decides."""
    policy = RestartPolicy(max_restarts=1, backoff_s=0.1)
    events = _server_and_learner(tmp_path, monkeypatch, CRASHES_AT_THE_END, ENDS_SLOWLY, policy)
    assert not [e for e in events if e["event"] == "gave_up"]
    assert [e["role"] for e in events if e["event"] == "start"].count("rollout-0") == 2
    assert [e for e in events if e.get("after_ending")][0]["exit_code"] == 1
    learner_exit = [e for e in events if e["event"] == "exit" and e["role"] == "learner"]
    assert learner_exit and learner_exit[0]["exit_code"] == 0
