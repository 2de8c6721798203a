"""A ``Leave`` the coordinator cannot answer yet (the learner, whose coordinator it is, is
restarting) is sent again until the coordinator answers: a rollout server that died during
the restart then stops holding the resumed coordinator's dealing at once, instead of after
``control.dead_after_s``. A late one about an earlier incarnation leaves the restarted
server registered. One never answered is given up after ``give_up_s``, and nothing is sent
after that. Every try and wait goes without blocking the supervisor that polls. And a
coordinator that itself did not run (its learner paused) does not count the servers'
silence over that gap against them."""

from __future__ import annotations

import time

import pytest
import zmq

from asyncrl.control import Coordinator
from asyncrl.control import messages as m
from asyncrl.control.admission import Budget
from asyncrl.control.client import CoordinatorClient
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource
from asyncrl.launch.departures import Departures
from asyncrl.tasks import make_row
from tests.helpers import free_port, wait_until

TRY_S = 1.0  # one try's wait for the reply: the coordinator comes back after a few


def _state(heartbeat_s: float = 0.5, dead_after_s: float = 60.0) -> ControlState:
    """A fresh coordinator's state over 20 sums."""
    rows = [
        make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(20)
    ]
    return ControlState(
        TaskLedger(TaskSource(rows, [], seed=1, n=2), Budget(1, 4)),
        SyncBook(),
        heartbeat_s=heartbeat_s,
        dead_after_s=dead_after_s,
        store_host="127.0.0.1",
        store_port=1,
    )


def _resumed_state() -> ControlState:
    """A coordinator's state restored from a checkpoint that knew rollout-0 and rollout-1:
    it deals nothing until both registered again or left (or ``dead_after_s``, 60 s)."""
    st = _state()
    st.recovery.restored(["rollout-0", "rollout-1"], with_buffer=False)
    return st


def _polled(dep: Departures, seconds: float) -> tuple[list[dict], float]:
    """Poll as the supervisor does for ``seconds``: the outcomes and the longest poll."""
    out: list[dict] = []
    longest, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        out.extend(dep.poll())
        longest = max(longest, time.monotonic() - start)
        time.sleep(0.05)
    return out, longest


@pytest.mark.parametrize("restarted_first", [False, True])
def test_a_leave_sent_while_the_coordinator_is_down_reaches_it_when_it_comes_back(
    restarted_first: bool,
):
    """rollout-0 (pid 4242) died while the learner restarted. ``restarted_first``: its next
    incarnation (pid 4243) registered with the resumed coordinator before the Leave came."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    dep = Departures(addr, timeout_s=TRY_S)
    coord = None
    try:
        dep.send("rollout-0", 4242, "killed by SIGKILL")
        early, longest = _polled(dep, 2.5 * TRY_S)  # the coordinator is down: no answer
        assert early == []  # given up after one try before the mend
        assert longest < 0.5  # a try or a retry never holds the supervisor up
        st = _resumed_state()
        now = time.monotonic()
        st.register(m.Register(server_id="rollout-1", pid=7), now)
        if restarted_first:
            st.register(m.Register(server_id="rollout-0", pid=4243), now)
        else:
            assert st.grant("rollout-1", 4, now).reason == "starting"  # held for rollout-0
        coord = Coordinator(st, tasks_addr="tcp://127.0.0.1:*", control_addr=addr).start()
        out: list[dict] = []
        wait_until(lambda: out.extend(dep.poll()) or out, "the Leave's answer", 10.0)
    finally:
        dep.close()
        if coord is not None:
            coord.stop()
    [outcome] = out
    assert outcome["server_id"] == "rollout-0" and outcome["pid"] == 4242
    assert outcome["ok"] and outcome["tries"] >= 2 and "why" not in outcome
    assert dep.counts == {"sent": 1}
    if restarted_first:  # about the dead incarnation: ignored
        assert st.servers["rollout-0"].pid == 4243
    else:  # the resume waits no longer for it, and deals
        assert "rollout-0" not in st.servers and not st.recovery.awaiting
        assert st.grant("rollout-1", 4, time.monotonic()).tasks


def test_an_unanswered_leave_is_given_up_after_the_bound_and_never_sent_after():
    port = free_port()
    give_up_s = 2.5 * TRY_S
    dep = Departures(f"tcp://127.0.0.1:{port}", timeout_s=TRY_S, give_up_s=give_up_s)
    ctx = zmq.Context()
    late = ctx.socket(zmq.REP)
    try:
        start = time.monotonic()
        dep.send("rollout-1", 7, "exit code 4")
        out, longest = _polled(dep, give_up_s + 2 * TRY_S)
        assert longest < 0.5  # a try or a retry never holds the supervisor up
        [outcome] = out
        assert not outcome["ok"] and "no reply" in outcome["why"]
        assert 2 <= outcome["tries"] <= 3, outcome  # one per TRY_S until give_up_s
        assert outcome["launch/leaves/failed"] == 1.0 and dep.counts == {"failed": 1}
        assert time.monotonic() - start >= give_up_s
        late.bind(f"tcp://127.0.0.1:{port}")  # a coordinator that comes back afterwards
        after, _ = _polled(dep, 1.5 * TRY_S)
        assert after == [] and not late.poll(0)  # nothing more was sent
    finally:
        dep.close()
        late.close(0)
        ctx.term()


def test_a_coordinator_that_did_not_run_does_not_declare_live_servers_dead():
    """The coordinator's process paused (a stopped or starved learner) for longer than
    control.dead_after_s: the servers' heartbeats queued meanwhile may land after its first
    reap, and both live servers were declared dead, their whole window dealt again. Its
    silence is its own: counted from the end of the gap, a server is dead only after
    dead_after_s of silence while the coordinator listens."""
    st = _state(heartbeat_s=0.2, dead_after_s=1.0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    coord = Coordinator(st, tasks_addr="tcp://127.0.0.1:*", control_addr=addr).start()
    try:
        with coord._cond:  # the loop cannot run while this is held
            st.register(m.Register(server_id="rollout-0", pid=7), time.monotonic())
            time.sleep(2.5)  # longer than dead_after_s, and no heartbeat: paused
        time.sleep(0.3)  # a few passes of the loop after the gap
        with coord._cond:
            assert "rollout-0" in st.servers  # not declared dead for the coordinator's gap
            assert coord.metrics()["coordinator/paused"] == 1
        # silence while it listens still counts: dead after dead_after_s
        wait_until(lambda: "rollout-0" not in st.servers, "the dead verdict", 5.0)
    finally:
        coord.stop()


def test_two_threads_told_unregistered_together_register_once():
    """Declared dead, a server's heartbeat thread and its task thread are both told
    "unregistered". Registering again keeps the coordinator's session, so the check on the
    session let both register: the second counted as a restart (its tasks taken back, a
    death counted with no line said). The registration each request was sent under tells."""
    st = _state()
    tasks = f"tcp://127.0.0.1:{free_port()}"
    control = f"tcp://127.0.0.1:{free_port()}"
    coord = Coordinator(st, tasks_addr=tasks, control_addr=control).start()
    client = CoordinatorClient(tasks, control, "rollout-0", engine_world_size=0, timeout_s=5.0)
    try:
        client.register()
        seen = client._registration()  # what both threads' requests were sent under
        with coord._cond:
            st.leave("rollout-0")  # the coordinator forgot it (declared dead)
        assert client.request_tasks(max_tasks=1, wait_s=0.1).reason == "unregistered"
        client._reregister(seen)  # the heartbeat thread, told the same, comes second
        with coord._cond:
            assert st.counts["registrations"] == 2 and st.counts["servers_dead"] == 0
            assert "rollout-0" in st.servers
    finally:
        client.close()
        coord.stop()
