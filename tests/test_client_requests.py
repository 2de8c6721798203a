"""The coordinator client's request ids under concurrency: a real Coordinator and a real
CoordinatorClient on 127.0.0.1 sockets, many threads asking at once.

A request id makes a retry idempotent: the coordinator answers a repeated id with the grant
it gave that id. Two concurrent calls that share an id therefore share one grant (two agent
groups carrying one external slot, two tasks loops generating the same task). A stopping
client's calls to a silent coordinator are bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from asyncrl.control import messages as m
from asyncrl.control.client import CoordinatorClient
from tests.helpers import start_coordinator

THREADS = 16
CALLS = 5  # per thread


class Counts:
    """The coordinator's counters read through its public metrics:
    ``counts["tasks/external_dealt"]`` is ``coordinator/tasks/external_dealt`` now."""

    def __init__(self, coord: Any) -> None:
        self._coord = coord

    def __getitem__(self, name: str) -> float:
        return self._coord.metrics().get(f"coordinator/{name}", 0.0)


@pytest.fixture
def served() -> Iterator[tuple[Counts, CoordinatorClient]]:
    """A coordinator with a wide admission window and one registered client."""
    coord = start_coordinator(500, per_version=1000)
    client = CoordinatorClient(
        coord.tasks_addr, coord.control_addr, "rollout-0", engine_world_size=0, timeout_s=10.0
    )
    try:
        client.register()
        yield Counts(coord), client
    finally:
        client.close()
        coord.stop()


def _at_once(call: Callable[[], m.TaskGrant]) -> list[m.TaskGrant]:
    """``CALLS`` calls from each of ``THREADS`` threads, all released together."""
    gate = threading.Barrier(THREADS)
    grants: list[m.TaskGrant] = []
    lock = threading.Lock()

    def worker() -> None:
        gate.wait(30)
        for _ in range(CALLS):
            grant = call()
            with lock:
                grants.append(grant)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request never returned"
    return grants


def test_concurrent_slot_requests_each_get_their_own_slot(served):
    """Agent groups opened at once (each asks in its own thread) never share a slot."""
    state, client = served
    grants = _at_once(client.request_slot)
    ids = [t.task_id for g in grants for t in g.tasks]
    assert len(ids) == THREADS * CALLS, [g.reason for g in grants if not g.tasks]
    assert len(set(ids)) == len(ids), "two slot requests were answered with one slot"
    assert state["tasks/external_dealt"] == len(ids)
    client.ack(ids)  # their groups pushed: counted as the deals were, apart from train's
    assert state["tasks/external_acked"] == len(ids) and state["tasks/train_acked"] == 0


def test_concurrent_task_requests_never_get_the_same_task(served):
    """Task requests from several threads: every dealt task reaches exactly one caller."""
    state, client = served
    grants = _at_once(lambda: client.request_tasks(1, wait_s=0.0))
    ids = [t.task_id for g in grants for t in g.tasks]
    assert ids, [g.reason for g in grants]
    assert len(set(ids)) == len(ids), "two task requests were answered with one grant"
    assert state["grants_resent"] == 0


def _lose_replies(client: CoordinatorClient, lost: list[int]) -> None:
    """The control socket's next ``lost[0]`` replies reach the coordinator's answer and are
    then lost on the way back (the caller sees a timeout)."""
    real = client._sockets.by_name["control"].request_frames

    def request_frames(frames, timeout_s=None):
        reply = real(frames, timeout_s)
        if lost[0] > 0:
            lost[0] -= 1
            raise TimeoutError("reply lost")
        return reply

    client._sockets.by_name["control"].request_frames = request_frames  # type: ignore[method-assign]


def test_a_retried_slot_request_gets_the_slot_its_lost_reply_carried(served):
    """A retry within one call repeats its id: one slot dealt, the caller gets it."""
    state, client = served
    _lose_replies(client, [1])
    grant = client.request_slot(attempts=2)
    assert [t.task_id for t in grant.tasks] and state["tasks/external_dealt"] == 1


def test_an_unanswered_slot_request_is_asked_again_by_the_next_call(served):
    """A call whose every reply was lost gives its id back: the next call gets that slot
    instead of a second one (the first would be charged until the task timeout)."""
    state, client = served
    _lose_replies(client, [2])
    assert client.request_slot(attempts=2).reason == "timeout"
    assert state["tasks/external_dealt"] == 1
    again = client.request_slot(attempts=2)
    assert len(again.tasks) == 1 and state["tasks/external_dealt"] == 1
    fresh = client.request_slot(attempts=2)
    assert fresh.tasks[0].task_id != again.tasks[0].task_id
    assert state["tasks/external_dealt"] == 2


def test_a_stopping_client_does_not_queue_behind_a_silent_coordinator():
    """The coordinator stopped with the server (Ctrl-C of a launch): every request times
    out. Stopping, a request does not wait for the socket another holds nor retry, and
    leaving and closing are bounded, so the server exits well inside the launcher's grace
    (its acks used to take three timeouts each, one after another, then SIGKILL)."""
    import time

    import zmq

    from tests.helpers import free_port

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
    port = free_port()
    silent.bind(f"tcp://127.0.0.1:{port}")
    addr = f"tcp://127.0.0.1:{port}"
    client = CoordinatorClient(addr, addr, "rollout-0", engine_world_size=0, timeout_s=1.0)
    try:
        first = threading.Thread(target=client.ack, args=(["t1"],))
        first.start()  # holds the control socket for its first 1 s attempt
        time.sleep(0.2)
        client.shutdown.set()  # the server is told to stop (SIGTERM)
        start = time.monotonic()
        assert client.ack(["t2"]) is None  # the socket stays busy: a short wait, no retry
        assert time.monotonic() - start < 1.0
        first.join(5)
        assert time.monotonic() - start < 1.5  # its attempt ran out; no second one
        start = time.monotonic()
        assert client.leave("stopped", timeout_s=1.0) is False
        client.close()
        assert time.monotonic() - start < 2.5
    finally:
        client.close()
        silent.close(0)


def test_a_heartbeat_with_more_metrics_than_allowed_is_cut_not_refused(served):
    """A server's metrics grew one key per policy version (``rollout/tokens_by_version``):
    past the heartbeat's 1024, the coordinator refused every heartbeat, the watch thread
    died unseen, and the server fell out of the run for good after a thousand pushes. The
    client now sends the first 1024 by name, and says so once."""
    import time

    state, client = served
    client.metrics = {f"rollout/x{i:04d}": 1.0 for i in range(m.HEARTBEAT_METRICS_MAX + 10)}
    ann = client.heartbeat(wait_s=0.0)  # raised RequestRefused before
    assert ann is not None and ann.registered
    client.start_watching()
    time.sleep(2.5)  # a few heartbeats (heartbeat_s is 1 s here)
    assert not client.gone.is_set() and state["servers"] == 1  # still in the run


def test_a_watch_that_fails_leaves_instead_of_dying_unseen(caplog):
    """The coordinator (a learner restarting) says "not registered" once, then stays silent:
    registering again gives up with CoordinatorGone inside the watch thread. The thread used
    to end there with the server up and unheard, never exiting for its restart. Now the
    server is told to leave (``gone``), which exits it with 3 for the launcher to restart."""
    import logging

    import zmq

    from tests.helpers import free_port

    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{free_port()}"
    fake.bind(addr)

    def coordinator() -> None:  # answers the registration and one heartbeat, then nothing
        answers = [
            m.Registered(
                server_id="s0", session="s1", policy_version=0, sync_store_host="",
                sync_store_port=0, generation="", heartbeat_s=0.2, dead_after_s=3,
                catchup=False,
            ),
            m.Announcement(registered=False, policy_version=0),
        ]  # fmt: skip
        while answers and fake.poll(10_000):
            *envelope, _ = fake.recv_multipart()
            fake.send_multipart([*envelope, m.encode(answers.pop(0))])

    thread = threading.Thread(target=coordinator, daemon=True)
    thread.start()
    client = CoordinatorClient(
        addr, addr, "s0", engine_world_size=0, heartbeat_s=0.2, timeout_s=0.5, patience_s=2.0
    )
    try:
        client.register()
        with caplog.at_level(logging.ERROR):
            client.start_watching()
            assert client.gone.wait(15), "the watch thread ended without telling the server"
        # Said where the registration gave up (it raised into the watch before).
        assert "s0: no coordinator at" in caplog.text and ": leaving" in caplog.text
        assert client.refused == ""  # silence: the server's exit (3) says the learner hangs
    finally:
        client.close()
        fake.close(0)
        thread.join(5)


@pytest.mark.parametrize("answer", ["refused registration", "failed heartbeat"])
def test_a_coordinator_that_answers_but_refuses_is_not_taken_for_silent(answer):
    """Found by a review: a server whose re-registration was refused (a learner restarted
    with an edited config), or whose heartbeat got an error reply, exited 3, which says
    its coordinator was silent: the launcher then killed the answering learner as hung.
    The client now says it was refused, and the server exits 4 (restarted alone)."""
    import zmq

    from asyncrl.wire.base import ErrorReply
    from tests.helpers import free_port

    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    addr = f"tcp://127.0.0.1:{free_port()}"
    fake.bind(addr)
    registered = m.Registered(
        server_id="s0", session="s1", policy_version=0, sync_store_host="", sync_store_port=0,
        generation="", heartbeat_s=0.2, dead_after_s=3, catchup=False,
    )  # fmt: skip
    refusal = ErrorReply(error="config_mismatch", detail="data.max_prompt_length differs")
    if answer == "refused registration":
        answers = [registered, m.Announcement(registered=False, policy_version=0), refusal]
    else:
        answers = [registered, ErrorReply(error="internal", detail="a bug")]

    def coordinator() -> None:
        while answers and fake.poll(10_000):
            *envelope, _ = fake.recv_multipart()
            fake.send_multipart([*envelope, m.encode(answers.pop(0))])

    thread = threading.Thread(target=coordinator, daemon=True)
    thread.start()
    client = CoordinatorClient(
        addr, addr, "s0", engine_world_size=0, heartbeat_s=0.2, timeout_s=0.5, patience_s=2.0
    )
    try:
        client.register()
        client.start_watching()
        assert client.gone.wait(15), "the client never left"
        expected = "config_mismatch" if answer == "refused registration" else "internal"
        assert expected in client.refused, client.refused
    finally:
        client.close()
        fake.close(0)
        thread.join(5)


def test_a_slot_whose_request_was_never_answered_nor_repeated_is_given_back(served):
    """Found by the fault simulation (seeds 944, 1187, 1839, 3158 of its own draws): a slot
    request whose replies were all lost, and that no later request repeated (its group gave
    up, the agent left), left its slot charged to the admission budget for as long as the
    server lived: external slots are not reclaimed by the task timeout."""
    state, client = served
    _lose_replies(client, [2])
    assert client.request_slot(attempts=2).reason == "timeout"
    assert state["tasks/external_dealt"] == 1
    assert client.give_back_unanswered_slots(older_than_s=60.0) == 0  # not stale yet
    assert client.give_back_unanswered_slots(older_than_s=0.0) == 1
    assert state["tasks/external_dealt"] == 1  # the lost grant itself went back
    assert sum(v for k, v in _metrics(state).items() if "external_given_up" in k) == 1
    assert client.give_back_unanswered_slots(older_than_s=0.0) == 0  # nothing left
    fresh = client.request_slot(attempts=2)  # a new id: a new slot
    assert len(fresh.tasks) == 1 and state["tasks/external_dealt"] == 2


def _metrics(state: Counts) -> dict[str, float]:
    return state._coord.metrics()


def test_a_registration_again_to_a_silent_coordinator_leaves_as_gone(caplog):
    """Found by a review: a task request answered "unregistered" registers again on the
    task thread; a coordinator silent past patience_s then raised there, uncaught, and the
    server ended with a traceback, exit 1, not 3 (coordinator gone) as the watch ends it."""
    import logging
    import time

    import zmq

    from tests.helpers import free_port

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers: the learner is down
    port = free_port()
    silent.bind(f"tcp://127.0.0.1:{port}")
    addr = f"tcp://127.0.0.1:{port}"
    client = CoordinatorClient(
        addr, addr, "rollout-0", engine_world_size=0, timeout_s=0.3, patience_s=1.0
    )
    try:
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="asyncrl.control.client"):
            client._reregister(client._registration())  # told "unregistered"
        assert client.gone.is_set() and time.monotonic() - start < 10
        assert "rollout-0: " in caplog.text and ": leaving" in caplog.text
    finally:
        client.close()
        silent.close(0)
