"""The control plane's pure rules with small hand-computed inputs: admission and its budget,
the task ledger (deals, re-deals, refunds), the dataset cursor, sync generations and the
control messages. No sockets; the import check runs a fresh interpreter. The registry's
rules (:class:`ControlState`) are tested in ``tests/test_admission_registry.py``."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from asyncrl.config import ConfigError
from asyncrl.control import messages as m
from asyncrl.control.admission import (
    Budget,
    budget_limit,
    grantable,
    groups_per_version,
    push_due,
    replayed_version,
)
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource, epoch_order
from asyncrl.sync.plan import TensorSpec, WeightPlan, plan_buckets
from asyncrl.tasks import make_row
from asyncrl.wire import DroppedTask, WireError

PLAN = plan_buckets([TensorSpec("w", (2, 3), "float32")], bucket_bytes=1 << 20)


def _rows(n: int, split: str = "train") -> list[dict]:
    return [make_row("arithmetic", f"{i}+1=", str(i + 1), split=split, index=i) for i in range(n)]


def _ledger(lag: int, per_version: int, n_train: int = 100, n_val: int = 0) -> TaskLedger:
    source = TaskSource(_rows(n_train), _rows(n_val, "test"), seed=3, n=2, val_n=1, lineage="")
    return TaskLedger(source, Budget(lag, per_version))


def _drain(ledger: TaskLedger, server: str = "a", per_request: int = 3) -> list[m.Task]:
    """Deal until refused, like a server asking again and again."""
    out = []
    while True:
        tasks, reason = ledger.deal(server, per_request)
        out += tasks
        if reason:
            return out


# ----------------------------------------------------------------------- the rule
def test_budget_formula_hand_computed():
    assert groups_per_version(4, 2) == 8
    assert budget_limit(0, 0, 8) == 8  # synchronous: one version's worth
    assert budget_limit(0, 1, 8) == 16
    assert budget_limit(24, 4, 8) == 64  # 24 consumed (3 versions' worth) + (4 + 1) * 8
    assert grantable(10, 0, 1, 8) == 6
    assert grantable(20, 0, 1, 8) == 0  # never negative
    with pytest.raises(ValueError):
        groups_per_version(0, 1)


def test_budget_window_moves_with_consumption_not_versions():
    b = Budget(max_policy_lag=1, per_version=3)
    assert (b.limit, b.free(4)) == (6, 2)
    b.advance(5)  # a restart or a registration: the version moves, the window does not
    assert b.limit == 6
    b.consume(3)
    assert (b.limit, b.free(4)) == (9, 5)
    b.consume(2)  # consumption never goes back
    assert b.consumed == 3
    with pytest.raises(ValueError, match="cannot go back"):
        b.advance(0)
    restored = Budget(1, 3)
    restored.load_state_dict(b.state_dict())
    assert restored == b
    legacy = Budget(1, 3)  # a checkpoint of the version rule: consumed = version * G
    legacy.load_state_dict({"version": 4, "dealt": 7})
    assert legacy.consumed == 12


def test_the_window_moves_when_weights_are_sent_and_deals_carry_the_version_being_loaded():
    b = Budget(max_policy_lag=1, per_version=3)
    assert (b.limit, b.deal_version) == (6, 0)
    b.sent(1, 3)  # version 1, trained on 3 groups, reached every member: loading now
    assert (b.limit, b.version, b.deal_version) == (9, 0, 1)
    b.consume(3)  # the members' reports close the round: nothing more opens
    b.advance(1)
    assert (b.limit, b.version, b.deal_version) == (9, 1, 1)
    assert "sent_version" not in b.state_dict()  # a restored run pushes again


def _consume(ledger: TaskLedger, versions: int = 1) -> None:
    """A learner that consumed ``versions`` versions' worth and pushed."""
    b = ledger.budget
    b.consume(b.consumed + versions * b.per_version)
    b.advance(b.version + versions)


def _identity(ledger: TaskLedger, kind: str = "train") -> dict[str, float]:
    acct = ledger.accounting()
    assert acct[f"accounting/{kind}/unaccounted"] == 0
    return {k.split("/", 2)[2]: v for k, v in acct.items() if k.startswith(f"accounting/{kind}")}


@pytest.mark.parametrize("lag", [0, 1, 4])
def test_ledger_deals_exactly_the_budget_and_resumes_per_version(lag):
    ledger = _ledger(lag, per_version=8)
    first = _drain(ledger)
    assert len(first) == (lag + 1) * 8
    assert ledger.deal("a", 3) == ([], "budget")
    _consume(ledger)
    assert len(_drain(ledger)) == 8  # one more version's worth, no more
    ids = [t.task_id for t in first]
    assert len(set(ids)) == len(ids) and all(t.n == 2 and not t.validation for t in first)


# ----------------------------------------------------------------------- ledger
def test_dead_server_tasks_are_redealt_under_their_ids_and_the_budget_corrected():
    ledger = _ledger(lag=0, per_version=6)
    to_a, _ = ledger.deal("a", 3)
    to_b, _ = ledger.deal("b", 3)
    assert ledger.budget.free(ledger.committed) == 0
    ledger.ack([to_a[0].task_id])
    back = ledger.release("a", "dead")
    assert [t.task_id for t in back] == [t.task_id for t in to_a[1:]]
    assert ledger.committed == 4 and ledger.counts["requeued/dead"] == 2
    again, reason = ledger.deal("b", 5)
    # Exactly the two unacknowledged tasks, same ids, next attempt; then the budget is full.
    assert [t.task_id for t in again] == [t.task_id for t in to_a[1:]]
    assert [t.attempt for t in again] == [1, 1] and reason == "budget"
    assert ledger.committed == 6
    assert set(ledger.owned["b"]) == {t.task_id for t in to_b + again}
    assert _identity(ledger)["dealt"] == 6  # a re-deal is the same task, counted once


def test_buffer_drops_are_refunded_once():
    ledger = _ledger(lag=0, per_version=4)
    tasks, _ = ledger.deal("a", 4)
    ids = [t.task_id for t in tasks]
    ledger.ack(ids[:2])
    drops = [DroppedTask(ids[0], "lag"), DroppedTask(ids[0], "lag")]
    assert ledger.dropped(drops).refunded == 1  # a repeated report changes nothing
    assert ledger.dropped([DroppedTask(ids[2], "expired")]).refunded == 1  # still outstanding
    assert ids[2] not in ledger.outstanding  # its group cannot complete: not owed any more
    ledger.release("a", "dead")  # ids[3] goes to the re-deal queue, no longer charged
    assert ledger.dropped([DroppedTask(ids[3], "expired")]).refunded == 0  # leaves the queue only
    assert not ledger.redeal
    assert ledger.committed == 1
    acct = _identity(ledger)
    assert (acct["dropped/lag"], acct["dropped/expired"], acct["in_buffer"]) == (1, 2, 1)


def test_prompts_dropped_for_lag_are_dealt_again_under_new_ids_then_given_up():
    """A long answer overtaken by the lag window is not lost for the epoch: its prompt is
    dealt again (new id, same row, charged again) up to lag_retries times."""
    source = TaskSource(_rows(20), seed=3, n=2, lineage="")
    ledger = TaskLedger(source, Budget(0, 2), lag_retries=2)
    first, _ = ledger.deal("a", 2)
    ledger.ack([t.task_id for t in first])
    tid = first[0].task_id
    assert ledger.dropped([DroppedTask(tid, "lag")]) == (1, 0, 0, 0)  # refunded, queued again
    _consume(ledger)  # the learner moved on
    again, reason = ledger.deal("a", 1)  # the retry comes before new prompts
    assert [t.task_id for t in again] == [f"{tid}/1"] and reason == ""
    assert again[0].prompt == first[0].prompt and again[0].dealt_version == 1
    assert source.task_for_id(f"{tid}/1").prompt == first[0].prompt  # restorable by id
    ledger.ack([f"{tid}/1"])
    ledger.dropped([DroppedTask(f"{tid}/1", "lag")])
    assert list(ledger.redeal) == [f"{tid}/2"]
    retry, _ = ledger.deal("a", 1)
    ledger.ack([retry[0].task_id])
    drops = ledger.dropped(
        [DroppedTask(f"{tid}/2", "lag"), DroppedTask(first[1].task_id, "expired")]
    )
    assert drops.given_up == 1  # the ledger says so itself: no counter diffing
    assert not ledger.redeal  # retries used up; expiry is not a lag drop
    assert (ledger.counts["lag_retried"], ledger.counts["lag_given_up"]) == (2, 1)
    assert _identity(ledger)["dropped/lag"] == 3
    with pytest.raises(KeyError):
        source.task_for_id(f"{tid}/0")


def test_a_group_the_full_buffer_had_no_room_for_is_named_overflow_and_dealt_again():
    """The buffer's ``overflow`` (more incomplete groups open than it holds) is the
    buffer's limit, not the prompt's: named in the accounting as it is, and the prompt is
    dealt again (it was read as ``expired`` and lost for the epoch)."""
    from buffer.core import ReplayBuffer
    from tests.test_accounting import _group

    source = TaskSource(_rows(20), seed=3, n=2, lineage="")
    ledger = TaskLedger(source, Budget(0, 2), lag_retries=1)
    (t1, t2), _ = ledger.deal("a", 2)
    ledger.ack([t1.task_id, t2.task_id])
    buf = ReplayBuffer(batch_size=2, capacity_groups=1, max_policy_lag=1)
    assert buf.add(_group(t1, 0).trajectories[0], 0.0) == "added"  # one group open
    assert buf.add(_group(t2, 0).trajectories[0], 0.0) == "overflow"
    drops = ledger.dropped(buf.take_dropped())
    assert (drops.refunded, drops.overflowed) == (1, 1)
    acct = _identity(ledger)
    assert (acct["dropped/overflow"], acct["dropped/expired"]) == (1, 0)
    assert list(ledger.redeal) == [f"{t2.task_id}/1"]
    assert ledger.counts["overflow_retried"] == 1
    # Out of retries (a review: it was still said "dealt again", and counted as such).
    (again,), _ = ledger.deal("a", 1)
    ledger.ack([again.task_id])
    drops = ledger.dropped([DroppedTask(again.task_id, "overflow")])
    assert (drops.overflowed, drops.overflow_given_up) == (0, 1) and not ledger.redeal
    assert ledger.counts["overflow_given_up"] == 1


def test_groups_the_buffer_refused_are_named_as_it_named_them_and_not_dealt_again():
    """A message the buffer refuses (a response over data.max_response_length, an invalid
    trajectory) has its groups reported ``oversize`` or ``invalid``: the accounting names
    the cause (``invalid`` read as ``expired``), and neither is dealt again (the buffer
    would refuse it the same way)."""
    source = TaskSource(_rows(20), seed=3, n=2, lineage="")
    ledger = TaskLedger(source, Budget(0, 2), lag_retries=1)
    (t1, t2), _ = ledger.deal("a", 2)
    ledger.ack([t1.task_id, t2.task_id])
    drops = ledger.dropped(
        [DroppedTask(t1.task_id, "oversize"), DroppedTask(t2.task_id, "invalid")]
    )
    assert drops.refunded == 2 and not ledger.redeal
    acct = _identity(ledger)
    assert (acct["dropped/oversize"], acct["dropped/invalid"], acct["dropped/expired"]) == (1, 1, 0)


def test_validation_is_dealt_first_and_outside_the_budget():
    ledger = _ledger(lag=0, per_version=2, n_val=3)
    assert len(_drain(ledger)) == 2
    number = ledger.source.start_validation()
    tasks, reason = ledger.deal("a", 5)
    assert [t.task_id for t in tasks] == [f"val/{number}/{i}" for i in range(3)]
    assert all(t.validation and t.n == 1 for t in tasks) and reason == "budget"
    assert ledger.committed == 2
    ledger.release("a", "dead")  # everything it held comes back, in deal order
    again, _ = ledger.deal("b", 5)
    assert [t.validation for t in again] == [False, False, True, True, True]
    assert ledger.committed == 2 and ledger.counts["requeued/dead"] == 5
    assert _identity(ledger, "val")["in_flight"] == 3


# ----------------------------------------------------------------------- the dataset cursor
def test_epochs_are_seeded_permutations_with_deterministic_ids():
    source = TaskSource(_rows(5), seed=7, total_epochs=2, lineage="")
    tasks = [source.next_train() for _ in range(10)]
    assert source.next_train() is None and source.exhausted
    rows = [[t.extra_info["index"] for t in tasks[:5]], [t.extra_info["index"] for t in tasks[5:]]]
    assert sorted(rows[0]) == sorted(rows[1]) == list(range(5))
    assert rows == [epoch_order(5, 0, 7, True), epoch_order(5, 1, 7, True)]
    assert rows[0] != rows[1]  # a new order per epoch (true for this seed)
    assert [t.task_id for t in tasks[4:6]] == ["train/0/4", "train/1/0"]
    assert TaskSource(_rows(5), shuffle=False, lineage="").next_train().extra_info["index"] == 0
    assert source.task_for_id("train/1/2") == msgspec.structs.replace(tasks[7], dealt_version=0)


def test_cursor_state_round_trip():
    source = TaskSource(_rows(6), _rows(2, "test"), seed=2, lineage="")
    for _ in range(8):
        source.next_train()
    source.start_validation()
    source.next_val()
    fresh = TaskSource(_rows(6), _rows(2, "test"), seed=2, lineage="")
    fresh.load_state_dict(source.state_dict())
    assert fresh.next_val() == source.next_val()
    assert [fresh.next_train() for _ in range(5)] == [source.next_train() for _ in range(5)]
    # Another dataset or order: a config error (exit 2, not restarted) naming the fix.
    with pytest.raises(ConfigError, match="cursor is for 6 training rows") as other:
        TaskSource(_rows(7), _rows(2, "test"), seed=2, lineage="").load_state_dict(
            source.state_dict()
        )
    assert "trainer.resume_mode=disable" in str(other.value)
    # Another validation set: refused only while a round of the saved one is being dealt.
    half = TaskSource(_rows(6), _rows(2, "test"), seed=2, lineage="")
    half.start_validation()
    half.next_val()
    with pytest.raises(ConfigError, match="validation rounds are over 2 rows; data.val_files"):
        TaskSource(_rows(6), _rows(1, "test"), seed=2, lineage="").load_state_dict(
            half.state_dict()
        )
    TaskSource(_rows(6), _rows(1, "test"), seed=2, lineage="").load_state_dict(source.state_dict())
    older = {k: v for k, v in source.state_dict().items() if k != "val_rows"}
    TaskSource(_rows(6), _rows(2, "test"), seed=2, lineage="").load_state_dict(older)


# ----------------------------------------------------------------------- sync rounds
def test_generation_is_kept_while_membership_is_unchanged():
    book = SyncBook()
    r1 = book.begin([("a", 1), ("b", 2)], 1, PLAN)
    assert (r1.generation, r1.ranks, r1.world_size, r1.new_group) == (
        "main/1",
        {"a": 1, "b": 2},
        4,
        True,
    )
    for server, rank in r1.ranks.items():
        assert book.start_for(server).rank == rank
        book.report(m.SyncDone(server_id=server, sync_id=1, version=1, ok=True))
    assert book.finish(sent_ok=True).ok == ["a", "b"]
    r2 = book.begin([("a", 1), ("b", 2)], 2, PLAN)
    assert (r2.generation, r2.new_group) == ("main/1", False)  # same group, reused
    book.report(m.SyncDone(server_id="a", sync_id=2, version=2, ok=True))
    result = book.finish(sent_ok=True)  # b never answered
    assert result.ok == ["a"] and "no answer" in result.failed["b"]
    r3 = book.begin([("a", 1)], 3, PLAN)
    assert (r3.generation, r3.new_group, r3.world_size) == ("main/3", True, 2)


def test_a_lost_member_forces_a_new_generation():
    book = SyncBook()
    book.begin([("a", 1)], 1, PLAN)
    book.report(m.SyncDone(server_id="a", sync_id=1, version=1, ok=True))
    book.finish(True)
    book.lose("a", "re-registered (restarted)")  # same id, new process
    assert book.begin([("a", 1)], 2, PLAN).new_group


# ----------------------------------------------------------------------- messages
def test_messages_round_trip_and_reject_other_schemas():
    start = m.SyncStart(
        sync_id=3,
        version=2,
        generation="main/3",
        rank=1,
        world_size=2,
        plan=PLAN,
    )
    ann = m.Announcement(registered=True, policy_version=2, sync=start)
    assert m.decode_reply(m.encode(ann)) == ann  # the plan travels as it is
    raw = msgspec.msgpack.decode(m.encode(start))  # untyped, as vLLM's RPC hands it on
    bucket = {"dtype": "float32", "numel": 6, "entries": [["w", [2, 3], 0, 6]]}
    assert raw["plan"] == {"buckets": [bucket]}
    assert msgspec.convert(raw["plan"], WeightPlan) == PLAN
    raw["plan"]["buckets"][0]["numel"] = -1  # a plan is validated like any other field
    bad = {"kind": "announcement", "registered": True, "policy_version": 2, "sync": raw}
    with pytest.raises(WireError, match="numel"):
        m.decode_reply(msgspec.msgpack.encode(bad))
    task = TaskSource(_rows(1), n=3, lineage="").next_train()
    grant = m.TaskGrant(tasks=[task], policy_version=0)
    assert m.decode_reply(m.encode(grant)) == grant
    raw = msgspec.msgpack.encode({"kind": "leave", "schema": 99, "server_id": "a"})
    with pytest.raises(WireError, match="schema version 99"):
        m.decode_request(raw)
    with pytest.raises(WireError):
        m.decode_request(b"\x93not msgpack of a request")


@pytest.mark.parametrize("module", ["asyncrl.control", "tests.standins.rollout"])
def test_the_control_plane_does_not_import_torch(module):
    """Checked in a fresh interpreter: a grep cannot see lazy or indirect imports."""
    code = (
        f"import sys, {module}; "
        "print(','.join(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import {module} pulled in {out.stdout.strip()}"


def test_a_replay_reaches_the_versions_its_previous_life_pushed():
    """Pushes every ``sync_every`` steps and after the last: a learner restored at step 4,
    version 2 (sync_every=2) that trains 5 redelivered batches again (steps 5-9) pushes after
    steps 6 and 8 as its previous life did; the last step (10 of 10) always pushes."""
    assert [push_due(s, 2, 10) for s in range(1, 11)] == [False, True] * 5
    assert push_due(7, 2, 7)
    assert replayed_version(2, 4, 5, sync_every=2, total=10) == 4
    assert replayed_version(2, 4, 0, sync_every=2, total=10) == 2
    assert replayed_version(2, 4, 9, sync_every=2, total=9) == 5  # steps 5-9, 9 the last
