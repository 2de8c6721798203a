"""Recovery paths between features, each a defect found by reading two features together:
a learner restart without a checkpoint beside a buffer that survived, a buffer restart
before a learner restart, external slots across a restart, a replay that counts a batch
nobody trained, a replay whose buffer restarts, a reply that comes after its requester stopped waiting, and a message that
announces huge groups. The real ledger, coordinator state and buffer, stepped by hand; the
late replies over real sockets on 127.0.0.1.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from asyncrl.control import loop as control_loop
from asyncrl.control import messages as m
from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource
from asyncrl.net.buffer_client import BufferClient
from asyncrl.sync.plan import WeightPlan
from asyncrl.tasks import make_row
from asyncrl.wire import DroppedTask, Packed
from buffer.core import ReplayBuffer
from buffer.service import BufferService
from tests.standins.trajgen import make_group

pytestmark = pytest.mark.timeout(60)

B, N, LAG = 4, 2, 1  # groups per batch, samples per group, max_policy_lag


def _state(lineage: str = "", session: str = "") -> ControlState:
    rows = [
        make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(400)
    ]
    source = TaskSource(rows, shuffle=False, n=N, lineage=lineage)
    ledger = TaskLedger(source, Budget(LAG, B), lag_retries=1, session=session)
    st = ControlState(
        ledger, SyncBook(), heartbeat_s=0.5, dead_after_s=2.0, store_host="h", store_port=1
    )
    st.register(m.Register(server_id="s", engine_world_size=0), now=0.0)
    return st


def _packed(task: m.Task, version: int) -> Packed:
    """The whole group of ``task``, sampled at ``version``."""
    return Packed.pack(make_group(task.task_id, task.n, version=version))


def _generate(st: ControlState, buf: ReplayBuffer) -> list[str]:
    """The server takes every task granted, the buffer gets each group, the server acks;
    the outcome of each group in the buffer."""
    outcomes = []
    while grant := st.grant("s", 64, 0.0).tasks:
        for t in grant:
            outcomes += buf.add_packed(_packed(t, st.version), 0.0)[:1]
            st.ack("s", [t.task_id], 0.0)
    st.ledger.dropped(buf.take_dropped())
    return outcomes


def _train(st: ControlState, buf: ReplayBuffer, steps: int, ack: bool = True) -> list[int]:
    """``steps`` learner steps (acknowledging each batch, as with ``save_freq <= 0``);
    the batch ids trained."""
    trained = []
    for _ in range(steps):
        _generate(st, buf)
        batch = buf.release(st.version, "learner")
        assert batch is not None, f"no batch: {st.ledger.accounting()}"
        trained.append(batch.batch_id)
        st.trained(batch.task_ids)
        if ack:
            buf.ack([batch.batch_id])
        st.versions.begin_sync(WeightPlan())
        st.versions.finish_sync(True, now=0.0)
    return trained


def _states_recounted(ledger: TaskLedger) -> Counter[str]:
    return Counter(e.state for e in ledger.entries.values())


# ----------------------------------------------------------------------- F1
def test_a_fresh_coordinator_beside_a_surviving_buffer_deals_new_ids_and_runs_on() -> None:
    """A learner restart without a checkpoint (``save_freq: -1``) gets a fresh coordinator
    whose cursor starts over. With the same ids, the surviving buffer dropped every group
    as a duplicate while the acks kept them charged: the run deadlocked. A fresh lineage
    makes every id new."""
    buf = ReplayBuffer(batch_size=B, capacity_groups=10_000, max_policy_lag=LAG)
    first = _state("aaaaaa")
    _train(first, buf, steps=6)
    first_ids = set(first.ledger.entries)

    second = _state("bbbbbb")  # what state_from_config builds after the crash
    # The surviving server registers again with the weights it holds.
    held = m.Register(server_id="s", engine_world_size=0, policy_version=first.version)
    second.register(held, 0.0)
    assert set(_generate(second, buf)) == {"completed"}
    _train(second, buf, steps=6)
    # The only ids of the first life the second knows are the groups the first left in
    # the buffer's pool: the second learner trained them (they were not lost).
    leftovers = first_ids & set(second.ledger.entries)
    assert leftovers == {t for t in first_ids if first.ledger.entries[t].state == "in_buffer"}
    assert all(second.ledger.entries[t].state == "done" for t in leftovers)
    assert buf.counts["drops/duplicate"] == 0
    a = second.ledger.accounting()
    assert a["accounting/train/unaccounted"] == 0 and a["accounting/train/trained"] >= 6 * B


def test_coordinators_from_a_config_draw_their_own_lineage(tmp_path) -> None:
    from asyncrl.control.setup import task_source_from_config
    from tests.standins.learner import loopback_config

    cfg, _ = loopback_config(tmp_path)
    rows = [make_row("arithmetic", "1+1=", "2", split="train", index=0)]
    one, two = (task_source_from_config(cfg, rows, []) for _ in range(2))
    assert one.lineage and two.lineage and one.lineage != two.lineage
    a, b = one.next_train(), two.next_train()
    assert a is not None and b is not None and a.task_id != b.task_id
    two.load_state_dict(one.state_dict())  # a restored coordinator takes its lineage back
    assert two.lineage == one.lineage


def test_a_group_dealt_again_after_the_buffer_forgot_it_is_reported_and_refunded() -> None:
    """The same defect by another road (a coordinator that does not know the first copy
    was trained): the buffer reports the duplicate once, the ledger returns its charge."""
    buf = ReplayBuffer(batch_size=B, capacity_groups=10_000, max_policy_lag=LAG)
    st = _state()
    _train(st, buf, steps=1)
    trained = next(t for t, e in st.ledger.entries.items() if e.state == "done")
    fresh = _state()  # same (empty) lineage: deals the trained id again
    task = fresh.grant("s", 1, 0.0).tasks[0]
    assert task.task_id == "train/0/0" == trained
    fresh.ack("s", [task.task_id], 0.0)
    committed = fresh.ledger.committed
    assert buf.add_packed(_packed(task, 0), 0.0) == ["duplicate"] * N
    assert buf.take_dropped() == [DroppedTask(task.task_id, "duplicate")]  # once per group
    fresh.ledger.dropped([DroppedTask(task.task_id, "duplicate")])
    assert fresh.ledger.committed == committed - 1
    assert fresh.ledger.accounting()["accounting/train/dropped/duplicate"] == 1


def test_a_duplicate_of_a_group_still_held_is_not_reported() -> None:
    buf = ReplayBuffer(batch_size=B, capacity_groups=100, max_policy_lag=LAG)
    for _ in range(2):
        buf.add_packed(Packed.pack(make_group("g", 2)), 0.0)
    assert buf.take_dropped() == [] and buf.counts["drops/duplicate"] == 2


# ----------------------------------------------------------------------- F1b
def test_an_acked_through_of_another_buffer_session_acknowledges_nothing() -> None:
    """Checkpoint at batch 9 of the old buffer; the new buffer's batches 0-3 trained by the
    learner life that then died: they must come again, not be acknowledged by '9'."""
    old = ReplayBuffer(batch_size=1, capacity_groups=100, max_policy_lag=5)
    new = ReplayBuffer(batch_size=1, capacity_groups=100, max_policy_lag=5)
    assert old.session != new.session
    for i in range(4):
        new.add_packed(Packed.pack(make_group(f"g{i}", 2)), 0.0)
        batch = new.release(0, "learner")
        assert batch is not None and batch.session == new.session
    assert new.restart(acked_through=9, consumer="learner", session=old.session) == (4, 0)
    again = [new.release(0, "learner") for _ in range(4)]
    assert [b.batch_id for b in again if b is not None] == [0, 1, 2, 3]
    assert new.counts["hello_other_session"] == 1


def test_a_consumer_without_a_checkpoint_replays_nothing_and_its_groups_face_the_lag_filter():
    """A learner restarted without a checkpoint trains from its initial weights: the batch
    its previous life was training is no replay for it. Its groups go back to the pool,
    where the lag filter judges them against today's version."""
    b = ReplayBuffer(batch_size=2, capacity_groups=100, max_policy_lag=1)
    for tid, version in (("old0", 0), ("old1", 0), ("new0", 3), ("new1", 3)):
        b.add_packed(Packed.pack(make_group(tid, 2, version=version)), 0.0)
    first = b.release(0, "learner")
    assert first is not None and first.task_ids == ["old0", "old1"]
    assert b.restart(None, "learner", resumed=False) == (0, 0)  # nothing redelivered
    batch = b.release(3, "learner")
    assert batch is not None and batch.task_ids == ["new0", "new1"] and not batch.redelivered
    assert [d.task_id for d in b.take_dropped()] == ["old0", "old1"]  # lag 3 > 1: reported
    assert b.counts["batches_returned"] == 1


def test_an_ack_that_comes_after_the_buffer_restarted_is_audited_and_dealt_again() -> None:
    """The group went to the old buffer, which died; its ack reached the coordinator only
    after the coordinator had met the new buffer and taken its inventory. The one-off
    reconciliation cannot see it; the periodic audit finds the new buffer never got it."""
    st = _state()
    old = ReplayBuffer(batch_size=B, capacity_groups=100, max_policy_lag=LAG)
    (task,) = st.grant("s", 1, 0.0).tasks
    old.add_packed(_packed(task, 0), 0.0)  # then the old buffer dies with it
    new = ReplayBuffer(batch_size=B, capacity_groups=100, max_policy_lag=LAG)
    st.recovery.buffer_contact(old.session, 1.0)
    assert st.recovery.buffer_contact(new.session, 5.0) is False  # settling first
    assert st.recovery.buffer_contact(new.session, 8.0)  # the inventory is due
    st.reconcile_buffer(*new.inventory()[:2])
    st.touch("s", 9.0)
    st.ack("s", [task.task_id], 9.0)  # the delayed ack
    assert st.audit_request(9.5) is None or task.task_id not in st.audit_request(9.5)[0]
    audit = None
    for now in (12.0, 20.0, 30.0):  # audits come every few seconds; this one is old enough
        st.touch("s", now)
        audit = st.audit_request(now)
        if audit is not None and task.task_id in audit[0]:
            break
    assert audit is not None and audit[0] == [task.task_id]
    assert st.audited(new.unknown(audit[0]), paused=False, before=audit[1]) == 1
    again = st.grant("s", 1, 30.0).tasks
    assert [(t.task_id, t.attempt) for t in again] == [(task.task_id, 1)]
    assert st.ledger.accounting()["accounting/train/unaccounted"] == 0


def test_an_audit_while_the_buffer_is_full_judges_nothing() -> None:
    st = _state()
    (task,) = st.grant("s", 1, 0.0).tasks
    st.ack("s", [task.task_id], 0.0)
    st.touch("s", 30.0)
    audit = st.audit_request(30.0)
    assert audit is not None and audit[0] == [task.task_id]
    assert st.audited([task.task_id], paused=True, before=audit[1]) == 0  # maybe queued
    assert st.ledger.entries[task.task_id].state == "in_buffer"


def test_a_push_moves_the_window_even_when_a_registration_raised_the_version_meanwhile():
    """A server registered with a higher version while a push was in flight: the pushed
    weights consumed what was trained all the same; without it the window stalled."""
    st = _state()
    buf = ReplayBuffer(batch_size=B, capacity_groups=10_000, max_policy_lag=LAG)
    _generate(st, buf)
    batch = buf.release(st.version, "learner")
    assert batch is not None
    st.trained(batch.task_ids)
    rnd = st.versions.begin_sync(WeightPlan())
    st.register(m.Register(server_id="late", engine_world_size=0, policy_version=5), 0.0)
    st.versions.finish_sync(True, now=0.0)
    assert rnd.version == 1 and st.version == 5
    assert st.ledger.budget.consumed == B  # the window moved by the batch trained
    assert _generate(st, buf)  # and more is dealt


def test_a_learner_without_a_checkpoint_numbers_its_versions_above_the_buffers() -> None:
    """Everything but the buffer restarted: the buffer measured lag against version 7, a
    fresh coordinator would deal at version 0 and every group would read as 7 behind."""
    rb = ReplayBuffer(batch_size=1, capacity_groups=64, max_policy_lag=1)
    rb.release(7, "learner")
    with BufferService(rb) as svc, BufferClient(svc.batches_endpoint, timeout_s=5) as client:
        welcome = client.hello(None, wait_s=5, resumed=False)
    assert welcome.policy_version == 7
    st = _state()
    st.versions.at_least(welcome.policy_version)
    (task,) = st.grant("s", 1, 0.0).tasks
    assert task.dealt_version == 7 and st.version == 7
    st.versions.at_least(3)  # never back
    assert st.version == 7


def test_a_late_copy_of_a_trained_group_is_left_out_of_the_learners_batch(tmp_path) -> None:
    """The buffer restarted after a group was trained; a late copy of it (dealt again to a
    server wrongly declared dead) reaches the new buffer, which cannot know it: the learner
    leaves it out rather than train it twice."""
    from asyncrl.control.setup import coordinator_from_config
    from asyncrl.wire import Batch, Group
    from learner.control_plane import RankZero
    from tests.standins.learner import loopback_config

    cfg, _ = loopback_config(tmp_path)
    rows = [make_row("arithmetic", "1+1=", "2", split="train", index=0)]
    coord = coordinator_from_config(cfg, train_rows=rows, val_rows=[], buffer=False)
    coord.trained(["late"])
    acked: list[tuple[str, int]] = []
    rank0 = object.__new__(RankZero)  # only what the filter uses
    rank0.cfg, rank0.coordinator = cfg, coord
    rank0.acknowledge = acked.extend  # type: ignore[method-assign]

    def batch(batch_id: int, *tids: str) -> Batch:
        groups = [Group.from_trajectories(t, make_group(t, 2)) for t in tids]
        return Batch(
            batch_id=batch_id,
            policy_version=0,
            groups=groups,
            lag_histogram={},
            metrics={},
            session="b2",
        )

    kept = rank0._untrained(batch(1, "late", "fresh"))
    assert kept is not None and kept.task_ids == ["fresh"] and kept.batch_id == 1
    # Nothing to train: acknowledged at once, with the session that numbered it.
    assert rank0._untrained(batch(2, "late")) is None and acked == [("b2", 2)]


# ----------------------------------------------------------------------- F2
def test_external_slots_dealt_after_a_checkpoint_are_never_dealt_again() -> None:
    """Slots the first incarnation dealt after its checkpoint are unknown to the second
    until their servers register again; a slot it deals before then must not reuse one."""
    first = _state("aaaaaa", session="s1")
    saved = first.state_dict()
    after = [first.grant_slot("s", 0.0, request_id=i).tasks[0].task_id for i in range(3)]
    first.ack("s", [after[0]], 0.0)

    second = _state("unused", session="s2")
    second.load_state_dict(saved)
    second.register(m.Register(server_id="t", engine_world_size=0), 10.0)
    second.recovery.holding(10.0)  # the saved registry's "s" is not back: deals resume
    early = second.grant_slot("t", 20.0, request_id=1).tasks[0].task_id
    second.register(m.Register(server_id="s", engine_world_size=0, task_ids=after[1:]), 21.0)
    second.reconcile_buffer([after[0]], [])
    late = [second.grant_slot("s", 22.0, request_id=10 + i).tasks[0].task_id for i in range(3)]
    assert not {early, *late} & set(after), (early, late, after)
    ledger = second.ledger
    assert _states_recounted(ledger) == +(ledger.tally["train"] + ledger.tally["val"])


def test_only_well_formed_external_ids_are_adopted() -> None:
    st = _state(session="s1")
    bogus = [f"ext/bogus-{i}" for i in range(100)] + ["ext/1/2/3", "ext/"]
    st.register(m.Register(server_id="s", engine_world_size=0, task_ids=bogus), 0.0)
    assert st.ledger.committed == 0 and st.ledger.counts["adopt_refused"] == len(bogus)


def test_external_slots_of_another_line_are_not_taken_back() -> None:
    """A learner restarted without a checkpoint starts a new line: a server that still holds
    a slot of the old one (its ack was lost with the old coordinator, and the group may be
    trained already by the dead learner) hands it back to nobody: charging it would hold
    budget for a group the buffer never gives again (fault simulation, seed 56302). A line
    restored from its checkpoint takes its own sessions' slots back."""
    old = _state("aaaaaa", session="s1")
    saved = old.state_dict()  # the slots below are dealt after this checkpoint
    held = [old.grant_slot("s", 0.0, request_id=i).tasks[0].task_id for i in range(2)]

    fresh = _state("bbbbbb", session="s2")
    fresh.register(m.Register(server_id="s", engine_world_size=0, task_ids=held), 1.0)
    assert fresh.ledger.committed == 0 and fresh.ledger.counts["adopt_foreign"] == 2
    assert not set(held) & set(fresh.ledger.entries)

    restored = _state("unused", session="s3")
    restored.load_state_dict(saved)
    restored.register(m.Register(server_id="s", engine_world_size=0, task_ids=held), 1.0)
    assert {restored.ledger.entries[t].state for t in held} == {"out"}
    assert restored.ledger.counts["adopt_foreign"] == 0
    again = _state("cccccc", session="s4")  # restored once more: both sessions are its own
    again.load_state_dict(restored.state_dict())
    assert again.ledger.earlier_sessions == {"s1", "s3"}


def test_external_slots_outstanding_at_the_checkpoint_wait_for_their_server() -> None:
    """A learner restart alone: a slot dealt before the checkpoint is still open at its
    live server, which names it when it registers again. It is taken back (charged, its
    group trained as an external one), not given up: before, the restored slot was given
    up, the budget admitted a group more, and the server's ack came back unknown. A slot
    whose server does not come back by the end of the resume hold is given up then."""
    old = _state("aaaaaa", session="s1")
    old.register(m.Register(server_id="t", engine_world_size=0), now=0.0)
    kept = old.grant_slot("s", 0.0, request_id=1).tasks[0].task_id
    lost = old.grant_slot("t", 0.0, request_id=2).tasks[0].task_id
    saved = old.state_dict()

    new = _state("unused", session="s2")
    new.load_state_dict(saved)
    assert new.grant("s", 64, 1.0).tasks == []  # the hold: "t" has not come back
    assert {new.ledger.entries[t].state for t in (kept, lost)} == {"queued"}
    new.register(m.Register(server_id="s", engine_world_size=0, task_ids=[kept]), 1.0)
    assert new.ledger.entries[kept].state == "out" and new.ledger.counts["adopted"] == 1
    assert new.ack("s", [kept], 2.0).acked == [kept]
    new.recovery.holding(3.5)  # "t" never comes back: the hold ends by time
    new.reap(3.5)
    assert new.ledger.entries[lost].state == "given_up"
    assert new.ledger.counts["external_given_up/unclaimed"] == 1
    dealt = [t.task_id for t in new.grant("s", 64, 3.5).tasks]
    assert dealt and not any(t.startswith("ext/") for t in dealt)  # slots are never dealt
    new.trained([kept])
    acc = new.ledger.accounting()
    assert acc["accounting/external/trained"] == 1 and acc["accounting/external/given_up"] == 1
    ledger = new.ledger
    assert _states_recounted(ledger) == +(ledger.tally["train"] + ledger.tally["val"])


# ----------------------------------------------------------------------- F4
def test_a_buffer_restart_ends_a_replay_under_way() -> None:
    """The learner restarted from the checkpoint of version 5 replays up to version 9 (the
    servers hold 9), but the buffer dies before it gives those batches again: the learner
    trains fresh ones, whose weights no server holds. The replay ends where the learner
    is; versions 6 on are pushed (adopting them left servers on the lost branch's weights
    under the learner's version labels), and the servers holding 9 get a catch-up."""
    st = _state()
    st.ledger.budget.advance(5)
    st.recovery.restored(["s0"])
    st.register(m.Register(server_id="s0", engine_world_size=1, policy_version=9), 0.0)
    st.versions.set_replay(9)
    assert st.versions.adopt(6)  # one replayed batch came before the buffer died
    # The coordinator's drain of the buffer's reports sees the new session.
    drained = SimpleNamespace(dropped=[], validated=[], session="b1")
    answer = SimpleNamespace(held=[], dropped=[], validated=[], unknown=[], paused=False)
    client = SimpleNamespace(drain=lambda: drained, inventory=lambda *ids: answer)
    control_loop._poll_once(client, st, threading.RLock())  # the buffer, first seen
    assert st.recovery.replay_through == 9
    drained.session = "b2"  # answered by a restarted buffer
    control_loop._poll_once(client, st, threading.RLock())
    assert st.recovery.replay_through == 6 and not st.versions.adopt(7)
    assert not st.servers["s0"].trusted
    assert st.versions.begin_sync(WeightPlan()).version > 9  # past the lost branch's labels
    st.versions.end_replay()  # no replay under way: nothing changes
    assert st.recovery.replay_through == 6


def test_a_buffer_restarted_before_the_first_drain_ends_the_replay_too() -> None:
    """Found by a review: the buffer that welcomed the resumed learner (its redelivery the
    replay counts on) died before the coordinator's first drain, so the first session the
    coordinator saw was the new buffer's: no change of session, the replay stood, and
    pushes were skipped for versions no batch reproduced. The welcome's session tells."""
    st = _state()
    st.ledger.budget.advance(5)
    st.recovery.restored(["s0"])
    st.register(m.Register(server_id="s0", engine_world_size=1, policy_version=9), 0.0)
    st.versions.set_replay(9)
    st.recovery.replay_session = "b1"  # as Coordinator.set_replay(9, welcome.session)
    drained = SimpleNamespace(dropped=[], validated=[], session="b2")  # b1 is gone
    answer = SimpleNamespace(held=[], dropped=[], validated=[], unknown=[], paused=False)
    client = SimpleNamespace(drain=lambda: drained, inventory=lambda *ids: answer)
    control_loop._poll_once(client, st, threading.RLock())
    assert st.recovery.replay_through == 5 and not st.versions.adopt(6)
    assert not st.servers["s0"].trusted
    # The welcoming buffer answering the first drain: the replay stands.
    st2 = _state()
    st2.ledger.budget.advance(5)
    st2.versions.set_replay(9)
    st2.recovery.replay_session = "b1"
    drained.session = "b1"
    control_loop._poll_once(client, st2, threading.RLock())
    assert st2.recovery.replay_through == 9


def test_a_replayed_version_no_server_holds_is_pushed_not_adopted() -> None:
    """The replay counted 4 redelivered batches, but the previous life died training the
    4th: the servers hold 8, not 9. Adopting 9 would leave every server a version behind
    (each then waits for its own catch-up)."""
    st = _state()
    st.ledger.budget.advance(5)  # restored from the checkpoint of version 5
    st.recovery.restored(["s0", "s1"])
    for sid in ("s0", "s1"):
        st.register(m.Register(server_id=sid, engine_world_size=1, policy_version=8), 0.0)
    st.versions.set_replay(9)
    assert [st.versions.adopt(v) for v in (6, 7, 8)] == [True] * 3
    assert not st.versions.adopt(9)
    assert st.versions.begin_sync(WeightPlan()).version == 9
    assert st.counts["replay_not_held"] == 1


def test_a_retry_of_an_older_slot_request_gets_its_own_slot() -> None:
    """Found by a review: the coordinator kept one slot grant per server. The endpoint's
    groups ask at once, and its reaper asks again under an id whose reply was lost; when
    another id was granted in between, the retry got a fresh slot (given back), and the
    lost one stayed charged for as long as the server lived (external slots are not
    reclaimed by the task timeout)."""
    st = _state(session="s1")
    lost = st.grant_slot("s", 0.0, request_id=5).tasks[0].task_id  # its reply was lost
    other = st.grant_slot("s", 0.0, request_id=6).tasks[0].task_id
    assert st.grant_slot("s", 1.0, request_id=5).tasks[0].task_id == lost != other
    assert st.ledger.counts["external_dealt"] == 2, st.ledger.counts
