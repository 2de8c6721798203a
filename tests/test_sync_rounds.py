"""The bookkeeping of sync rounds (:class:`asyncrl.control.syncs.SyncBook`, driven directly
or through the control state) and the learner's side of a round that its own error ends
(:class:`asyncrl.sync.sender.WeightPusher` with a stand-in group). No sockets but one
store on 127.0.0.1, where the learner tells a failed round's members to stop waiting."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from asyncrl.control import messages as m
from asyncrl.control.syncs import SyncBook, SyncResult, SyncRound
from asyncrl.sync import sender
from asyncrl.sync.plan import TensorSpec, WeightPlan, plan_buckets
from tests.test_admission_registry import _push, _state

PLAN = plan_buckets([TensorSpec("w", (2, 3), "float32")], bucket_bytes=1 << 20)


def _loaded(book: SyncBook, rnd: SyncRound) -> SyncResult:
    """Every member of ``rnd`` reports it loaded; the round closes."""
    for member in rnd.members:
        book.report(m.SyncDone(server_id=member, sync_id=rnd.sync_id, version=rnd.version, ok=True))
    return book.finish(True)


def test_a_member_lost_from_a_formed_round_is_not_sent_that_round_again():
    """A restarted server registers under its id while a round it was a member of is
    still open (another member has not reported), and asks for every sync (it has seen
    none). Its old start sent it into a group formed without it: it missed the next
    round's meeting, and that round failed for every member."""
    st = _state()
    for sid in ("a", "b"):
        st.register(m.Register(server_id=sid, engine_world_size=1), now=0.0)
    rnd = st.versions.begin_sync(PLAN)
    assert rnd.watch.form()  # the group formed: a loss now fails the round, no restart
    reg = st.register(m.Register(server_id="a", engine_world_size=1), now=0.1)  # restarted
    assert st.syncs.start_for("a") is None
    hb = m.Heartbeat(
        server_id="a", session=reg.session, policy_version=0, seen_version=0, seen_sync=0
    )
    news = st.news(hb)
    assert news is None or news.sync is None
    assert st.idle_announcement("a").sync is None
    start_b = st.syncs.start_for("b")
    assert start_b is not None and start_b.sync_id == rnd.sync_id  # the others keep theirs
    assert st.syncs.waiting_for() == ["b"]
    st.sync_done(m.SyncDone(server_id="b", sync_id=rnd.sync_id, version=1, ok=True), 0.2)
    result = st.versions.finish_sync(True, now=0.3)
    assert (result.ok, result.failed) == (["b"], {"a": "re-registered (restarted)"})
    # It catches up instead, then joins a main group formed anew.
    assert st.versions.pending_catchups(0.4) == ["a"]
    catchup = st.versions.begin_catchup("a", PLAN)
    assert st.syncs.start_for("a") is not None
    st.sync_done(m.SyncDone(server_id="a", sync_id=catchup.sync_id, version=1, ok=True), 0.5)
    st.versions.finish_sync(True, now=0.5)
    again = st.versions.begin_sync(PLAN)
    assert again.new_group and again.ranks == {"b": 1, "a": 2}
    news = st.news(msgspec.structs.replace(hb, seen_sync=catchup.sync_id))
    assert news is not None and news.sync is not None and news.sync.sync_id == again.sync_id


def test_a_catch_up_of_a_main_member_makes_the_next_main_round_form_a_new_group():
    """A member of the main group gets a catch-up (a registration raised the version past
    its weights): its worker leaves the main group to join the catch-up's. Kept as formed,
    the main group was reused by the next main round, which then failed for everyone."""
    book = SyncBook()
    members = [("a", 1), ("b", 1)]
    first = book.begin(members, 1, PLAN)
    assert _loaded(book, first).ok == ["a", "b"]
    kept = book.begin(members, 2, PLAN)
    assert not kept.new_group and kept.generation == first.generation  # nothing changed
    _loaded(book, kept)
    assert _loaded(book, book.begin([("a", 1)], 7, PLAN, catchup=True)).ok == ["a"]
    after = book.begin(members, 8, PLAN)
    assert after.new_group and after.generation == f"main/{after.sync_id}" != first.generation
    _loaded(book, after)
    assert not book.begin(members, 9, PLAN).new_group  # the new group is kept in turn


def test_a_catch_up_of_a_server_outside_the_main_group_leaves_that_group_as_it_is():
    book = SyncBook()
    first = book.begin([("a", 1)], 1, PLAN)
    _loaded(book, first)
    _loaded(book, book.begin([("late", 1)], 1, PLAN, catchup=True))
    assert book.begin([("a", 1)], 2, PLAN).generation == first.generation


def test_a_member_lost_mid_send_gives_the_send_up_and_one_that_loaded_keeps_its_version():
    """After the group formed, losing a member that is still receiving tells the learner's
    send to give up (a member that stopped reading holds gloo's broadcast until its
    timeout); losing one that already reported does not. A member that reported ok before
    the send failed loaded the version: it was counted failed with the send, and the group
    the failed send broke must still be formed anew."""
    book = SyncBook()
    members = [("a", 1), ("b", 1), ("c", 1)]
    _loaded(book, book.begin(members, 1, PLAN))
    rnd = book.begin(members, 2, PLAN)
    assert not rnd.new_group and rnd.watch.form()
    book.report(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=2, ok=True))
    assert book.lose("a", "left") is None and rnd.watch.lost_in_send() == ""
    assert book.lose("b", "silent for more than 1s") is None  # formed: no successor
    assert rnd.watch.lost_in_send() == "b was lost (silent for more than 1s)"
    book.report(m.SyncDone(server_id="c", sync_id=rnd.sync_id, version=2, ok=True))
    result = book.finish(False, "gave up")
    assert result.ok == ["c"]
    assert result.failed == {"a": "left", "b": "silent for more than 1s"}
    assert book.main_members == (("c", 1),) and book.begin([("c", 1)], 3, PLAN).new_group
    book.report(m.SyncDone(server_id="c", sync_id=book.counter, version=3, ok=True))
    sent = book.finish(False, "send broke")  # every member loaded it: the group is still broken
    assert (sent.ok, sent.failed) == (["c"], {})
    same = book.begin([("c", 1)], 4, PLAN)
    assert same.new_group  # the same member: its group is formed anew all the same
    _loaded(book, same)
    quiet = book.begin([("c", 1), ("d", 1)], 5, PLAN)  # c reports; d never does
    book.report(m.SyncDone(server_id="c", sync_id=quiet.sync_id, version=5, ok=True))
    assert book.finish(False, "send broke").failed == {"d": "the learner's send failed: send broke"}


def test_a_member_that_failed_before_the_group_formed_and_is_lost_begins_the_round_again():
    """A server whose engine died reports its failure at once, without coming to the
    meeting, then exits: losing it must still give the meeting up and begin the round again
    without it (a check for members that had reported skipped that, and the learner waited
    out sync.timeout_s in the meeting)."""
    book = SyncBook()
    rnd = book.begin([("a", 1), ("b", 1)], 1, PLAN)
    book.report(m.SyncDone(server_id="b", sync_id=rnd.sync_id, version=1, ok=False, error="x"))
    again = book.lose("b", "left")
    assert again is not None and again.members == ["a"] and again.version == 1
    assert rnd.watch.ended() == "b was lost (left)" and rnd.watch.lost_in_send() == ""


def test_a_member_that_may_still_be_receiving_is_left_out_until_its_report():
    """A round whose send failed closed before b reported: b may still wait in that round's
    receive (until its own sync.timeout_s), and a meeting with it would wait as long. The
    next push and any catch-up go on without it until it reports or that time passed."""
    st = _state()
    for sid in ("a", "b"):
        st.register(m.Register(server_id=sid, engine_world_size=1), now=0.0)
    rnd = st.versions.begin_sync(PLAN, now=1.0)
    st.sync_done(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=1, ok=True), 1.1)
    st.versions.finish_sync(False, "given up", now=2.0)
    timeout_s = st.syncs.timeout_s
    second = st.versions.begin_sync(PLAN, now=3.0)
    assert second.members == ["a"]
    st.sync_done(m.SyncDone(server_id="a", sync_id=second.sync_id, version=2, ok=True), 3.05)
    st.versions.finish_sync(True, now=3.1)
    assert st.versions.pending_catchups(3.2) == []
    assert st.versions.pending_catchups(2.0 + timeout_s) == ["b"]  # its timeout passed
    late = m.SyncDone(server_id="b", sync_id=rnd.sync_id, version=1, ok=False, error="gone")
    st.sync_done(late, 3.3)  # its report, late: out of its receive
    assert st.versions.pending_catchups(3.4) == ["b"]


class _Group:
    """A sync group the push never reaches the wire on: its abort is recorded."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Coordinator:
    """The coordinator's side of the rounds: a real :class:`SyncBook`, one member "a"."""

    sync_secret = ""

    def __init__(self) -> None:
        self.book = SyncBook()
        self.errors: list[str] = []

    def begin_sync(self, plan: WeightPlan) -> SyncRound:
        return self.book.begin([("a", 1)], self.book.counter + 1, plan)

    def weights_sent(self, rnd: SyncRound) -> None:
        pass

    def finish_sync(self, rnd: SyncRound, sent_ok: bool = True, error: str = "") -> SyncResult:
        self.errors.append(error)
        return self.book.finish(sent_ok, error)


def _pusher(coordinator: Any, store: Any) -> sender.WeightPusher:
    """A pusher over gloo that gives a sync up after 1 s."""
    return sender.WeightPusher(
        coordinator, store, backend="gloo", timeout_s=1.0, bucket_bytes=1 << 20
    )


def test_a_push_the_learners_own_error_ends_is_closed_and_the_error_raised(monkeypatch, caplog):
    """Tensors off the plan (a shape mismatch in the packing, a missing name) are neither
    a member's failure nor a collective's: the error escaped the pusher with the round
    open, and every later round raised "still in progress" until the learner restarted.
    The round is closed as failed and its group let go; the error is raised (the same
    tensors fail every push: the learner stops, and is restarted, as after any push of
    its own that fails)."""
    import torch

    groups: list[_Group] = []

    def form(*args: Any, **kwargs: Any) -> _Group:
        groups.append(_Group())
        return groups[-1]

    monkeypatch.setattr(sender, "form_group", form)
    coordinator = _Coordinator()
    pusher = _pusher(coordinator, None)
    pusher.plan_for({"w": torch.zeros(2, 3)})
    mismatch = r"w: shape \(3, 2\) != planned \(2, 3\)"
    with (
        caplog.at_level(logging.ERROR, logger="asyncrl.sync.sender"),
        pytest.raises(ValueError, match=mismatch),
    ):
        pusher.push({"w": torch.zeros(3, 2)})
    assert coordinator.book.active is None  # closed: the next round can begin
    assert coordinator.errors == ["ValueError: w: shape (3, 2) != planned (2, 3)"]
    assert groups[0].aborted and pusher._group is None
    (line,) = [r.getMessage() for r in caplog.records if r.name == "asyncrl.sync.sender"]
    assert "sync 1 failed on the learner's side" in line and "ValueError" in line
    with pytest.raises(KeyError):
        pusher.push({})  # a name the plan has, missing
    again = coordinator.begin_sync(PLAN)
    assert again.sync_id == 3 and again.new_group  # the failed group is not reused


def test_a_server_restarted_during_its_catch_up_is_not_backed_off_for_it():
    """Found by a review: a server that died in its catch-up and registered again before
    the round closed had the failed catch-up's back-off put on its new record: its first
    catch-up waited ``catchup_backoff_s`` and its first real failure counted as a second."""
    st = _state()
    _push(st)  # version 1 before c came: c needs a catch-up
    st.register(m.Register(server_id="c", engine_world_size=1), now=1.0)
    assert st.versions.pending_catchups(1.1) == ["c"]
    catchup = st.versions.begin_catchup("c", PLAN)
    st.register(m.Register(server_id="c", engine_world_size=1), now=1.5)  # restarted
    result = st.versions.finish_sync(False, "c was lost", now=1.6)
    assert (result.sync_id, list(result.failed)) == (catchup.sync_id, ["c"])
    assert st.servers["c"].catchup_failures == 0
    assert st.versions.pending_catchups(1.7) == ["c"]
    assert st.versions.counts["catchup_backoffs"] == 0
    # A catch-up of its own that fails backs it off as before.
    st.versions.begin_catchup("c", PLAN)
    st.versions.finish_sync(False, "no report", now=2.0)
    assert st.servers["c"].catchup_failures == 1 and st.versions.pending_catchups(2.1) == []


def test_a_send_that_fails_tells_the_members_to_stop_waiting(monkeypatch):
    """Found in a chaos run: a server killed in the middle of the first broadcast broke the
    learner's send within 0.2 s, and the other member, waiting in the same group, was not
    told (only a send given up on a lost member was): it waited on past sync.timeout_s
    while the admission window stayed shut behind the failed push (the learner waited 33 s
    for a batch). Every failed send now sets the key the members' waits ask, with why."""
    import torch

    from asyncrl.sync.groups import WeightSyncError, given_up, open_store, store_prefix
    from tests.helpers import free_port

    def broken_send(*args: Any, **kwargs: Any) -> None:
        raise WeightSyncError("weight broadcast of bucket 0 failed after 0.2s (reset by peer)")

    monkeypatch.setattr(sender, "form_group", lambda *args, **kwargs: _Group())
    monkeypatch.setattr(sender, "send_weights", broken_send)
    store = open_store("127.0.0.1", free_port(), is_host=True, timeout_s=5.0)
    coordinator = _Coordinator()
    pusher = _pusher(coordinator, store)
    pusher.plan_for({"w": torch.zeros(2, 3)})
    rnd = coordinator.begin_sync(PLAN)
    asked = given_up(store, store_prefix(coordinator.sync_secret, rnd.generation))
    assert asked() == ""  # nothing said before the send
    result = pusher.complete(rnd, {"w": torch.zeros(2, 3)})
    assert not result.ok and "reset by peer" in coordinator.errors[0]
    assert "the learner gave the sync up" in asked() and "reset by peer" in asked()
