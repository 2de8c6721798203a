"""Wire codec of the request sockets: batch replies, every request and reply round trip,
and every kind of bad request (trajectories are in test_wire.py)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from asyncrl import wire
from tests.standins.trajgen import make_group
from tests.test_wire import as_bytes

pytestmark = pytest.mark.timeout(60)


def test_batch_reply_round_trip() -> None:
    groups = [
        wire.Group.from_trajectories(tid, make_group(tid, size, response_len=size))
        for tid, size in (("a", 2), ("b", 3))
    ]
    batch = wire.Batch(
        batch_id=7,
        policy_version=3,
        groups=groups,
        lag_histogram={0: 1, 2: 1},
        metrics={"buffer/size": 4.0},
        redelivered=True,
    )
    got = wire.decode_reply(as_bytes(wire.encode_batch(batch)))
    assert isinstance(got, wire.Batch)
    assert (got.batch_id, got.policy_version, got.redelivered) == (7, 3, True)
    assert got.task_ids == ["a", "b"] and got.lag_histogram == {0: 1, 2: 1}
    assert got.metrics == {"buffer/size": 4.0}
    for g, want in zip(got.groups, groups, strict=True):
        assert g.metas == want.metas
        for t, w in zip(g.trajectories, want.trajectories, strict=True):
            np.testing.assert_array_equal(t.response_ids, w.response_ids)
            np.testing.assert_array_equal(t.prompt_ids, w.prompt_ids)


@pytest.mark.parametrize(
    "msg",
    [
        wire.Hello(schema=1, consumer_id="learner", acked_through=4),
        wire.BatchRequest(schema=1, consumer_id="learner", policy_version=3, wait_s=1.5),
        wire.Ack(schema=1, consumer_id="learner", batch_ids=[1, 2]),
        wire.StatsRequest(schema=1),
        wire.DroppedRequest(schema=1),
        wire.ValidationRequest(schema=1),
        wire.ValidationRequest(schema=1, rounds=["val.x/0"]),
        wire.Shutdown(schema=1),
    ],
)
def test_requests_round_trip(msg: wire.Request) -> None:
    assert wire.decode_request([wire.encode_request(msg)]) == msg


def test_replies_round_trip() -> None:
    replies = [
        wire.Welcome(schema=1, redelivering=2, next_batch_id=5, acked=1),
        wire.NoBatch(schema=1, ready=3, needed=16),
        wire.AckReply(schema=1, acked=[1], unknown=[9]),
        wire.StatsReply(schema=1, metrics={"buffer/size": 1.0}),
        wire.DroppedReply(schema=1, dropped=[wire.DroppedTask("t", "lag", False)]),
        wire.ValidationReply(
            schema=1,
            by_round={"val.x/0": {"val.x/0/3": wire.ValidationGroup.of("gsm8k", [1.0, 0.0], 7)}},
        ),
        wire.Ok(schema=1),
        wire.ErrorReply(schema=1, error="invalid", detail="x"),
    ]
    for r in replies:
        assert wire.decode_reply(wire.encode_reply(r)) == r


@pytest.mark.parametrize(
    ("frames", "kind"),
    [
        ([msgpack.packb([1, 2])], "invalid"),  # msgpack, but an array
        ([b"\xc1"], "malformed"),
        ([msgpack.packb({"kind": "stats", "schema": 1, "x": 0})], "invalid"),  # unknown field
        ([msgpack.packb({"kind": "stats", "schema": 9})], "schema"),
        ([msgpack.packb({"kind": "launch", "schema": 1})], "invalid"),
        (
            [msgpack.packb({"kind": "ack", "schema": 1, "consumer_id": "c", "batch_ids": ["x"]})],
            "invalid",
        ),
        ([wire.encode_request(wire.StatsRequest(schema=1))] * 2, "malformed"),
        ([], "malformed"),
        (
            [msgpack.packb({"kind": "batch_request", "consumer_id": "c", "policy_version": 2**63})],
            "invalid",
        ),
    ],
)
def test_bad_requests_are_rejected_by_kind(frames: list[bytes], kind: str) -> None:
    with pytest.raises(wire.WireError) as err:
        wire.decode_request(frames)
    assert err.value.kind == kind


def test_a_request_without_schema_is_of_the_current_version() -> None:
    # Every request/reply message shares one base whose schema defaults to this side's.
    assert wire.decode_request([msgpack.packb({"kind": "stats"})]) == wire.StatsRequest()
    assert wire.StatsRequest().schema == wire.SCHEMA_VERSION


def test_requests_of_a_peer_without_incarnation_tokens_decode() -> None:
    """The incarnation fields are optional: an older client's messages stay valid."""
    hello = msgpack.packb({"kind": "hello", "schema": 1, "consumer_id": "learner"})
    msg = wire.decode_request([hello])
    assert isinstance(msg, wire.Hello) and msg.incarnation == ""
    ack = msgpack.packb({"kind": "ack", "schema": 1, "consumer_id": "l", "batch_ids": [1]})
    decoded = wire.decode_request([ack])
    assert isinstance(decoded, wire.Ack) and decoded.incarnation == ""
