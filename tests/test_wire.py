"""Wire codec of trajectories: round trips, a plain-msgpack producer, every kind of bad
frame, and any bytes on any socket (requests and replies are in test_wire_requests.py, the
ZeroMQ helpers in test_transport.py)."""

from __future__ import annotations

import contextlib
import math

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl import wire
from tests.standins.trajgen import make_group, make_traj

pytestmark = pytest.mark.timeout(60)

META = {
    "task_id": "t-1",
    "group_index": 0,
    "group_size": 1,
    "prompt_len": 3,
    "response_len": 2,
    "version_spans": [[0, 2]],
    "reward": 1.0,
}


def plain_frames(meta: dict | None = None, **header: object) -> list[bytes]:
    """A trajectory message built with msgpack and numpy only, as a non-Python client would."""
    head = {"kind": "trajectories", "schema": 1, "trajectories": [meta or META], **header}
    return [
        msgpack.packb(head),
        np.array([5, 6, 7], dtype="<i4").tobytes(),
        np.array([8, 9], dtype="<i4").tobytes(),
        np.array([-0.1, -2.3], dtype="<f4").tobytes(),
    ]


def as_bytes(frames: list) -> list[bytes]:
    return [bytes(f) for f in frames]


# ----------------------------------------------------------------------- round trips
def test_round_trip_keeps_every_field_and_array() -> None:
    trajs = [
        make_traj(
            "a",
            0,
            3,
            prompt_len=7,
            response_len=5,
            spans=[(2, 3), (3, 2)],
            reward=0.5,
            reward_parts={"format": 0.1, "answer": 0.4},
            finish_reason="length",
            validation=True,
            data_source="countdown",
            server_id="rollout-1",
            created_at=1.5,
            finished_at=2.5,
        ),
        make_traj("a", 1, 3, prompt_len=0, response_len=0, spans=[(4, 0)]),
        make_traj("a", 2, 3, prompt_len=1, response_len=9),
    ]
    got = wire.decode_trajectories(as_bytes(wire.encode_trajectories(trajs)))
    assert [t.meta for t in got] == [t.meta for t in trajs]
    for t, g in zip(trajs, got, strict=True):
        np.testing.assert_array_equal(g.prompt_ids, t.prompt_ids)
        np.testing.assert_array_equal(g.response_ids, t.response_ids)
        np.testing.assert_array_equal(g.logprobs, t.logprobs)
        assert g.prompt_ids.dtype == np.dtype("<i4") and g.logprobs.dtype == np.dtype("<f4")
    assert got[0].oldest_version == 2 and got[1].oldest_version == 4
    np.testing.assert_array_equal(got[0].token_versions(), [2, 2, 2, 3, 3])


def test_nan_logprob_travels_as_not_reported() -> None:
    """NaN marks a token whose logprob the engine did not report: the message is valid (the
    learner drops and counts such tokens), and the NaN arrives where it was sent, through a
    trajectory message and a batch reply alike."""
    [t] = wire.decode_trajectories(_with(logprobs=np.array([np.nan, -2.3], "<f4").tobytes()))
    assert math.isnan(t.logprobs[0]) and t.logprobs[1] == np.float32(-2.3)
    sent = make_traj("g", 0, 2, response_len=3)
    lp = sent.logprobs.copy()
    lp[1] = np.nan
    sent = wire.Trajectory(
        meta=sent.meta, prompt_ids=sent.prompt_ids, response_ids=sent.response_ids, logprobs=lp
    )
    group = wire.Group.from_trajectories("g", [sent, make_traj("g", 1, 2, response_len=3)])
    packed = wire.decode_packed(as_bytes(wire.encode_packed(group)))
    batch = wire.Batch(
        batch_id=0, policy_version=0, groups=[group], lag_histogram={0: 1}, metrics={}
    )
    replied = wire.decode_reply(as_bytes(wire.encode_batch(batch)))
    for got in (packed.trajectories[0], replied.groups[0].trajectories[0]):
        np.testing.assert_array_equal(np.isnan(got.logprobs), [False, True, False])
        np.testing.assert_array_equal(got.logprobs[[0, 2]], lp[[0, 2]])


def test_sampling_temperature_travels_with_the_trajectory() -> None:
    """The temperature a response was sampled at (the learner divides that row's logits by
    it); optional: a producer that does not say sends no key and the learner uses its
    configured temperature."""
    t = make_traj("a", response_len=2, temperature=0.7)
    [got] = wire.decode_trajectories(as_bytes(wire.encode_trajectories([t])))
    assert got.meta.temperature == 0.7
    header = msgpack.unpackb(wire.encode_trajectories([make_traj("b")])[0])
    assert "temperature" not in header["trajectories"][0]
    assert wire.decode_trajectories(plain_frames())[0].meta.temperature is None
    [greedy] = wire.decode_trajectories(plain_frames({**META, "temperature": 0}))
    assert greedy.meta.temperature == 0.0  # greedy validation sampling


def test_plain_msgpack_client_produces_a_valid_trajectory() -> None:
    [t] = wire.decode_trajectories(plain_frames())
    assert t.task_id == "t-1" and t.reward == 1.0 and t.meta.validation is False
    np.testing.assert_array_equal(t.prompt_ids, [5, 6, 7])
    np.testing.assert_array_equal(t.response_ids, [8, 9])
    np.testing.assert_allclose(t.logprobs, [-0.1, -2.3], rtol=1e-6)
    # Integers where floats are expected are accepted too.
    wire.decode_trajectories(plain_frames({**META, "reward": 1}))


def test_encoded_frames_are_little_endian_raw_arrays() -> None:
    t = make_traj("x", response_len=3)
    frames = wire.encode_trajectories([t])
    assert len(frames) == 4
    header = msgpack.unpackb(frames[0])
    assert header["kind"] == "trajectories" and header["schema"] == wire.SCHEMA_VERSION
    assert bytes(frames[2]) == t.response_ids.astype("<i4").tobytes()
    assert bytes(frames[3]) == t.logprobs.astype("<f4").tobytes()


def test_decoded_arrays_are_read_only_views_of_the_frames() -> None:
    frames = as_bytes(wire.encode_trajectories(make_group("g", 2)))
    packed = wire.decode_packed(frames)
    assert np.shares_memory(packed.response_ids, np.frombuffer(frames[2], dtype="<i4"))
    t = packed.trajectories[1]
    assert np.shares_memory(t.response_ids, packed.response_ids)
    assert not t.logprobs.flags.writeable


def test_group_and_packed_views() -> None:
    trajs = make_group("g", 3, response_len=2, spans=None, version=5)
    group = wire.Group.from_trajectories("g", trajs)
    assert len(group) == 3 and group.oldest_version == 5 and group.lag(7) == 2
    np.testing.assert_array_equal(group.response_lens, [2, 2, 2])
    np.testing.assert_array_equal(group.trajectories[2].response_ids, trajs[2].response_ids)


# ----------------------------------------------------------------------- bad input
def _with(meta_change: dict | None = None, drop: str | None = None, **frame_change: bytes):
    meta = {**META, **(meta_change or {})}
    if drop:
        del meta[drop]
    frames = plain_frames(meta)
    for i, key in enumerate(("prompt", "response", "logprobs"), start=1):
        if key in frame_change:
            frames[i] = frame_change[key]
    return frames


BAD_TRAJECTORIES = {
    "not msgpack": ("malformed", [b"\xc1\xc1", b"", b"", b""]),
    "no frames": ("malformed", []),
    "missing array frames": ("malformed", plain_frames()[:2]),
    "one extra frame": ("malformed", [*plain_frames(), b""]),
    "schema 2": ("schema", plain_frames(schema=2)),
    "schema 2, other shape": ("schema", [msgpack.packb({"schema": 2, "kind": "x"})]),
    "missing task_id": ("invalid", _with(drop="task_id")),
    "unknown field": ("invalid", _with({"colour": "red"})),
    "reward is a string": ("invalid", _with({"reward": "high"})),
    "empty task id": ("invalid", _with({"task_id": ""})),
    "negative group index": ("invalid", _with({"group_index": -1})),
    "group index beyond size": ("invalid", _with({"group_index": 1})),
    "spans go backwards": ("invalid", _with({"version_spans": [[3, 1], [2, 1]]})),
    "no spans": ("invalid", _with({"version_spans": []})),
    "no trajectories": (
        "invalid",
        [msgpack.packb({"kind": "trajectories", "schema": 1, "trajectories": []}), b"", b"", b""],
    ),
    "wrong kind tag": (
        "invalid",
        [
            msgpack.packb({**msgpack.unpackb(plain_frames()[0]), "kind": "hello"}),
            *plain_frames()[1:],
        ],
    ),
    "spans short of the response": ("length", _with({"version_spans": [[0, 1]]})),
    "prompt frame too short": ("length", _with(prompt=np.array([5, 6], "<i4").tobytes())),
    "response as int64": ("length", _with(response=np.array([8, 9], "<i8").tobytes())),
    "logprobs as float64": ("length", _with(logprobs=np.array([-1, -1], "<f8").tobytes())),
    "odd byte count": ("length", _with(response=b"\x00" * 7)),
    "-inf logprob": ("nonfinite", _with(logprobs=np.array([-np.inf, -1], "<f4").tobytes())),
    "+inf logprob": ("nonfinite", _with(logprobs=np.array([-0.1, np.inf], "<f4").tobytes())),
    "inf beside NaN": ("nonfinite", _with(logprobs=np.array([np.nan, -np.inf], "<f4").tobytes())),
    "huge beside NaN": ("nonfinite", _with(logprobs=np.array([np.nan, -1e30], "<f4").tobytes())),
    "NaN reward": ("nonfinite", _with({"reward": math.nan})),
    "negative temperature": ("invalid", _with({"temperature": -0.5})),
    "inf temperature": ("nonfinite", _with({"temperature": math.inf})),
    "inf reward part": ("nonfinite", _with({"reward_parts": {"a": math.inf}})),
    # A float64 the learner's float32 makes inf: its group's advantages would be NaN.
    "reward past float32": ("nonfinite", _with({"reward": 1e39})),
    "reward part past float32": ("nonfinite", _with({"reward_parts": {"a": -1e39}})),
    # A lag against it would not fit msgpack (a uint64 version crashed the buffer).
    "version past the bound": ("invalid", _with({"version_spans": [[wire.MAX_VERSION + 1, 2]]})),
    "version of 2**64 - 1": ("invalid", _with({"version_spans": [[2**64 - 1, 2]]})),
}


@pytest.mark.parametrize("case", sorted(BAD_TRAJECTORIES))
def test_bad_trajectory_messages_are_rejected_by_kind(case: str) -> None:
    kind, frames = BAD_TRAJECTORIES[case]
    with pytest.raises(wire.WireError) as err:
        wire.decode_trajectories(frames)
    assert err.value.kind == kind, err.value


def test_limits_reject_oversize() -> None:
    limits = wire.Limits(max_prompt_len=2, max_response_len=8)
    with pytest.raises(wire.WireError, match="oversize"):
        wire.decode_trajectories(plain_frames(), limits)
    with pytest.raises(wire.WireError, match="oversize"):
        wire.decode_trajectories(plain_frames(), wire.Limits(max_message_bytes=64))
    with pytest.raises(wire.WireError, match="oversize"):
        frames = as_bytes(wire.encode_trajectories(make_group("g", 3)))
        wire.decode_trajectories(frames, wire.Limits(max_items=2))
    with pytest.raises(wire.WireError, match="oversize"):
        wire.decode_request([b"\x00" * 100], wire.Limits(max_request_bytes=10))


def test_the_bounds_themselves_pass() -> None:
    """The largest version and the largest float32 reward are trajectories like any."""
    t = make_traj("edge", response_len=2)
    meta = msgspec.structs.replace(
        t.meta, version_spans=[(wire.MAX_VERSION, 2)], reward=-wire.MAX_ABS_REWARD
    )
    edge = wire.Trajectory(meta, t.prompt_ids, t.response_ids, t.logprobs)
    (back,) = wire.decode_trajectories(as_bytes(wire.encode_trajectories([edge])))
    assert back.oldest_version == wire.MAX_VERSION and back.reward == -wire.MAX_ABS_REWARD


def test_encode_checks_what_the_receiver_would() -> None:
    t = make_traj("x", response_len=2)
    bad = wire.Trajectory(
        meta=t.meta,
        prompt_ids=t.prompt_ids,
        response_ids=t.response_ids,
        logprobs=np.array([np.inf, 0], "<f4"),
    )
    with pytest.raises(wire.WireError, match="nonfinite"):
        wire.encode_trajectories([bad])
    wire.encode_trajectories([bad], check=False)  # the producer may opt out


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200), st.integers(0, 3))
def test_any_bytes_decode_or_raise_wire_error(header: bytes, n_arrays: int) -> None:
    frames = [header] + [b"\x00" * 8] * n_arrays
    for decode in (wire.decode_trajectories, wire.decode_request, wire.decode_reply):
        with contextlib.suppress(wire.WireError):
            decode(frames)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.floats(-1e3, 1e3)),
        min_size=1,
        max_size=6,
    )
)
def test_round_trip_property(shapes: list[tuple[int, int, float]]) -> None:
    n = len(shapes)
    trajs = [
        make_traj("p", i, n, prompt_len=p, response_len=r, reward=rew)
        for i, (p, r, rew) in enumerate(shapes)
    ]
    got = wire.decode_trajectories(as_bytes(wire.encode_trajectories(trajs)))
    for t, g in zip(trajs, got, strict=True):
        assert g.meta == t.meta
        np.testing.assert_array_equal(g.response_ids, t.response_ids)
        np.testing.assert_array_equal(g.prompt_ids, t.prompt_ids)


def test_a_refused_message_still_names_its_tasks_and_a_garbled_one_nobody() -> None:
    """named_tasks reads only task, server and validation flag (what a receiver needs to
    report a refused message's groups and name its sender), ignoring what made it invalid."""
    bad = {**META, "group_index": 5, "server_id": "s1", "unknown_key": 1}
    frames = plain_frames(bad)
    with pytest.raises(wire.WireError):
        wire.decode_packed(frames)
    assert wire.named_tasks(frames[0]) == [wire.NamedTask("t-1", "s1", False)]
    assert wire.named_tasks(b"\x93garbage") == []
    assert wire.named_tasks(msgpack.packb({"trajectories": [{"task_id": 7}]})) == []
    many = [{"task_id": f"t{i}"} for i in range(wire.DEFAULT_LIMITS.max_items + 1)]
    assert wire.named_tasks(msgpack.packb({"trajectories": many})) == []  # bounded cost


def test_an_oversize_meta_names_the_config_key() -> None:
    limits = wire.Limits(max_response_len=1)
    with pytest.raises(wire.WireError) as e:
        wire.decode_packed(plain_frames(), limits)
    assert e.value.kind == "oversize" and e.value.key == "data.max_response_length"
