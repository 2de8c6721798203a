"""The pure replay buffer on small hand-computed inputs (no sockets, no clocks)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.wire import DroppedTask, Group, Packed
from buffer.core import ReplayBuffer
from learner.validation import per_source
from tests.standins.trajgen import make_group, make_traj

pytestmark = pytest.mark.timeout(60)


def buf(**kw: object) -> ReplayBuffer:
    args = {"batch_size": 2, "capacity_groups": 100, "max_policy_lag": 1, "group_timeout_s": 10}
    return ReplayBuffer(**(args | kw))


def add_group(b: ReplayBuffer, tid: str, size: int = 2, now: float = 0.0, **kw: object) -> None:
    for t in make_group(tid, size, **kw):
        b.add(t, now)


def add_whole(b: ReplayBuffer, tid: str, size: int = 2, **kw: object) -> list[str]:
    return b.add_packed(Packed.pack(make_group(tid, size, **kw)), 0.0)


# ----------------------------------------------------------------------- completeness
def test_a_group_is_released_only_when_complete() -> None:
    b = buf()
    assert b.add(make_traj("a", 0, 3), 0.0) == "added"
    assert b.add(make_traj("b", 1, 2), 0.0) == "added"
    assert b.add(make_traj("a", 2, 3), 0.0) == "added"
    assert b.add(make_traj("b", 0, 2), 0.0) == "completed"
    assert b.release(0) is None  # one complete group; a batch needs two
    assert b.add(make_traj("a", 1, 3), 0.0) == "completed"
    batch = b.release(0)
    assert batch is not None and batch.task_ids == ["b", "a"]  # completion order
    a = batch.groups[1]
    assert [m.group_index for m in a.metas] == [0, 1, 2]
    assert (a.trajectories[2].response_ids == make_traj("a", 2, 3).response_ids).all()
    assert b.metrics()["buffer/incomplete"] == 0.0


def test_whole_group_messages_skip_the_partial_stage() -> None:
    b = buf()
    assert add_whole(b, "a", 3) == ["completed"] * 3
    # Out of order, or not a whole group: member by member, same result.
    trajs = make_group("b", 3)
    assert b.add_packed(Packed.pack([trajs[2], trajs[0], trajs[1]]), 0.0) == [
        "added",
        "added",
        "completed",
    ]
    batch = b.release(0)
    assert batch is not None and batch.task_ids == ["a", "b"]
    assert [m.group_index for m in batch.groups[1].metas] == [0, 1, 2]
    assert b.counts["trajectories_in"] == 6


# ----------------------------------------------------------------------- duplicates
def test_second_copies_of_a_task_id_are_dropped_and_counted() -> None:
    b = buf()
    assert b.add(make_traj("a", 0, 2), 0.0) == "added"
    assert b.add(make_traj("a", 0, 2), 0.0) == "duplicate"  # same member again
    assert b.add(make_traj("a", 1, 2), 0.0) == "completed"
    assert add_whole(b, "a", 2) == ["duplicate", "duplicate"]  # the task re-dealt
    assert b.add(make_traj("a", 1, 3), 0.0) == "duplicate"
    assert b.add(make_traj("c", 0, 2), 0.0) == "added"
    assert b.add(make_traj("c", 1, 3), 0.0) == "inconsistent"  # group size disagrees
    m = b.metrics()
    assert m["buffer/drops/duplicate"] == 4.0 and m["buffer/drops/inconsistent"] == 1.0
    assert m["buffer/groups_in"] == 1.0 and m["buffer/trajectories_in"] == 3.0
    assert b.take_dropped() == []  # duplicates do not return to the admission budget


# ----------------------------------------------------------------------- lag
def test_lag_drops_exactly_the_groups_beyond_the_limit() -> None:
    b = buf(max_policy_lag=1)
    add_group(b, "v0", version=0)  # lag 3 at version 3
    add_group(b, "v1-3", spans=[(1, 2), (3, 2)])  # oldest token from version 1: lag 2
    add_group(b, "v2", version=2)  # lag 1: kept
    add_group(b, "v3", version=3)  # lag 0: kept
    batch = b.release(3)
    assert batch is not None and batch.task_ids == ["v2", "v3"]
    assert batch.lag_histogram == {0: 1, 1: 1} and batch.policy_version == 3
    assert b.take_dropped() == [DroppedTask("v0", "lag"), DroppedTask("v1-3", "lag")]
    assert b.take_dropped() == []
    m = b.metrics()
    assert m["buffer/drops/lag"] == 2.0 and m["buffer/lag_max"] == 1.0
    assert m["buffer/lag_mean"] == 0.5 and m["buffer/lag_hist/1"] == 1.0


def test_lag_uses_the_highest_version_seen() -> None:
    b = buf(max_policy_lag=0)
    add_group(b, "a", version=4)
    add_group(b, "b", version=5)
    assert b.release(5) is None  # a dropped (lag 1), b waits for a partner
    add_group(b, "c", version=5)
    add_group(b, "d", version=4)
    batch = b.release(3)  # an older version in a request changes nothing
    assert batch is not None and batch.task_ids == ["b", "c"] and batch.policy_version == 5
    assert [d.task_id for d in b.take_dropped()] == ["a", "d"]


def test_max_policy_lag_zero_is_the_synchronous_baseline() -> None:
    b = buf(max_policy_lag=0)
    add_group(b, "old", version=0)
    add_group(b, "new1", version=1)
    add_group(b, "new2", version=1)
    batch = b.release(1)
    assert batch is not None and batch.task_ids == ["new1", "new2"]
    assert batch.lag_histogram == {0: 2}


# ----------------------------------------------------------------------- validation
def test_validation_groups_go_to_stats_never_to_batches() -> None:
    b = buf()
    add_group(b, "val-a", 2, validation=True, data_source="gsm8k", response_len=3)
    add_group(b, "val-b", 3, validation=True, data_source="countdown", reward=0.5)
    add_group(b, "train", 2)
    assert b.release(0) is None  # only one training group
    add_group(b, "train2", 2)
    batch = b.release(0)
    assert batch is not None and batch.task_ids == ["train", "train2"]
    results = b.reports.results  # ids with no round: each id is its own round
    assert set(results["val-a"]) == {"val-a"} and set(results["val-b"]) == {"val-b"}
    stats = per_source([*results["val-a"].values(), *results["val-b"].values()])
    # make_group gives member i the reward i unless told otherwise.
    assert stats["gsm8k"].groups == 1 and stats["gsm8k"].trajectories == 2
    assert stats["gsm8k"].reward_mean == 0.5 and stats["gsm8k"].response_length_mean == 3
    assert stats["countdown"].reward_sum == 1.5 and stats["countdown"].reward_mean == 0.5
    g = stats["gsm8k"]  # rewards 0 and 1: squares for the standard errors
    assert (g.reward_sq_sum, g.group_mean_sum, g.group_mean_sq_sum) == (1.0, 0.5, 0.25)
    assert len(b.reports.results) == 2  # never drained: a lost reply is read again
    assert set(b.reports.results_for(["val-b", "val-c"])) == {"val-b"}  # the rounds asked
    assert b.metrics()["buffer/val_groups_in"] == 2.0


# ----------------------------------------------------------------------- policies
def test_fifo_releases_oldest_first_each_once() -> None:
    b = buf(batch_size=2)
    for tid in "abcde":
        add_group(b, tid)
    assert b.release(0).task_ids == ["a", "b"]
    assert b.release(0).task_ids == ["c", "d"]
    assert b.release(0) is None


def test_uniform_replay_respects_the_reuse_limit() -> None:
    b = buf(batch_size=2, policy="uniform", max_reuse=2, seed=3)
    for tid in "abc":
        add_group(b, tid)
    uses: Counter[str] = Counter()
    while (batch := b.release(0)) is not None:
        assert len(set(batch.task_ids)) == 2  # no group twice in one batch
        uses.update(batch.task_ids)
        b.ack([batch.batch_id])
    assert uses == {"a": 2, "b": 2, "c": 2}
    assert b.metrics()["buffer/size"] == 0.0  # used up and acknowledged: forgotten


def test_fifo_refuses_reuse() -> None:
    with pytest.raises(ValueError):
        ReplayBuffer(batch_size=1, capacity_groups=1, max_policy_lag=0, max_reuse=2)


# ----------------------------------------------------------------------- capacity
def test_full_buffer_asks_for_backpressure_and_unacked_batches_count() -> None:
    b = buf(batch_size=1, capacity_groups=2)
    add_group(b, "a")
    assert b.has_room()
    add_group(b, "b")
    assert not b.has_room()  # full: fresh data is never evicted
    first = b.release(0)
    assert first is not None and not b.has_room()  # released but not acknowledged
    b.ack([first.batch_id])
    assert b.has_room()


def test_incomplete_groups_have_their_own_bound() -> None:
    """Past the bound a new group overflows, while the reading goes on: the members that
    complete the open groups must get in (a producer may send a member at a time)."""
    b = buf(capacity_groups=2)
    b.add(make_traj("a", 0, 2), 0.0)
    b.add(make_traj("b", 0, 2), 0.0)
    assert b.has_room()
    assert b.add(make_traj("c", 0, 2), 0.0) == "overflow"
    assert b.add(make_traj("a", 1, 2), 0.0) == "completed"
    assert b.metrics()["buffer/drops/overflow"] == 1.0


def test_uniform_evicts_used_groups_to_make_room_never_fresh_ones() -> None:
    b = buf(batch_size=2, capacity_groups=3, policy="uniform", max_reuse=5, seed=0)
    for tid in "abc":
        add_group(b, tid)
    assert not b.has_room()
    batch = b.release(0)
    assert batch is not None and not b.has_room()  # used ones are still unacknowledged
    used = set(batch.task_ids)
    fresh = ({"a", "b", "c"} - used).pop()
    b.ack([batch.batch_id])
    assert b.has_room() and b.metrics()["buffer/evicted"] == 1.0
    add_group(b, "d")  # full again: the other used group goes, the fresh ones stay
    assert b.has_room() and b.metrics()["buffer/evicted"] == 2.0
    pool = Counter()
    for _ in range(20):
        got = b.release(0)
        assert got is not None
        pool.update(got.task_ids)
        b.ack([got.batch_id])
        if set(pool) >= {fresh, "d"} and len(pool) == 2:
            break
    assert set(pool) <= {fresh, "d"}


# ----------------------------------------------------------------------- expiry
def test_incomplete_groups_expire_and_late_members_are_dropped() -> None:
    b = buf(group_timeout_s=10)
    b.add(make_traj("a", 0, 2), 0.0)
    b.add(make_traj("v", 0, 2, validation=True), 4.0)
    assert b.expire(10.0) == []
    assert b.expire(10.5) == ["a"]
    assert b.expire(14.5) == ["v"]
    assert b.add(make_traj("a", 1, 2), 11.0) == "late"
    assert b.take_dropped() == [DroppedTask("a", "expired"), DroppedTask("v", "expired", True)]
    m = b.metrics()
    assert m["buffer/drops/expired"] == 2.0 and m["buffer/drops/late"] == 1.0
    assert m["buffer/incomplete"] == 0.0


# ----------------------------------------------------------------------- ack and restart
def test_unacked_batches_are_released_again_in_order_after_a_restart() -> None:
    b = buf(batch_size=1)
    for tid in "abcd":
        add_group(b, tid)
    b0, b1, b2 = (b.release(0) for _ in range(3))
    assert [x.batch_id for x in (b0, b1, b2)] == [0, 1, 2]
    assert b.ack([0, 9]) == ([0], [9])
    assert b.restart() == (2, 0)
    again1, again2, new = b.release(0), b.release(0), b.release(0)
    assert (again1.batch_id, again1.task_ids, again1.redelivered) == (1, ["b"], True)
    assert (again2.batch_id, again2.task_ids) == (2, ["c"])
    assert (new.batch_id, new.task_ids, new.redelivered) == (3, ["d"], False)
    assert again1.groups[0] is b1.groups[0]  # the same group object
    # With the buffer's metrics as they are now (a review: those of its first release,
    # so buffer/redeliver_pending read 0 on every step of a replay).
    assert b1.metrics["buffer/redeliver_pending"] == 0.0
    assert again1.metrics["buffer/redeliver_pending"] == 1.0
    assert again1.metrics["buffer/batches_redelivered"] == 1.0


def test_a_redelivered_batch_sent_again_is_still_marked_redelivered() -> None:
    """A replayed batch whose reply the learner never received comes again, as every
    batch does, and still as a replay (it came unmarked, as new)."""
    b = buf(batch_size=1)
    add_group(b, "a")
    assert b.release(0, "learner", (b.session, None)).batch_id == 0
    b.restart(None, "learner")
    assert b.release(0, "learner", (b.session, None)).redelivered  # its reply is lost
    again = b.release(0, "learner", (b.session, None))
    assert (again.batch_id, again.redelivered) == (0, True)
    assert b.metrics()["buffer/batches_resent"] == 1.0


def test_restart_acknowledges_what_the_checkpoint_contains() -> None:
    b = buf(batch_size=1)
    for tid in "abc":
        add_group(b, tid)
    for _ in range(3):
        b.release(0)
    # The consumer saved a checkpoint after batch 1 but crashed before acknowledging.
    assert b.restart(acked_through=1, session=b.session) == (1, 2)
    assert b.release(0).task_ids == ["c"]
    assert b.release(0) is None
    # A second restart queues the same batch again; acknowledging it empties the queue.
    assert b.restart() == (1, 0)
    b.ack([2])
    assert b.release(0) is None and b.metrics()["buffer/unacked_batches"] == 0.0


def test_a_hello_from_another_client_leaves_the_learners_batches_alone() -> None:
    b = buf(batch_size=1)
    for tid in "abc":
        add_group(b, tid)
    assert b.release(0, "learner").task_ids == ["a"]
    assert b.restart(None, "coordinator") == (0, 0)  # e.g. checking the buffer is up
    second = b.release(0, "learner")
    assert second.task_ids == ["b"] and not second.redelivered
    assert b.restart(None, "learner") == (2, 0)
    assert [b.release(0, "learner").task_ids for _ in range(3)] == [["a"], ["b"], ["c"]]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("member"), st.integers(0, 7), st.integers(0, 2)),
            st.tuples(st.just("release"), st.integers(0, 3), st.just(0)),
            st.tuples(st.just("ack_oldest"), st.just(0), st.just(0)),
            st.tuples(st.just("crash"), st.booleans(), st.just(0)),
        ),
        max_size=80,
    )
)
def test_every_task_is_acknowledged_exactly_once_across_crashes(ops: list) -> None:
    """A consumer that trains, acknowledges, and crashes at random points: a group is in one
    live batch at a time, and in the end every complete group is acknowledged exactly once."""
    b = ReplayBuffer(batch_size=2, capacity_groups=1000, max_policy_lag=10, group_timeout_s=1e9)
    received: list = []  # batches the live consumer holds, unacknowledged
    acked_tasks: list[str] = []
    for op, x, y in ops:
        if op == "member":
            b.add(make_traj(f"t{x}", y, 3, version=0), 0.0)
        elif op == "release":
            batch = b.release(x)
            if batch is not None:
                live = {t for r in received for t in r.task_ids}
                assert not live & set(batch.task_ids)
                received.append(batch)
        elif op == "ack_oldest" and received:
            batch = received.pop(0)
            acked, _ = b.ack([batch.batch_id])
            if acked:
                acked_tasks += batch.task_ids
        elif op == "crash":
            last = max((r.batch_id for r in received[:1]), default=None) if x else None
            if last is not None:  # its checkpoint holds the oldest batch it had
                acked_tasks += received[0].task_ids
            b.restart(last)
            received = []
    # A last restart, then everything is drained: each complete task exactly once.
    b.restart(None)
    while (batch := b.release(0)) is not None:
        b.ack([batch.batch_id])
        acked_tasks += batch.task_ids
    members: dict[str, set[int]] = {}
    for op, x, y in ops:
        if op == "member":
            members.setdefault(f"t{x}", set()).add(y)
    complete = {t for t, idx in members.items() if len(idx) == 3}
    assert len(acked_tasks) == len(set(acked_tasks))
    # Complete groups beyond the last full batch are still waiting for a partner.
    assert set(acked_tasks) <= complete and len(complete - set(acked_tasks)) < 2
    assert b.metrics()["buffer/groups_acked"] == len(acked_tasks)


def test_metrics_use_slash_namespaces() -> None:
    b = buf()
    add_group(b, "a")
    m = b.metrics()
    assert all(k.startswith("buffer/") for k in m)
    for key in ("buffer/size", "buffer/drops/lag", "buffer/drops/duplicate", "buffer/groups_in"):
        assert key in m


def test_groups_keep_their_members_arrays() -> None:
    b = buf(batch_size=1)
    trajs = make_group("a", 3, response_len=6)
    for t in reversed(trajs):
        b.add(t, 0.0)
    group: Group = b.release(0).groups[0]
    for t, want in zip(group.trajectories, trajs, strict=True):
        assert (t.response_ids == want.response_ids).all()
        assert (t.logprobs == want.logprobs).all()
        assert t.meta == want.meta


def test_a_member_waiting_for_its_group_does_not_keep_its_message_alive() -> None:
    """A received message's arrays are views of its frames: one member of an incomplete
    group kept as such a view pinned the whole message (its other groups, its dropped
    copies) until the group completed or expired (600 s): 358 MB resident for 1.2 MB kept
    in a review's run. A member waiting for its group now has arrays of its own."""
    from asyncrl.wire.codec import decode_packed, encode_packed

    b = buf()
    first = make_group("a", 2, response_len=6)[0]
    copies = [make_traj("done", 0, 1, response_len=6)] * 50  # a group of 1, then 49 copies
    frames = [bytes(f) for f in encode_packed(Packed.pack([first, *copies]))]
    outcomes = b.add_packed(decode_packed(frames), 0.0)
    assert outcomes == ["added", "completed"] + ["duplicate"] * 49
    (member,) = b._s.partial["a"].members.values()  # waiting for its group
    payload = [np.frombuffer(f, dtype=np.uint8) for f in frames]
    for arr in (member.prompt_ids, member.response_ids, member.logprobs):
        assert not any(np.shares_memory(arr, p) for p in payload)
    assert (member.response_ids == first.response_ids).all()


def test_oldest_first_equals_a_stable_sort_of_the_pool() -> None:
    """The scan that stops early picks what sorting the whole pool by version picked."""
    import random as _random
    from types import SimpleNamespace
    from typing import cast

    from buffer.release_order import oldest_first
    from buffer.state import Held, State

    rng = _random.Random(3)
    for trial in range(200):
        s = State()
        for i in range(rng.randint(0, 60)):
            tid = f"t{trial}-{i}"
            version = rng.randint(0, 5)
            s.held[tid] = cast(Held, SimpleNamespace(oldest_version=version))
            s.pool[tid] = None
            s.pool_versions[version] += 1
        k = rng.randint(1, 20)
        expected = sorted(s.pool, key=lambda t: s.held[t].oldest_version)[:k]
        assert oldest_first(s, k) == expected
