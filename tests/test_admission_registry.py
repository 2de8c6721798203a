"""The coordinator's registry rules (:class:`asyncrl.control.state.ControlState`) with small
hand-computed inputs: late joiners and their catch-ups, the start of dealing, versions,
dead servers, the validation schedule, heartbeat news, retried requests and a restored
state after a learner restart. No sockets."""

from __future__ import annotations

import msgspec

from asyncrl.control import messages as m
from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource
from asyncrl.sync.plan import TensorSpec, plan_buckets
from asyncrl.tasks import make_row

PLAN = plan_buckets([TensorSpec("w", (2, 3), "float32")], bucket_bytes=1 << 20)


def _rows(n: int, split: str = "train") -> list[dict]:
    return [make_row("arithmetic", f"{i}+1=", str(i + 1), split=split, index=i) for i in range(n)]


def _state(**kw) -> ControlState:
    source = TaskSource(_rows(50), _rows(2, "test"), seed=1, n=2, lineage="")
    return ControlState(
        TaskLedger(source, Budget(1, 4)),
        SyncBook(),
        heartbeat_s=0.5,
        dead_after_s=2.0,
        store_host="127.0.0.1",
        store_port=1,
        **kw,
    )


def _push(st: ControlState) -> None:
    """The learner pushes the next version (a member that does not report it fails it)."""
    st.versions.begin_sync(PLAN)
    st.versions.finish_sync(True, now=0.0)


def test_late_joiner_catches_up_before_its_first_task():
    st = _state()
    st.register(m.Register(server_id="a", engine_world_size=1), now=0.0)
    rnd = st.versions.begin_sync(PLAN)
    st.sync_done(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=1, ok=True), 0.1)
    assert st.versions.finish_sync(True, now=0.1).ok == ["a"] and st.version == 1
    reg = st.register(m.Register(server_id="late", engine_world_size=1), now=0.2)
    assert reg.catchup and st.grant("late", 4, 0.3).reason == "catchup"
    assert st.versions.pending_catchups(0.3) == ["late"]
    rnd = st.versions.begin_catchup("late", PLAN)
    assert (rnd.generation, rnd.world_size, rnd.version) == ("catchup/late/2", 2, 1)
    assert st.versions.pending_catchups(0.3) == []  # busy in its catch-up
    st.sync_done(m.SyncDone(server_id="late", sync_id=rnd.sync_id, version=1, ok=True), 0.4)
    st.versions.finish_sync(True, now=0.4)
    assert st.version == 1 and len(st.grant("late", 4, 0.5).tasks) == 4
    # Not a member of the main group yet: the next push re-forms it with both.
    assert st.versions.begin_sync(PLAN).ranks == {"a": 1, "late": 2}


def test_failed_catchups_back_off_exponentially_and_success_clears_them():
    """Each catch-up blocks the learner until it ends: a server that keeps failing them is
    retried after 5 s, then 10 s, ... up to the cap, not at every learner step."""
    st = _state(catchup_backoff_s=5.0, catchup_backoff_max_s=12.0)
    _push(st)  # version 1, before "a" joins holding version 0: it needs a catch-up
    st.register(m.Register(server_id="a", engine_world_size=1), now=0.0)
    now, delays = 0.0, []
    for _ in range(3):
        assert st.versions.pending_catchups(now) == ["a"]
        rnd = st.versions.begin_catchup("a", PLAN)
        st.sync_done(
            m.SyncDone(
                server_id="a", sync_id=rnd.sync_id, version=1, ok=False, error="engine gone"
            ),
            now,
        )
        assert st.versions.finish_sync(True, now=now).failed.keys() == {"a"}
        retry = next(
            t for t in (now + k * 0.5 for k in range(1, 100)) if st.versions.pending_catchups(t)
        )
        delays.append(retry - now)
        now = retry
    assert delays == [5.0, 10.0, 12.0] and st.counts["catchup_backoffs"] == 3
    assert st.grant("a", 4, now).reason == "catchup"  # still no task while stale
    rnd = st.versions.begin_catchup("a", PLAN)
    st.sync_done(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=1, ok=True), now)
    st.versions.finish_sync(True, now=now)
    assert st.servers["a"].catchup_failures == 0 and len(st.grant("a", 4, now).tasks) == 4


def test_the_window_opens_at_the_send_and_its_deals_carry_the_version_being_loaded():
    """The learner's broadcast ended: the admission window moves then, not when the
    members' reports close the round, and a task dealt in between carries the version its
    server is loading (the server waits for it before generating)."""
    st = _state()  # Budget(1, 4): two versions' worth, 8 groups, before anything is trained
    st.register(m.Register(server_id="a", engine_world_size=1), now=0.0)
    first = st.grant("a", 8, 0.1).tasks
    assert len(first) == 8 and {t.dealt_version for t in first} == {0}
    assert st.grant("a", 4, 0.1).reason == "budget"
    st.ack("a", [t.task_id for t in first], 0.2)
    st.trained([t.task_id for t in first[:4]])  # one version's worth, then the push
    rnd = st.versions.begin_sync(PLAN)
    assert st.grant("a", 4, 0.3).reason == "budget"  # announced, not yet sent
    st.versions.weights_sent(rnd)
    sent = st.grant("a", 8, 0.4).tasks
    assert len(sent) == 4 and {t.dealt_version for t in sent} == {1} and st.version == 0
    st.sync_done(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=1, ok=True), 0.5)
    st.versions.finish_sync(True, now=0.5)
    st.versions.weights_sent(rnd)  # late, for a closed round: moves nothing
    assert st.version == 1 and st.grant("a", 4, 0.6).reason == "budget"  # no second opening
    catchup_state = _state()  # a catch-up's send moves nothing: it pushes no new version
    catchup_state.register(m.Register(server_id="b", engine_world_size=1), now=0.0)
    catchup = catchup_state.versions.begin_catchup("b", PLAN)
    catchup_state.versions.weights_sent(catchup)
    assert catchup_state.ledger.budget.deal_version == 0


def test_the_window_moves_by_what_the_pushed_weights_trained_on_not_what_came_after():
    """With ``sync.overlap_push`` the next step trains, and reports its groups, while the
    push's reports are outstanding: those groups were trained on the weights before the
    push, so the window must not count them. It did, and opened a batch wider than
    ``max_policy_lag`` allows (its groups were then trained at lag 2 and dropped). The
    same at the send (``staleness.deal_at_send``) and for a round begun again without a
    lost member."""
    for deal_at_send in (False, True):
        st = _state()  # Budget(1, 4): the window is consumed + 8
        for sid in ("a", "b"):
            st.register(m.Register(server_id=sid, engine_world_size=1), now=0.0)
        first = st.grant("a", 12, 0.1).tasks
        assert len(first) == 8
        st.ack("a", [t.task_id for t in first], 0.2)
        st.trained([t.task_id for t in first[:4]])  # step 1, then its push begins
        rnd = st.versions.begin_sync(PLAN)
        st.leave("b")  # the round is begun again without b: it keeps the count
        rnd = rnd.watch.successor
        assert rnd is not None and rnd.consumed == 4
        st.trained([t.task_id for t in first[4:]])  # step 2 trains during the push
        if deal_at_send:
            st.versions.weights_sent(rnd)
        st.sync_done(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=1, ok=True), 0.3)
        st.versions.finish_sync(True, now=0.3)
        assert (st.version, st.ledger.budget.consumed, st.ledger.budget.limit) == (1, 4, 12)
        assert len(st.grant("a", 12, 0.4).tasks) == 4  # not 8: those would train at lag 2


def test_dealing_starts_once_enough_servers_registered():
    st = _state(min_servers_to_start=2)
    st.register(m.Register(server_id="a", engine_world_size=1), now=0.0)
    assert st.grant("a", 4, 0.1).reason == "starting" and not st.grant("a", 4, 0.1).tasks
    st.register(m.Register(server_id="b", engine_world_size=1), now=0.2)
    assert len(st.grant("a", 4, 0.3).tasks) == 4
    st.leave("b")  # once started, losing a server does not stop the run
    assert len(st.grant("a", 4, 0.4).tasks) == 4


def test_versions_never_go_back_and_a_restart_pushes_above_what_servers_hold():
    st = _state()
    st.register(m.Register(server_id="a", policy_version=5), now=0.0)
    assert st.version == 5 and st.versions.begin_sync(PLAN).version == 6


def test_silent_servers_are_declared_dead():
    st = _state()
    st.register(m.Register(server_id="a", engine_world_size=0), now=0.0)
    st.register(m.Register(server_id="b", engine_world_size=0), now=0.0)
    held = [t.task_id for t in st.grant("a", 3, 0.5).tasks]
    st.touch("b", 2.0)
    assert st.reap(2.4) == []  # a asked for tasks at 0.5: alive for 2 s more
    assert st.reap(2.6) == ["a"] and list(st.servers) == ["b"]
    assert [t.task_id for t in st.grant("b", 3, 2.5).tasks] == held


def test_validation_schedule():
    st = _state(test_freq=2, val_before_train=True)
    st.start_run()
    assert st.ledger.source.val_rounds == 1
    assert [st.on_step(s) for s in (1, 2, 3, 4, 4)] == [False, True, False, True, False]
    assert st.ledger.source.val_rounds == 3


def test_the_end_validates_weights_a_round_at_its_step_did_not_measure():
    """Found by a review: with ``staleness.sync_every=2`` and ``test_freq=5``, step 5's
    round started on step 4's weights; the data ran out after step 5, the end pushed step
    5's weights and its round was refused (one already at step 5), so the weights the run
    ended with were never validated. A round at one step on the same weights still is."""
    st = _state(test_freq=5)
    assert st.on_step(5, weights_step=4)
    assert st.start_validation(5)  # the end, on step 5's weights
    assert st.validation.progress().started_at == {0: 4, 1: 5}
    assert not st.start_validation(5)  # those weights have their round
    assert st.on_step(10) and not st.start_validation(10)  # a test_freq round at the end


def test_a_run_with_no_batch_validates_its_weights_once():
    """Found by a review: ``val_before_train`` started a round at step 0, and the end of a
    run with no batch to train started another on the same weights."""
    st = _state(test_freq=5, val_before_train=True)
    st.start_run()
    assert st.ledger.source.val_rounds == 1
    assert not st.start_validation(0)
    assert st.ledger.source.val_rounds == 1


def test_heartbeat_news_is_level_triggered():
    st = _state()
    reg = st.register(m.Register(server_id="a", engine_world_size=0), now=0.0)
    hb = m.Heartbeat(
        server_id="a", session=reg.session, policy_version=0, seen_version=0, seen_sync=0
    )
    assert st.news(hb) is None  # nothing new: held
    _push(st)
    assert st.news(hb).policy_version == 1  # repeated until a heartbeat has seen it
    assert st.news(msgspec.structs.replace(hb, seen_version=1)) is None
    assert st.news(msgspec.structs.replace(hb, session="old")).registered is False
    st.begin_shutdown("done")
    assert st.news(hb).shutdown and st.all_told()


def test_a_retried_request_gets_its_lost_grant_again():
    st = _state()
    st.register(m.Register(server_id="a", engine_world_size=0), now=0.0)
    first = st.grant("a", 2, 0.1, request_id=1)
    assert st.grant("a", 2, 0.2, request_id=1) == first  # the reply was lost: same tasks
    second = st.grant("a", 2, 0.3, request_id=2)
    assert {t.task_id for t in first.tasks}.isdisjoint(t.task_id for t in second.tasks)
    assert st.ledger.committed == 4


def test_a_restored_state_adopts_what_servers_and_buffer_hold_and_redeals_the_rest():
    """A learner restart: the restored coordinator holds dealing until the servers it knew
    registered again and the buffer's inventory came; what they hold is adopted (never dealt
    twice), what nobody holds is dealt again under its id, and the window is not widened."""
    st = _state()
    st.register(m.Register(server_id="a", engine_world_size=0), now=0.0)
    tasks = st.grant("a", 3, 0.1).tasks
    st.ack("a", [tasks[0].task_id], 0.2)
    saved = st.state_dict()
    later = st.grant("a", 2, 0.3).tasks  # dealt after the checkpoint
    restarted = _state()
    restarted.load_state_dict(saved)
    restarted.versions.set_replay(0)  # the learner replays nothing: a higher version is a new one
    assert restarted.ledger.committed == 1  # what was outstanding is queued, not charged
    # The run's event totals go on from the checkpoint's (a review found them back at 0,
    # the final accounting line's "prompts out of lag retries" among them).
    assert (restarted.ledger.counts["train_dealt"], restarted.ledger.counts["train_acked"]) == (
        3,
        1,
    )
    assert restarted.counts["registrations"] == 1
    restarted.register(m.Register(server_id="b", engine_world_size=0), now=1.0)
    assert restarted.grant("b", 4, 1.1).reason == "starting"  # "a" and the buffer first
    held_by_a = [tasks[1].task_id, later[1].task_id]
    restarted.register(
        m.Register(server_id="a", engine_world_size=0, policy_version=5, task_ids=held_by_a),
        now=1.2,
    )
    assert restarted.version == 5 and restarted.ledger.budget.limit == saved_limit(saved)
    restarted.reconcile_buffer([tasks[0].task_id, later[0].task_id], [])  # the inventory
    again = restarted.grant("b", 4, 1.3).tasks
    # tasks[2] was owed and nobody holds it: same id, next attempt; then new prompts,
    # skipping the ids dealt after the checkpoint that the buffer and "a" hold.
    assert [(t.task_id, t.attempt) for t in again] == [
        (tasks[2].task_id, 1),
        ("train/0/5", 0),
        ("train/0/6", 0),
        ("train/0/7", 0),
    ]
    assert set(restarted.ledger.owned["a"]) == set(held_by_a)
    assert restarted.ledger.accounting()["accounting/train/dealt"] == 8
    assert restarted.ledger.accounting()["accounting/train/unaccounted"] == 0


def test_a_resume_does_not_wait_for_a_server_reaped_before_it_registered_again():
    """The restored coordinator waits for the servers it knew; the launcher reaps one of
    them (its ``Leave``) before it registers again. Dealing starts without it once the
    others and the inventory are back, not after ``control.dead_after_s``."""
    st = _state()
    for sid in ("a", "b"):
        st.register(m.Register(server_id=sid, engine_world_size=0), now=0.0)
    restarted = _state()
    restarted.load_state_dict(st.state_dict())
    restarted.reconcile_buffer([], [])  # the inventory came
    restarted.register(m.Register(server_id="a", engine_world_size=0), now=1.0)
    assert restarted.grant("a", 2, 1.1).reason == "starting"  # "b" first
    assert restarted.leave("b", pid=123)  # reaped: no record here, nothing to match
    grant = restarted.grant("a", 2, 1.2)  # dead_after_s is 2 s: still within the hold
    assert grant.reason == "" and len(grant.tasks) == 2


def test_a_late_report_of_the_dead_learners_sync_is_not_taken_for_the_new_round_of_its_id():
    """Sync ids go on from the checkpoint's, so the restarted learner's first push reuses
    the id of a round its dead predecessor started after that checkpoint. A member's report
    of the old round, sent late (its retries outlive the learner), names the old session:
    it is not counted as that member loading the new round's version."""
    st = _state()
    st.register(m.Register(server_id="a", engine_world_size=1), now=0.0)
    saved = st.state_dict()
    old = st.versions.begin_sync(PLAN)  # after the checkpoint; then the learner dies
    (old_start,) = [st.versions.syncs.start_for("a")]
    assert old_start is not None and old_start.session == st.session

    restarted = _state()
    restarted.load_state_dict(saved)
    restarted.versions.set_replay(0)
    restarted.register(m.Register(server_id="a", engine_world_size=1), now=1.0)
    new = restarted.versions.begin_sync(PLAN)
    assert new.sync_id == old.sync_id  # the same id, another round
    late = m.SyncDone(
        server_id="a", sync_id=old.sync_id, version=1, ok=False, session=old_start.session
    )
    restarted.sync_done(late, 1.1)
    assert restarted.syncs.waiting_for() == ["a"]  # still waiting for a's real report
    assert restarted.versions.counts["sync_reports_stale"] == 1
    start = restarted.versions.syncs.start_for("a")
    assert start is not None and start.session == restarted.session != old_start.session
    ok = m.SyncDone(server_id="a", sync_id=new.sync_id, version=1, ok=True, session=start.session)
    restarted.sync_done(ok, 1.2)
    assert restarted.versions.finish_sync(True, now=1.3).ok == ["a"]


def test_partly_loaded_weights_are_caught_up_whatever_version_they_report():
    """A server whose sync broke off mid-load registers again (a learner restart) with the
    version it last loaded whole, the coordinator's: it was trusted, dealt tasks its held
    engine never ran, and never caught up. Not even the replay's rules trust it; a sync
    that loads its weights whole does."""
    st = _state()
    st.versions.set_replay(0)  # restored at version 0: a server holding it is trusted
    partial = m.Register(server_id="a", engine_world_size=1, weights_partial=True)
    reg = st.register(partial, now=0.0)
    assert reg.catchup and st.grant("a", 4, 0.1).reason == "catchup"
    st.versions.set_replay(0)  # the buffer restarted: the replay's rules applied again
    assert st.versions.pending_catchups(0.2) == ["a"]
    rnd = st.versions.begin_catchup("a", PLAN)
    st.sync_done(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=0, ok=True), 0.3)
    st.versions.finish_sync(True, now=0.3)
    assert len(st.grant("a", 4, 0.4).tasks) == 4
    st.register(m.Register(server_id="b", engine_world_size=1), now=0.5)  # whole weights
    assert st.grant("b", 4, 0.6).tasks


def test_a_partly_loaded_server_registered_before_the_replay_is_known_moves_no_version():
    """Found by a review: a server whose last load broke off registered with a restored
    learner before the replay's reach was known, at a version within it. Untrusted for its
    partial weights, it moved the version past the checkpoint's with no training behind
    it: the replay pushed again the versions the other servers held, and the pool's groups
    were dropped for lag. Only a version past the replay moves it, as at registration."""
    st = _state()
    st.ledger.budget.load_state_dict({"version": 10, "consumed": 20})
    st.recovery.restored(["a", "b"])
    st.register(m.Register(server_id="b", engine_world_size=1, policy_version=12), now=0.0)
    partial = m.Register(
        server_id="a", engine_world_size=1, policy_version=12, weights_partial=True
    )
    st.register(partial, now=0.0)
    st.versions.set_replay(14)  # the buffer redelivers four batches: versions 11 to 14
    assert st.version == 10
    assert st.versions.adopt(11)  # b holds it: no push
    assert "a" in st.versions.pending_catchups(0.1)  # a's partial weights are still mended
    st.register(m.Register(server_id="c", engine_world_size=1, policy_version=16), now=0.2)
    assert st.version == 16  # weights no replay makes: the version moves past them


def test_a_member_lost_before_the_group_forms_restarts_the_round_without_it():
    """Lost before the learner's group formed, a member would hold the others in the
    meeting until ``sync.timeout_s``: the round is begun again at once, at its version,
    without it. Lost once the group formed, it only fails the round."""
    st = _state()
    for sid in ("a", "b", "c"):
        st.register(m.Register(server_id=sid, engine_world_size=1), now=0.0)
    rnd = st.versions.begin_sync(PLAN)
    st.leave("b")
    again = rnd.watch.successor
    assert again is not None and rnd.watch.ended() == "b was lost (left)"
    assert (again.version, again.ranks, again.new_group) == (1, {"a": 1, "c": 2}, True)
    assert again.generation == f"main/{again.sync_id}" != rnd.generation
    assert st.syncs.active is not None and st.syncs.active.round is again
    assert not rnd.watch.form()  # the learner finds it given up
    start = st.syncs.start_for("a")
    assert start is not None and (start.sync_id, start.rank) == (again.sync_id, 1)
    assert st.counts["syncs_restarted"] == 1
    assert again.watch.form()  # formed: c's loss now fails the round
    st.leave("c")
    assert again.watch.successor is None and st.syncs.active.round is again
    st.sync_done(m.SyncDone(server_id="a", sync_id=again.sync_id, version=1, ok=True), 0.1)
    result = st.versions.finish_sync(True, now=0.2)
    assert (result.ok, list(result.failed), st.version) == (["a"], ["c"], 1)


def saved_limit(state: dict) -> int:
    budget = _state().ledger.budget
    budget.load_state_dict(state["ledger"]["budget"])
    return budget.limit


def test_a_catch_up_to_an_older_checkpoint_brings_the_servers_record_down():
    """Found by a review: a learner restored at version 10, its servers registered at 12
    with partly loaded weights, a replay through 14. Their catch-up loads the learner's
    weights, version 10, but the record (and heartbeats) kept the higher version: trusted
    at 12, it made the replay adopt versions 11 and 12 no server held (no push, the
    servers generating on version 10 labelled 12). The record is the version loaded."""
    st = _state()
    st.ledger.budget.load_state_dict({"version": 10, "consumed": 20})
    st.recovery.restored(["a"])
    partial = m.Register(
        server_id="a", engine_world_size=1, policy_version=12, weights_partial=True
    )
    reg = st.register(partial, now=0.0)
    st.versions.set_replay(14)
    rnd = st.versions.begin_catchup("a", PLAN)
    assert rnd.version == 10
    st.sync_done(m.SyncDone(server_id="a", sync_id=rnd.sync_id, version=10, ok=True), 0.1)
    st.versions.finish_sync(True, now=0.1)
    # A heartbeat built before the catch-up, arriving after its report, changes nothing.
    hb = m.Heartbeat(
        server_id="a", session=reg.session, policy_version=12, seen_version=10, seen_sync=0
    )
    st.beat(hb, now=0.2)
    rec = st.servers["a"]
    assert (rec.policy_version, rec.trusted) == (10, True)
    assert not st.versions.adopt(11)  # nobody holds it: pushed
    assert st.versions.counts["replay_not_held"] == 1
