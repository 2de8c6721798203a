"""What the coordinator's records must survive across restarts of the learner and of the
buffer: a server's report of the previous coordinator's deal, sent again because that life
never answered it (attempts start over after a restore, so a report names the session that
dealt it, ``Task.dealt_session``); the batch the learner trains when the buffer restarts;
and a replay after a buffer restart since the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.ledger_checkpoint import load_ledger, save_ledger
from asyncrl.control.ledger_recovery import adopt
from asyncrl.control.task_source import TaskSource
from tests.test_accounting import _rows

pytestmark = pytest.mark.timeout(60)


def _lives() -> tuple[TaskLedger, TaskLedger]:
    """The old coordinator (session ``old``) saved its checkpoint, then dealt one task to
    server ``a``; the restored one (session ``new``) starts from that checkpoint."""
    old = TaskLedger(TaskSource(_rows(20), seed=3, n=2, lineage=""), Budget(0, 2), session="old")
    saved = save_ledger(old)
    new = TaskLedger(TaskSource(_rows(20), seed=3, n=2, lineage=""), Budget(0, 2), session="new")
    load_ledger(new, saved)
    return old, new


def test_a_filtered_report_of_the_old_coordinators_deal_leaves_the_new_deal_alone():
    old, new = _lives()
    (first,), _ = old.deal("a", 1)
    assert first.dealt_session == "old"
    (again,), _ = new.deal("a", 1)  # the same prompt, dealt afresh: the same attempt
    assert (again.task_id, again.attempt, again.dealt_session) == (first.task_id, 0, "new")

    stale = new.filtered("a", [first.task_id], attempts=[first.attempt], session="old")
    assert stale == [] and new.counts["filtered_of_earlier_deals"] == 1
    assert new.entries[again.task_id].state == "out" and new.committed == 1
    # The new deal's own report ends it.
    assert new.filtered("a", [again.task_id], attempts=[again.attempt], session="new") == [
        again.task_id
    ]
    assert new.committed == 0


def test_a_failure_report_of_the_old_coordinators_deal_leaves_the_new_deal_alone():
    old, new = _lives()
    (first,), _ = old.deal("a", 1)
    (again,), _ = new.deal("a", 1)
    assert new.nack("a", [first.task_id], attempts=[first.attempt], session="old") == 0
    assert new.counts["nacks_of_earlier_deals"] == 1
    assert new.entries[again.task_id].failures == 0
    assert new.nack("a", [again.task_id], attempts=[again.attempt], session="new") == 1


def test_a_report_of_a_task_the_server_held_through_the_restart_is_taken():
    """A task the server still held when it registered again is adopted: its report names
    the old coordinator's deal, which is the one the new coordinator tracks."""
    old, new = _lives()
    (first,), _ = old.deal("a", 1)
    assert adopt(new, "a", [first.task_id], now=1.0) == 1
    done = new.filtered("a", [first.task_id], attempts=[first.attempt], session="old")
    assert done == [first.task_id] and new.committed == 0


def test_the_restored_coordinator_ignores_the_old_ones_filtered_report_end_to_end():
    """Through the control state, as the coordinator's loop hands it a TaskAck: the old
    life's report (its session) is answered unknown, the new life's own is taken."""
    from asyncrl.control import messages as m
    from tests.test_accounting import _state

    old = _state(0)
    old.register(m.Register(server_id="s", engine_world_size=0), now=0.0)
    saved = old.state_dict()
    (first,) = old.grant("s", 1, 0.0).tasks
    new = _state(0)
    new.load_state_dict(saved)
    new.register(m.Register(server_id="s", engine_world_size=0), now=1.0)
    new.reconcile_buffer(held=[], dropped=[])
    new.versions.set_replay(0)
    (again,) = new.grant("s", 1, 1.0).tasks
    assert again.task_id == first.task_id and again.dealt_session == new.session != old.session

    stale = new.ack("s", [first.task_id], 2.0, True, False, [first.attempt], old.session)
    assert (stale.acked, stale.unknown) == ([], [first.task_id])
    own = new.ack("s", [again.task_id], 2.0, True, False, [again.attempt], again.dealt_session)
    assert own.acked == [again.task_id]


@pytest.mark.timeout(60)
def test_reports_naming_another_coordinators_deal_are_ignored_over_the_wire(tmp_path):
    """A real coordinator and client on loopback: the session a report names travels from
    the client through the coordinator's loop to the ledger, for filtered and failure
    reports alike; the same reports naming the deal's own session are taken."""
    from tests.test_accounting import loopback_coordinator

    learner, client = loopback_coordinator(tmp_path)
    try:
        client.register()
        a, b = client.request_tasks(2).tasks
        assert a.dealt_session and a.dealt_session == b.dealt_session
        old = "0ldc0de"  # a coordinator before the learner's restart
        reply = client.ack([a.task_id], filtered=True, dealt=[a.attempt], session=old)
        assert reply is not None and (reply.acked, reply.unknown) == ([], [a.task_id])
        assert client.nack([b.task_id], "RuntimeError: boom", [b.attempt], session=old)
        assert client.request_tasks(1, wait_s=0.2).reason == "budget"  # neither was taken
        metrics = learner.coordinator.metrics()
        assert metrics["coordinator/tasks/filtered_of_earlier_deals"] == 1
        assert metrics["coordinator/tasks/nacks_of_earlier_deals"] == 1

        reply = client.ack([a.task_id], filtered=True, dealt=[a.attempt], session=a.dealt_session)
        assert reply is not None and reply.acked == [a.task_id]
        assert client.nack([b.task_id], "RuntimeError: boom", [b.attempt], session=b.dealt_session)
        again = client.request_tasks(2).tasks
        assert b.task_id in [t.task_id for t in again]
    finally:
        client.close()
        learner.close()


def test_a_buffer_restart_while_the_learner_trains_a_batch_does_not_deal_it_again():
    """Found by a review: the batch the learner took from the old buffer is not in the new
    buffer's inventory, and was dealt again as lost (generated twice; with buffer.max_reuse
    above 1 trained twice). The learner names the batch it trains; the rest is still lost."""
    from asyncrl.control import messages as m
    from buffer.core import ReplayBuffer
    from tests.test_accounting import B, _group, _state

    st = _state(1)
    st.register(m.Register(server_id="s", engine_world_size=0), now=0.0)
    old = ReplayBuffer(batch_size=B, capacity_groups=100, max_policy_lag=1)
    tasks = st.grant("s", 2 * B, 0.0).tasks
    for t in tasks:
        old.add_packed(_group(t, 0), 0.0)
        st.ack("s", [t.task_id], 0.0)
    st.recovery.buffer_contact(old.session, 0.5)
    batch = old.release(0, "learner")
    assert batch is not None
    training = [g.task_id for g in batch.groups]
    st.training(training)  # as the learner's control plane does when it takes the batch
    audit = st.audit_request(1e9)
    assert audit is not None and len(audit[0]) == B  # the rest are still audited...
    assert not set(training) & set(audit[0])  # ...not the batch in training

    new = ReplayBuffer(batch_size=B, capacity_groups=100, max_policy_lag=1)
    st.recovery.buffer_contact(new.session, 10.0)
    st.recovery.buffer_contact(new.session, 12.0)
    held, drops, validated = new.inventory()
    assert st.reconcile_buffer(held, drops, validated=validated) == B  # the other batch
    again = {t.task_id for t in st.grant("s", 2 * B, 12.0).tasks}
    assert again == {t.task_id for t in tasks} - set(training)
    st.trained(training)
    assert {st.ledger.entries[t].state for t in training} == {"done"}
    assert st.in_training == set()


class _Welcoming:
    """A buffer client whose hello answers from buffer session ``session``."""

    def __init__(self, session: str) -> None:
        self.session = session

    def hello(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        from asyncrl import wire

        return wire.Welcome(
            redelivering=1, next_batch_id=1, acked=0, policy_version=11, session=self.session
        )


class _Replaying:
    """The coordinator's side of a resume: what the replay is said to reproduce."""

    def __init__(self) -> None:
        self.through = -1
        self.floor = 0

    def set_replay(self, through: int, session: str) -> None:
        self.through = through

    def at_least(self, version: int) -> None:
        self.floor = max(self.floor, version)


@pytest.mark.parametrize("restarted", [False, True], ids=["same_buffer", "buffer_restarted"])
def test_a_replay_trusts_no_pushed_version_when_the_buffer_restarted_since_the_checkpoint(
    restarted: bool,
) -> None:
    """Found by a review: checkpoint at v10 (buffer session S1); the previous life trained
    S1's batch 11 and pushed v11; the buffer restarted (S2) and released its batch 0; the
    learner died. The new buffer's one batch to redeliver is not the one v11 came from, yet
    the replay took v11 as reproduced: servers holding it were trusted without a catch-up."""
    from asyncrl.config import load_config
    from learner.control_peer import Restored
    from learner.control_start import meet_buffer

    cfg = load_config(None, ["staleness.sync_every=1"])
    restored = Restored(Path("ckpt"), 10, {}, step=10, version=10, last_batch_session="S1")
    coordinator = _Replaying()
    buffer = _Welcoming("S2" if restarted else "S1")
    meet_buffer(cfg, buffer, coordinator, restored, total_steps=100)  # type: ignore[arg-type]
    assert coordinator.through == (10 if restarted else 11)
    assert coordinator.floor == (11 if restarted else 0)  # then pushes go on above v11
