"""Fuzzing the running buffer service: over 10,000 messages, each invalid by construction,
at its trajectory and batch sockets. The service must stay up, count exactly one reject per
message, answer every bad request with an error, and accept a valid trajectory afterwards.

Messages are built in-process by hypothesis strategies (random bytes, truncated or mutated
valid frames, wrong schema versions, wrong lengths and dtypes, NaN logprobs, bad fields,
oversize) and checked to fail decoding locally before they are sent over one socket each.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from asyncrl import wire
from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import TrajectoryPusher
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from tests.helpers import wait_until
from tests.standins.trajgen import make_group, make_traj

pytestmark = pytest.mark.timeout(150)

# Hypothesis's cost is mostly per example, so each example is a burst of messages.
PER_EXAMPLE = 50
N_TRAJECTORY_MESSAGES = 8000
N_BATCH_MESSAGES = 3000
LIMITS = wire.Limits(max_message_bytes=1 << 20, max_prompt_len=64, max_response_len=64)


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # no shrinking: every example is a message actually sent
        suppress_health_check=list(HealthCheck),
    )


def frames_of(trajs: list[wire.Trajectory]) -> list[bytes]:
    return [bytes(f) for f in wire.encode_trajectories(trajs)]


BASES = [
    frames_of([make_traj("a", response_len=4)]),
    frames_of(make_group("b", 3, response_len=2, prompt_len=3)),
    frames_of([make_traj("c", 1, 2, spans=[(0, 2), (1, 3)], response_len=5, validation=True)]),
    frames_of([make_traj("d", prompt_len=0, response_len=1, reward_parts={"x": 0.5})]),
]


def still_decodes(frames: list[bytes]) -> bool:
    try:
        wire.decode_packed(frames, LIMITS)
    except wire.WireError:
        return False
    return True


def repack(base: list[bytes], **change: object) -> list[bytes]:
    """The base message with header fields (``meta.<field>`` for the first trajectory)
    changed."""
    header = msgpack.unpackb(base[0])
    for key, value in change.items():
        if key.startswith("meta."):
            header["trajectories"][0][key[5:]] = value
        else:
            header[key] = value
    return [msgpack.packb(header), *base[1:]]


FIELD_CHANGES = [
    {"meta.group_index": 7},
    {"meta.group_size": 0},
    {"meta.task_id": ""},
    {"meta.task_id": 5},
    {"meta.reward": math.nan},
    {"meta.reward": "1.0"},
    {"meta.version_spans": []},
    {"meta.version_spans": [[0, 99]]},
    {"meta.version_spans": [[-1, 4]]},
    {"meta.version_spans": [[3, 2], [1, 2]]},
    {"meta.prompt_len": -1},
    {"meta.response_len": 2**40},
    {"meta.validation": "yes"},
    {"meta.surprise": 1},
    {"meta.reward_parts": {"a": math.inf}},
    {"trajectories": []},
    {"trajectories": "none"},
    {"kind": "hello"},
    {"extra": 1},
]


@st.composite
def bad_trajectory_message(draw: st.DrawFn) -> list[bytes]:
    kind = draw(
        st.sampled_from(
            [
                "random",
                "truncated",
                "mutated",
                "schema",
                "length",
                "dtype",
                "nonfinite",
                "frames",
                "fields",
                "oversize",
            ]
        )
    )
    base = draw(st.sampled_from(BASES))
    frames = list(base)
    if kind == "random":
        frames = draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
    elif kind == "truncated":
        i = draw(st.sampled_from([k for k, f in enumerate(base) if f]))
        frames[i] = base[i][: draw(st.integers(0, len(base[i]) - 1))]
    elif kind == "mutated":
        header = bytearray(base[0])
        for _ in range(draw(st.integers(1, 4))):
            header[draw(st.integers(0, len(header) - 1))] = draw(st.integers(0, 255))
        frames[0] = bytes(header)
    elif kind == "schema":
        other = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=3))
        frames = repack(base, schema=draw(other.filter(lambda v: v != wire.SCHEMA_VERSION)))
    elif kind == "length":
        i = draw(st.integers(1, 3))
        delta = draw(st.integers(-len(base[i]), 16).filter(lambda d: d != 0))
        frames[i] = base[i][:delta] if delta < 0 else base[i] + b"\x00" * delta
    elif kind == "dtype":
        i = draw(st.sampled_from([k for k in (1, 2, 3) if base[k]]))
        wide = "<i8" if i < 3 else "<f8"
        frames[i] = np.frombuffer(base[i], "<i4" if i < 3 else "<f4").astype(wide).tobytes()
    elif kind == "nonfinite":
        logprobs = np.frombuffer(base[3], "<f4").copy()
        logprobs[draw(st.integers(0, len(logprobs) - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf])
        )
        frames[3] = logprobs.tobytes()
    elif kind == "frames":
        if draw(st.booleans()):
            del frames[draw(st.integers(0, 3))]
        else:
            frames += draw(st.lists(st.binary(max_size=8), min_size=1, max_size=3))
    elif kind == "fields":
        frames = repack(base, **draw(st.sampled_from(FIELD_CHANGES)))
    else:  # oversize: beyond data.max_response_length
        n = draw(st.integers(65, 200))
        frames = frames_of([make_traj("big", response_len=n)])
    # Checked to fail: a change that happens to keep the message valid (a flipped byte inside
    # a string, say) is followed by cutting the header short, which never decodes.
    while still_decodes(frames):
        frames[0] = frames[0][:-1]
    return frames


@st.composite
def bad_request(draw: st.DrawFn) -> list[bytes]:
    """The frames after the routing envelope; each fails to decode as a request."""
    valid = [
        wire.encode_request(wire.BatchRequest(schema=1, consumer_id="c", policy_version=2)),
        wire.encode_request(wire.Ack(schema=1, consumer_id="c", batch_ids=[1, 2])),
        wire.encode_request(wire.Hello(schema=1, consumer_id="c")),
    ]
    kind = draw(st.sampled_from(["random", "truncated", "mutated", "schema", "fields", "frames"]))
    base = draw(st.sampled_from(valid))
    if kind == "random":
        body = [draw(st.binary(min_size=1, max_size=64))]
    elif kind == "truncated":
        body = [base[: draw(st.integers(0, len(base) - 1))]]
    elif kind == "mutated":
        raw = bytearray(base)
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        body = [bytes(raw)]
        while _request_decodes(body):
            body = [body[0][:-1]]
    elif kind == "schema":
        body = [msgpack.packb({**msgpack.unpackb(base), "schema": draw(st.integers(2, 10**6))})]
    elif kind == "fields":
        change = draw(
            st.sampled_from(
                [
                    {"kind": "launch"},
                    {"kind": None},
                    {"consumer_id": 3},
                    {"batch_ids": "x"},
                    {"policy_version": -1},
                    {"wait_s": -1.0},
                    {"wait_s": 1e9},
                    {"unknown": 1},
                ]
            )
        )
        body = [msgpack.packb({**msgpack.unpackb(base), **change})]
        while _request_decodes(body):  # a change that happens to be harmless: cut it short
            body = [body[0][:-1]]
    else:
        body = [base, base] if draw(st.booleans()) else []
    return body


def _request_decodes(body: list[bytes]) -> bool:
    try:
        wire.decode_request(body, LIMITS)
    except wire.WireError:
        return False
    return True


def wait_for(client: BufferClient, key: str, value: float, timeout_s: float = 30) -> dict:
    """The buffer's stats once ``key`` has reached ``value``."""

    def reached() -> dict | None:
        stats = client.stats()
        return stats if stats.get(key, 0.0) >= value else None

    return wait_until(reached, f"{key} >= {value}", timeout_s, details=client.stats)


def test_fuzzed_sockets_reject_every_bad_message_and_keep_serving() -> None:
    core = ReplayBuffer(batch_size=1, capacity_groups=100, max_policy_lag=10)
    with BufferService(core, limits=LIMITS) as svc:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)  # never block: the service drains as we go
        push.connect(svc.trajectories_endpoint)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(svc.batches_endpoint)
        sent = {"trajectories": 0, "requests": 0}
        replies: list[list[bytes]] = []

        @fuzz(N_TRAJECTORY_MESSAGES // PER_EXAMPLE)
        @given(st.lists(bad_trajectory_message(), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
        def throw_trajectories(messages: list[list[bytes]]) -> None:
            for frames in messages:
                assert not still_decodes(frames), "fuzz messages must be invalid by construction"
                push.send_multipart(frames)
                sent["trajectories"] += 1

        @fuzz(N_BATCH_MESSAGES // PER_EXAMPLE)
        @given(
            st.lists(
                st.tuples(bad_request(), st.booleans()), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE
            )
        )
        def throw_requests(requests: list[tuple[list[bytes], bool]]) -> None:
            for body, delimited in requests:
                assert not _request_decodes(body)
                if delimited or len(body) != 1 or not body[0]:
                    dealer.send_multipart([b"", *body])  # what a REQ socket sends
                else:
                    dealer.send_multipart(body)  # no envelope delimiter at all
                sent["requests"] += 1
            while dealer.poll(0):
                replies.append(dealer.recv_multipart())

        throw_trajectories()
        throw_requests()
        # Messages past the size limit made of frames within it: read, refused, counted.
        half = b"\x00" * (LIMITS.max_message_bytes // 2 + 1)
        for _ in range(5):
            push.send_multipart([half, half, b"", b""])
            sent["trajectories"] += 1
        total = sent["trajectories"] + sent["requests"]
        assert total >= 10_000

        def all_answered() -> bool:
            while dealer.poll(10):  # drain as they come: a full queue would drop replies
                replies.append(dealer.recv_multipart())
            return len(replies) >= sent["requests"]

        wait_until(all_answered, "a reply to every request", 60, every_s=0)
        assert len(replies) == sent["requests"]
        decoded = [wire.decode_reply(r[-1:]) for r in replies]
        assert all(isinstance(r, wire.ErrorReply) for r in decoded)

        with BufferClient(svc.batches_endpoint, "learner") as client:
            stats = wait_for(client, "buffer/rejects/total", total)
            assert stats["buffer/rejects/total"] == total
            by_socket = {
                s: sum(v for k, v in stats.items() if k.startswith(f"buffer/rejects/{s}/"))
                for s in sent
            }
            assert by_socket == sent
            kinds = {k.split("/")[-1] for k, v in stats.items() if "/rejects/traj" in k and v}
            assert kinds == set(wire.REJECT_KINDS)  # every kind of bad input was exercised
            assert stats["buffer/trajectories_in"] == 0

            # Still serving: a valid trajectory is accepted and released.
            # A frame past the limit is never read: zmq drops the sender; nothing counted.
            over = b"\x00" * (LIMITS.max_message_bytes + 1)
            huge_push, huge_dealer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
            huge_push.connect(svc.trajectories_endpoint)
            huge_dealer.connect(svc.batches_endpoint)
            huge_push.send_multipart([over, b"", b"", b""])
            huge_dealer.send_multipart([b"", over[: LIMITS.max_request_bytes + 1]])
            assert not huge_dealer.poll(1000), "an unread request got a reply"
            huge_push.close(0)
            huge_dealer.close(0)
            with TrajectoryPusher(svc.trajectories_endpoint) as pusher:
                pusher.send([make_traj("after-the-storm")])
            client.hello()
            batch = client.request_batch(0, wait_s=10)
            assert batch is not None and batch.task_ids == ["after-the-storm"]
            assert client.stats()["buffer/rejects/total"] == total
        push.close(0)
        dealer.close(0)
        ctx.term()
