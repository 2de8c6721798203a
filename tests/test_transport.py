"""The ZeroMQ helpers of :mod:`asyncrl.net.transport` on real loopback sockets: endpoints, the
trajectory pusher (delivery, backpressure at the high-water mark, async sends), the
request client's timeout, the service side of request/reply (refusals, held requests), and
the import boundary of the wire and transport modules."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import zmq

from asyncrl import wire
from asyncrl.net.serving import HeldRequests, RouterService
from asyncrl.net.transport import ReqClient, RequestRefused, TrajectoryPusher, endpoint
from tests.standins.trajgen import make_group, make_traj

pytestmark = pytest.mark.timeout(60)


def test_endpoints() -> None:
    assert endpoint("127.0.0.1", 5552, "trajectories") == "tcp://127.0.0.1:5552"
    assert endpoint("10.0.0.2", 0, "batches") == "tcp://10.0.0.2:*"
    assert endpoint("ipc:///tmp/run/", 1, "batches") == "ipc:///tmp/run/batches.sock"
    with pytest.raises(ValueError):
        endpoint("udp://x", 1, "batches")


def _pull(hwm: int = 1000) -> tuple[zmq.Context, zmq.Socket, str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    return ctx, sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def test_pusher_delivers_and_flushes_on_close() -> None:
    ctx, pull, addr = _pull()
    with TrajectoryPusher(addr) as pusher:
        waits = [pusher.send(make_group(f"g{i}", 2)) for i in range(50)]
        # far below the high-water mark nothing blocks; the waits add up to what it reports
        assert pusher.sent == 50 and max(waits) < 0.5, waits
        assert pusher.total_wait_s == pytest.approx(sum(waits))
    got = []
    while pull.poll(2000):
        got.append(wire.decode_packed(pull.recv_multipart()).metas[0].task_id)
        if len(got) == 50:
            break
    assert got == [f"g{i}" for i in range(50)]
    pull.close()
    ctx.term()


def test_pusher_blocks_at_the_high_water_mark_and_reports_the_wait() -> None:
    ctx, pull, addr = _pull(hwm=1)
    frames = wire.encode_trajectories([make_traj("big", response_len=200_000)])
    pusher = TrajectoryPusher(addr, hwm=1, linger_s=0)
    with pytest.raises(TimeoutError):
        for _ in range(1000):  # nobody reads: queues and kernel buffers fill, then it blocks
            pusher.send_frames(frames, timeout_s=0.3)
    assert pusher.total_wait_s >= 0.3
    # Reading unblocks it; the wait it reports covers the time until then.
    sent_before = pusher.sent
    start = time.monotonic()
    drained = 0

    def drain_later() -> None:
        nonlocal drained
        time.sleep(0.3)
        while pull.poll(200):
            pull.recv_multipart()
            drained += 1

    reader = threading.Thread(target=drain_later)
    reader.start()
    waited = pusher.send_frames(frames, timeout_s=10)
    assert waited >= 0.2 and time.monotonic() - start >= 0.2
    assert pusher.sent == sent_before + 1
    reader.join()
    pusher.close()
    pull.close()
    ctx.term()


def test_close_ends_a_push_blocked_for_good() -> None:
    """Found by a hang audit: a push blocked with the buffer gone held the pusher's lock,
    so close() at a server's exit waited for good. Now the push gives up within a second."""
    ctx, pull, addr = _pull(hwm=1)
    frames = wire.encode_trajectories([make_traj("big", response_len=200_000)])
    pusher = TrajectoryPusher(addr, hwm=1, linger_s=0)
    with pytest.raises(TimeoutError):
        for _ in range(1000):  # nobody reads: fill every queue
            pusher.send_frames(frames, timeout_s=0.3)
    outcome: list[BaseException] = []

    def push_forever() -> None:
        try:
            pusher.send_frames(frames, timeout_s=None)
        except BaseException as e:
            outcome.append(e)

    blocked = threading.Thread(target=push_forever, daemon=True)
    blocked.start()
    time.sleep(0.5)
    start = time.monotonic()
    closer = threading.Thread(target=pusher.close, daemon=True)
    closer.start()
    closer.join(10)
    blocked.join(10)
    assert not closer.is_alive() and time.monotonic() - start < 5
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectionError)
    pull.close()
    ctx.term()


def test_pusher_send_async_keeps_the_event_loop_free() -> None:
    ctx, pull, addr = _pull(hwm=1)

    async def main() -> tuple[int, int, float]:
        """(sends that went through, loop ticks during the send that blocked, its time)."""
        pusher = TrajectoryPusher(addr, hwm=1, linger_s=0)
        big = [make_traj("big", response_len=200_000)]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        sent = 0
        try:
            with pytest.raises(TimeoutError):  # nobody reads: a send blocks, then times out
                for _ in range(200):
                    ticks_before, start = ticks, time.monotonic()
                    await pusher.send_async(big, timeout_s=0.5)
                    sent += 1
            return sent, ticks - ticks_before, time.monotonic() - start
        finally:
            tick_task.cancel()
            pusher.close()

    sent, ticks_while_blocked, blocked_s = asyncio.run(main())
    assert 1 <= sent < 200  # some went out before the queues filled
    assert blocked_s >= 0.5  # the last send waited its whole timeout...
    assert ticks_while_blocked >= 20  # ...while the loop kept ticking (about 50 in 0.5 s)
    pull.close()
    ctx.term()


def test_req_client_times_out_and_recovers() -> None:
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.bind("tcp://127.0.0.1:*")
    client = ReqClient(server.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=0.2)
    with pytest.raises(TimeoutError):
        client.request_frames([b"first"])  # the server reads but does not answer in time
    *envelope, body = server.recv_multipart()
    assert body == b"first"
    # A new request works after the timeout; the late answer to the first is discarded.
    server.send_multipart([*envelope, b"late"])
    answer = threading.Timer(
        0.05, lambda: server.send_multipart([*server.recv_multipart()[:-1], b"second-reply"])
    )
    answer.start()
    assert [bytes(f) for f in client.request_frames([b"second"], timeout_s=2)] == [b"second-reply"]
    answer.join()
    client.close()
    server.close(0)
    ctx.term()


def test_a_late_reply_to_a_timed_out_request_does_not_lift_the_next_ones_timeout() -> None:
    """Found by a review: a late reply to a timed-out request made the poll say readable,
    and the receive, which drops that reply (REQ_CORRELATE), then blocked for this
    request's reply with no bound: for good where the server restarted meanwhile (the
    learner's batch request, the coordinator's buffer poll)."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.bind("tcp://127.0.0.1:*")
    client = ReqClient(server.getsockopt_string(zmq.LAST_ENDPOINT), timeout_s=0.2)
    with pytest.raises(TimeoutError):
        client.request_frames([b"first"])
    *envelope, _ = server.recv_multipart()
    outcome: list[BaseException | None] = []

    def second() -> None:
        try:
            client.request_frames([b"second"], timeout_s=1.0)
            outcome.append(None)
        except BaseException as e:  # recorded for the assertion below
            outcome.append(e)

    thread = threading.Thread(target=second, daemon=True)
    start = time.monotonic()
    thread.start()
    assert server.recv_multipart()[-1] == b"second"  # read, never answered
    server.send_multipart([*envelope, b"late"])  # the answer to the first, too late
    thread.join(5.0)
    assert not thread.is_alive(), "the second request waited past its timeout"
    assert isinstance(outcome[0], TimeoutError) and time.monotonic() - start < 3.0
    client.close()
    server.close(0)
    ctx.term()


class _StalePoll:
    """A socket whose poll saw a connection that is gone by the send (a handshake refused
    or a server going away in between): it says writable, the socket has no pipe."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def poll(self, timeout: int, flags: int) -> int:
        return flags if flags == zmq.POLLOUT else self.sock.poll(timeout, flags)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_a_connection_gone_between_poll_and_send_times_out_instead_of_blocking() -> None:
    """The request client polled for room, then sent blocking: a connection gone in
    between left a rogue client registering as a run ended blocked in its send for good
    (a test sat there until its own timeout). It times out as a silent server does."""
    ctx = zmq.Context()
    client = ReqClient("tcp://127.0.0.1:1", timeout_s=0.3, context=ctx)
    client._sock.close(0)
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no pipe until a connection is made: none will be
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("tcp://127.0.0.1:1")
    client._sock = _StalePoll(sock)  # type: ignore[assignment]
    outcome: list[BaseException | None] = []

    def request() -> None:
        try:
            client.request_frames([b"hello"])
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the test reads what it was
            outcome.append(e)

    worker = threading.Thread(target=request, daemon=True)
    worker.start()
    worker.join(5)
    assert outcome and isinstance(outcome[0], TimeoutError), outcome or "blocked in the send"
    assert "cannot send to tcp://127.0.0.1:1 within 0.3s" in str(outcome[0])
    sock.close(0)
    ctx.term()


def _serve_until(service: RouterService, done: threading.Event) -> None:
    """Answer every valid request with empty stats until ``done``."""
    while not done.is_set():
        if service.sock.poll(10):
            for envelope, _ in service.receive():
                service.reply(envelope, wire.StatsReply(metrics={}))


def test_router_service_refuses_bad_requests_and_answers_good_ones() -> None:
    ctx, rejects, counts = zmq.Context(), [], Counter()
    decode = wire.decode_request
    service = RouterService(
        ctx, "tcp://127.0.0.1:*", decode, on_reject=rejects.append, counts=counts
    )
    done = threading.Event()
    server = threading.Thread(target=_serve_until, args=(service, done))
    server.start()
    try:
        with ReqClient(service.endpoint, timeout_s=5) as client:
            assert client.call(wire.StatsRequest(), wire.decode_reply) == wire.StatsReply(
                metrics={}
            )
            refusal = wire.decode_reply(client.request_frames([b"a", b"b"]))  # not one frame
            assert isinstance(refusal, wire.ErrorReply) and refusal.error == "malformed"
            with pytest.raises(RequestRefused, match="schema"):
                client.call(wire.StatsRequest(schema=2), wire.decode_reply)
        assert [e.kind for e in rejects] == ["malformed", "schema"]
        assert counts["replies_undeliverable"] == 0
    finally:
        done.set()
        server.join()
        service.close()
        ctx.term()


class _Sent(list):
    """Stands in for a RouterService: records the replies held requests get."""

    def reply(self, envelope: list[bytes], msg: wire.Message) -> bool:
        self.append((envelope, msg))
        return True


def test_held_requests_are_answered_when_their_wait_ends_one_per_client() -> None:
    def ask(who: str) -> wire.BatchRequest:
        return wire.BatchRequest(consumer_id=who, policy_version=0)

    def answer(held, now: float) -> wire.Ok | None:
        return wire.Ok() if held.expired(now) else None

    held = HeldRequests(lambda msg: msg.consumer_id)
    held.hold([b"a"], ask("a"), now=0.0, wait_s=1.0)
    held.hold([b"b"], ask("b"), now=0.0, wait_s=5.0)
    held.hold([b"a2"], ask("a"), now=0.5, wait_s=2.0)  # a asks again: its first is dropped
    assert len(held) == 2 and held.next_deadline() == 2.5
    sent = _Sent()
    held.serve(sent, 2.0, answer)  # type: ignore[arg-type]
    assert sent == []
    held.serve(sent, 3.0, answer)  # type: ignore[arg-type]
    assert sent == [([b"a2"], wire.Ok())] and len(held) == 1
    held.drop("b")
    assert len(held) == 0 and held.next_deadline() is None


def test_wire_and_transport_import_no_torch_or_vllm() -> None:
    code = (
        "import sys, asyncrl, asyncrl.wire, asyncrl.net.transport; "
        "bad = [m for m in ('torch', 'vllm', 'learner', 'rollout_servers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_close_that_drops_queued_messages_names_the_latest(caplog) -> None:
    """A rollout server closing its pusher while the buffer does not read loses what is
    queued; the warning said so without saying which. PUSH confirms nothing, so it names
    the bound (the queue's size) and the latest task ids sent."""
    ctx, pull, addr = _pull(hwm=1)
    pusher = TrajectoryPusher(addr, hwm=1, linger_s=0.3)
    sent = []
    with pytest.raises(TimeoutError):
        for i in range(1000):  # nobody reads: queues and kernel buffers fill, then it blocks
            pusher.send([make_traj(f"g{i}", response_len=200_000)], timeout_s=0.3)
            sent.append(f"g{i}")
    with caplog.at_level("WARNING", logger="asyncrl.net.transport"):
        pusher.close()
    (line,) = [r.getMessage() for r in caplog.records if "at close were dropped" in r.message]
    assert f"up to the last 1 sent (the queue holds 1; the latest: {sent[-1]}, {sent[-2]}" in line
    assert "dealt again" in line
    pull.close()
    ctx.term()


def test_a_router_whose_bind_fails_leaves_its_context_free_to_end() -> None:
    """A served socket whose port was taken stayed open behind the raised error (the
    traceback holds it): terminating the context then waited for good, and a buffer
    whose port was taken hung instead of saying so."""
    holder_ctx, holder, addr = _pull()
    ctx = zmq.Context()
    with pytest.raises(zmq.ZMQError) as failed:
        RouterService(ctx, addr, wire.decode_request, on_reject=lambda e: None, counts=Counter())
    assert failed.value.errno == zmq.EADDRINUSE
    ender = threading.Thread(target=ctx.term, daemon=True)
    ender.start()
    ender.join(5)
    assert not ender.is_alive()
    holder.close()
    holder_ctx.term()
