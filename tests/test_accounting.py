"""Every task accounted for, through failures and restarts: the coordinator's ledger and
the real replay buffer, driven step by step with instant generation (no sockets).

Each scenario is a small run: a server takes what admission grants, the buffer assembles
groups and releases batches, the learner trains (reports the batch's task ids) and pushes.
The checks are the run's outcome (it reaches its last step), the lag of what was trained,
and the accounting identity against counts kept by the harness itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from asyncrl.control import messages as m
from asyncrl.control.admission import Budget, replayed_version
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource
from asyncrl.sync.plan import WeightPlan
from asyncrl.tasks import make_row
from asyncrl.wire import Packed, Trajectory
from buffer.core import ReplayBuffer

B, N = 4, 2  # groups per batch, samples per group


def _rows(n: int) -> list[dict]:
    return [make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(n)]


def _group(task: m.Task, version: int) -> Packed:
    trajs = [
        Trajectory.build(
            task_id=task.task_id,
            prompt_ids=[1],
            response_ids=[2],
            logprobs=[-1.0],
            version_spans=[(version, 1)],
            reward=float(i),
            group_index=i,
            group_size=task.n,
            validation=task.validation,
        )
        for i in range(task.n)
    ]
    return Packed.pack(trajs)


@dataclass
class Run:
    """A coordinator state, a buffer, one server and a learner, stepped by hand."""

    lag: int
    st: ControlState = field(init=False)
    buf: ReplayBuffer = field(init=False)
    steps: int = 0
    trained_ids: list[str] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)
    ack: bool = True  # acknowledge each batch (a checkpoint every step)
    rows: int = 10_000  # training rows, dealt for ``epochs`` epochs (None: without end)
    epochs: int | None = None

    def __post_init__(self) -> None:
        self.st = _state(self.lag, rows=self.rows, epochs=self.epochs)
        self.buf = ReplayBuffer(batch_size=B, capacity_groups=10**6, max_policy_lag=self.lag)
        self.st.register(m.Register(server_id="s", engine_world_size=0), now=0.0)

    def generate(
        self, fail: set[str] = frozenset(), now: float = 0.0, always: bool = False
    ) -> list[m.Task]:
        """The server takes every task granted and finishes it at once, or fails the ones in
        ``fail`` (once each, or ``always``)."""
        fail = set(fail)
        tasks = []
        while True:
            grant = self.st.grant("s", 64, now)
            if not grant.tasks:
                return tasks
            for t in grant.tasks:
                tasks.append(t)
                if t.task_id in fail:
                    self.st.nack("s", [t.task_id], "RuntimeError: boom", now)
                    if not always:
                        fail.discard(t.task_id)
                    continue
                self.buf.add_packed(_group(t, self.st.version), now)
                self.st.ack("s", [t.task_id], now)

    def step(self) -> bool:
        """One learner step: a batch (after the lag filter and its refunds), train, push."""
        v = self.st.version
        batch = self.buf.release(v, "learner")
        self.st.ledger.dropped(self.buf.take_dropped())
        if batch is None:
            self.generate()  # refunds reopened the budget
            batch = self.buf.release(v, "learner")
        if batch is None:
            return False
        ids = [g.task_id for g in batch.groups]
        self.trained_ids += ids
        self.lags += [lag for lag, k in batch.lag_histogram.items() for _ in range(k)]
        if self.ack:
            self.buf.ack([batch.batch_id])
        self.st.trained(ids)
        self.push()
        self.steps += 1
        return True

    def push(self) -> None:
        self.st.versions.begin_sync(WeightPlan())
        self.st.versions.finish_sync(True, now=0.0)

    def acct(self) -> dict[str, float]:
        a = self.st.ledger.accounting()
        assert a["accounting/train/unaccounted"] == 0
        assert a["accounting/train/trained"] == len(set(self.trained_ids))
        return a


def _state(
    lag: int, min_servers_to_start: int = 1, rows: int = 10_000, epochs: int | None = None, **kw
) -> ControlState:
    source = TaskSource(_rows(rows), shuffle=False, n=N, total_epochs=epochs, lineage="")
    ledger = TaskLedger(source, Budget(lag, B), lag_retries=1, **kw)
    return ControlState(
        ledger,
        SyncBook(),
        heartbeat_s=0.5,
        dead_after_s=2.0,
        store_host="h",
        store_port=1,
        min_servers_to_start=min_servers_to_start,
    )


@pytest.mark.parametrize("lag", [0, 1])
def test_a_task_failing_on_a_live_server_is_dealt_again_and_the_run_goes_on(lag):
    """Defect 3 of the dependable-runs issue: a failed task was never refunded nor dealt
    again, so at lag 0 one failure stalled the learner for good."""
    run = Run(lag)
    run.generate(fail={"train/0/1", "train/0/2"})
    for _ in range(8):
        assert run.step(), f"no batch at step {run.steps}"
        run.generate()
    a = run.acct()
    assert run.st.ledger.counts["failures/failed"] == 2
    assert "train/0/1" in run.trained_ids and "train/0/2" in run.trained_ids
    assert a["accounting/train/given_up"] == 0


def test_a_failure_report_sent_again_does_not_fail_the_tasks_next_deal():
    """Found by a review: a failure report is sent again when its reply is lost, but the
    first had been applied: the task was queued, and dealt to the same server again. The
    second report then failed that new deal: the task was generated twice, its failures
    counted twice (given up early), and the group of the new deal came back "unknown".
    A report now names the deal it is about, and one of an earlier deal is ignored."""
    source = TaskSource(_rows(20), seed=3, n=2, lineage="")
    ledger = TaskLedger(source, Budget(0, 2), task_retries=1)
    (task,), _ = ledger.deal("a", 1)
    assert ledger.nack("a", [task.task_id], attempts=[task.attempt]) == 1  # dealt again
    (again,), _ = ledger.deal("a", 1)
    assert again.task_id == task.task_id and again.attempt == task.attempt + 1
    assert ledger.nack("a", [task.task_id], attempts=[task.attempt]) == 0  # the resend
    assert (
        ledger.entries[task.task_id].state == "out" and ledger.entries[task.task_id].failures == 1
    )
    assert ledger.counts["nacks_of_earlier_deals"] == 1
    assert ledger.ack([again.task_id], server_id="a") == ([again.task_id], [])  # it trains
    # A report that does not say (an older server) is applied as before.
    (other,), _ = ledger.deal("b", 1)
    assert ledger.nack("b", [other.task_id]) == 1


def test_a_task_failing_every_time_is_given_up_and_counted():
    run = Run(0)
    st = run.st
    st.ledger.task_retries = 2
    run.generate(fail={"train/0/0"}, always=True)  # first deal + 2 retries, all failing
    assert run.step()
    a = run.acct()
    assert a["accounting/train/given_up"] == 1 and "train/0/0" not in run.trained_ids
    assert st.ledger.counts["failures/failed"] == 3


def test_when_the_data_is_spent_the_learner_is_told_no_batch_will_come():
    """One epoch of 9 prompts, one given up: after two batches 0 groups are left anywhere,
    fewer than a batch, so the learner stops instead of waiting for a third forever."""
    run = Run(1, rows=9, epochs=1)
    assert run.st.training_left() is None  # the dataset still has tasks to deal
    run.generate(fail={"train/0/4"}, always=True)
    while run.step():
        run.generate(fail={"train/0/4"}, always=True)
    a = run.acct()
    assert run.steps == 2 and a["accounting/train/given_up"] == 1
    assert run.st.training_left() == 0 < B


def test_an_outstanding_task_older_than_task_timeout_is_reclaimed():
    st = _state(0, task_timeout_s=30.0)
    st.register(m.Register(server_id="a", engine_world_size=0), now=0.0)
    lost = st.grant("a", 1, 0.0).tasks[0]
    st.register(m.Register(server_id="b", engine_world_size=0), now=0.0)
    for now in (10.0, 20.0, 29.0):  # "a" stays alive but never finishes it
        st.touch("a", now)
        st.touch("b", now)
        st.reap(now)
    assert lost.task_id in st.ledger.owned["a"]
    st.touch("a", 31.0), st.touch("b", 31.0)
    st.reap(31.0)
    again = st.grant("b", 1, 31.0).tasks
    assert [(t.task_id, t.attempt) for t in again] == [(lost.task_id, 1)]
    assert st.ledger.counts["failures/timeout"] == 1
    st.ack("a", [lost.task_id], 32.0)  # the first holder delivers after all: counted once
    st.ack("b", [lost.task_id], 33.0)
    a = st.ledger.accounting()
    assert (a["accounting/train/in_buffer"], a["accounting/train/dealt"]) == (1, 1)


@pytest.mark.parametrize("how", ["resume_push", "registration"])
def test_restarts_do_not_widen_the_admission_window(how):
    """Defect 4 of the dependable-runs issue: a version bump without consumption (the push
    of restored weights, a server registering with a higher version) widened the window for
    good, and the extra groups were dropped for lag (a third of them in the review)."""
    run = Run(1)
    for _ in range(6):
        run.generate()
        assert run.step()
    before, pooled = run.st.ledger.budget.limit, run.buf.ready
    if how == "resume_push":
        run.push()  # restored weights pushed as a new version: nothing consumed
    else:
        run.st.register(m.Register(server_id="t", engine_world_size=0, policy_version=9), 0.0)
    assert run.st.ledger.budget.limit == before
    run.generate()
    assert run.step()
    # The bump ages what was generated before it, once (at most what was pooled then) ...
    at_bump = run.buf.counts["drops/lag"]
    assert at_bump <= pooled
    for _ in range(8):
        run.generate()
        assert run.step()
    # ... and nothing after: the window was not widened.
    assert run.buf.counts["drops/lag"] == at_bump
    assert max(run.lags) <= 1
    run.acct()


def test_a_task_adopted_after_a_learner_restart_takes_its_servers_failure_report():
    """Found by a review: a restored ledger queues a task its checkpoint saw out (its
    attempt moved on by one); the server that still held it named it at its registration
    and got it back, but its failure report then named its own deal's attempt and was
    ignored as one of an earlier deal: the task stayed charged until
    control.task_timeout_s (30 min; at lag 0 the learner's whole batch waited)."""
    from asyncrl.control.ledger_checkpoint import load_ledger, save_ledger
    from asyncrl.control.ledger_recovery import adopt

    old = TaskLedger(TaskSource(_rows(20), seed=3, n=2, lineage=""), Budget(0, 2))
    (task,), _ = old.deal("a", 1)
    resumed = TaskLedger(TaskSource(_rows(20), seed=3, n=2, lineage=""), Budget(0, 2))
    load_ledger(resumed, save_ledger(old))
    assert adopt(resumed, "a", [task.task_id], now=1.0) == 1
    assert resumed.nack("a", [task.task_id], attempts=[task.attempt]) == 1
    e = resumed.entries[task.task_id]
    assert (e.state, e.failures, resumed.committed) == ("queued", 1, 0)
    assert resumed.counts["nacks_of_earlier_deals"] == 0
    # Dealt again here, the attempt check holds again: a resent report is ignored.
    (again,), _ = resumed.deal("a", 1)
    assert again.task_id == task.task_id
    assert resumed.nack("a", [task.task_id], attempts=[task.attempt]) == 0
    assert resumed.counts["nacks_of_earlier_deals"] == 1


def test_a_checkpoint_from_before_per_id_states_resumes_within_the_window():
    """Found by a review: a checkpoint written before per-id states restores every id it
    owed as queued, so nothing counts as trained, while the budget restored ``consumed``
    as its version's (version x groups): the resumed window dealt that many groups at
    once, generated only to be dropped for lag."""
    from asyncrl.control.ledger_checkpoint import load_ledger, save_ledger

    source = TaskSource(_rows(2000), seed=1, n=2, lineage="")
    old = TaskLedger(source, Budget(1, 8))
    old.deal("a", 4)
    state = save_ledger(old)
    state["budget"].update(version=100, consumed=800)  # 100 versions of 8 groups trained
    del state["entries"]  # the old schema: what was owed, not every id's state
    state["outstanding"], state["redeal"] = list(state["redeal"]), []
    resumed = TaskLedger(TaskSource(_rows(2000), seed=1, n=2, lineage=""), Budget(1, 8))
    load_ledger(resumed, state)
    dealt, _ = resumed.deal("a", 1000)
    assert len(dealt) <= (1 + 1) * 8  # one window of groups, not 800 more


def test_an_inventory_from_a_buffer_not_reading_deals_nothing_again():
    """A restored coordinator's inventory came from a full buffer: the groups it lacks may
    wait in its socket, so none is dealt again (review); the audit asks once it reads."""
    run = Run(1)
    run.generate()
    assert run.step()
    assert run.st.ledger.accounting()["accounting/train/in_buffer"] == 4
    run.st.recovery.needs_inventory = True  # as a coordinator restored from a checkpoint
    assert run.st.recovery.buffer_contact("session", now=20.0)  # the inventory is due
    assert run.st.reconcile_buffer([], [], paused=True) == 0
    assert run.st.ledger.accounting()["accounting/train/in_buffer"] == 4
    assert run.st.ledger.counts["requeued/lost"] == 0
    assert run.st.reconcile_buffer([], [], paused=False) == 4  # reading: they are lost


def test_after_a_buffer_restart_its_untrained_groups_are_dealt_again():
    run = Run(1)
    run.generate()
    assert run.step()
    held = run.st.ledger.accounting()["accounting/train/in_buffer"]
    assert held == 4  # the window's other half, waiting in the buffer
    run.buf = ReplayBuffer(batch_size=B, capacity_groups=10**6, max_policy_lag=1)  # restart
    run.st.recovery.buffer_session = "old"
    assert not run.st.recovery.buffer_contact("new", now=10.0)  # settles first
    assert run.st.recovery.buffer_contact("new", now=13.0)
    held_ids, dropped, _ = run.buf.inventory()
    assert run.st.reconcile_buffer(held_ids, dropped) == 4
    for _ in range(5):
        run.generate(now=14.0)
        assert run.step()
    a = run.acct()
    assert a["accounting/train/trained"] == 24 and run.st.ledger.counts["requeued/lost"] == 4


def test_a_new_line_does_not_count_the_validation_groups_of_the_line_before():
    """A learner restarted without a checkpoint gets a new lineage, and its coordinator
    reads the reports of the buffer that outlived the first from their start: the first
    line's scored validation groups come again. They are counted apart
    (``validated_foreign``), not among the groups this line dealt and scored, as another
    line's drops are not."""
    buf = ReplayBuffer(batch_size=B, capacity_groups=10**6, max_policy_lag=1)

    def line(lineage: str) -> ControlState:
        val = [
            make_row("arithmetic", f"{i}+2=", str(i + 2), split="test", index=i) for i in range(3)
        ]
        source = TaskSource(_rows(50), val, shuffle=False, n=N, lineage=lineage)
        st = ControlState(
            TaskLedger(source, Budget(1, B)), SyncBook(), heartbeat_s=0.5, dead_after_s=2.0,
            store_host="h", store_port=1,
        )  # fmt: skip
        st.register(m.Register(server_id="s", engine_world_size=0), now=0.0)
        return st

    first = line("aaaaaa")
    assert first.start_validation(0)
    for t in first.grant("s", 64, 0.0).tasks:
        buf.add_packed(_group(t, 0), 0.0)
        first.ack("s", [t.task_id], 0.0)
    scored = buf.reports.take_validated()
    assert len(scored) == 3
    first.trained(scored)
    assert first.ledger.accounting()["accounting/val/scored"] == 3

    second = line("bbbbbb")
    second.trained(scored)  # what its first drain of the buffer's reports says
    a = second.ledger.accounting()
    assert a["accounting/val/dealt"] == 0 and a["accounting/val/scored"] == 0
    assert second.ledger.counts["validated_foreign"] == 3


@pytest.mark.parametrize("replay", [True, False])
def test_a_learner_restart_loses_nothing_and_repeats_nothing(replay):
    """Restore a checkpoint taken 3 steps before the crash: the buffer's unacknowledged
    batches come again, the groups dealt after the checkpoint are adopted from the buffer's
    inventory instead of dealt twice. With the replay (the learner retrains the redelivered
    batches and so reaches the versions the server holds, without pushing them) nothing is
    dropped for lag; without it (the redelivered batches were lost with the buffer, say),
    the restored weights go out as a version above the server's, and at most what was
    generated before the crash is dropped for lag (the old window widened and dropped a
    third of all groups)."""
    run = Run(1)
    for _ in range(5):
        run.generate()
        assert run.step()
    saved, acked_through = run.st.state_dict(), run.buf.next_batch_id - 1  # checkpoint
    run.ack = False  # the next batches are not in a checkpoint
    for _ in range(3):
        run.generate()
        assert run.step()
    run.generate()
    # Crash; the buffer lives on. The restored learner says hello with its checkpoint.
    run.trained_ids = run.trained_ids[: 5 * B]
    run.st, run.ack = _state(1), True
    run.st.load_state_dict(saved)
    assert run.buf.restart(acked_through, "learner", run.buf.session) == (3, 0)
    run.st.register(m.Register(server_id="s", engine_world_size=1, policy_version=8), 1.0)
    through = replayed_version(5, 5, 3 if replay else 0, sync_every=1, total=100)
    run.st.versions.set_replay(through)
    assert run.st.servers["s"].trusted == replay
    assert run.st.version == (5 if replay else 8)  # without a replay: above the server's
    held, dropped, _ = run.buf.inventory()
    run.st.reconcile_buffer(held, dropped)
    if not replay:
        run.push()  # the restored weights, as a version above every server's
    while run.buf.deliveries.redeliver:  # the batches after the checkpoint, trained again
        batch = run.buf.release(run.st.version, "learner")
        ids = [g.task_id for g in batch.groups]
        run.trained_ids += ids
        run.buf.ack([batch.batch_id])
        run.st.trained(ids)
        if not run.st.versions.adopt(run.st.version + 1):
            run.push()
    assert run.st.version == (8 if replay else 12)
    # The replay itself: versions 6-8 adopted (the server holds 8), none pushed.
    assert run.st.counts["versions_replayed"] == (3 if replay else 0)
    assert not run.st.versions.adopt(run.st.version + 1)  # past the replay: pushes again
    run.st.servers["s"].engine_world_size = 0  # from here the server follows every push
    for _ in range(12):
        run.generate()
        assert run.step()
    a = run.acct()
    assert run.buf.counts["drops/duplicate"] == 0  # nothing dealt twice
    if replay:
        assert run.buf.counts["drops/lag"] == 0 and max(run.lags) <= 1
    else:
        assert run.buf.counts["drops/lag"] <= 2 * B  # at most the window generated pre-crash
    trained = len(set(run.trained_ids))
    assert trained == 20 * B
    assert a["accounting/train/dealt"] == trained + sum(
        a[f"accounting/train/{k}"] for k in ("in_buffer", "in_flight", "dropped/lag")
    )


def loopback_coordinator(tmp_path: Any) -> tuple[Any, Any]:
    """A stand-in learner's real coordinator on 127.0.0.1 (batches of 2 groups of 2, lag 0,
    no validation) and a registered-to-be client of server ``s``: (learner, client)."""
    from asyncrl.control.client import CoordinatorClient
    from tests.standins.learner import StandInLearner, loopback_config

    cfg, _ = loopback_config(
        tmp_path,
        [
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
            "staleness.max_policy_lag=0",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "control.heartbeat_s=0.2",
            "control.dead_after_s=3",
        ],
    )
    learner = StandInLearner(cfg, train_rows=_rows(20), val_rows=[]).start()
    return learner, CoordinatorClient.from_config(cfg, "s", engine_world_size=0)


@pytest.mark.timeout(60)
def test_a_failure_report_over_the_wire_gets_the_task_dealt_again(tmp_path):
    """A real coordinator and client on loopback: the negative ack travels and the task
    comes back under its id at the next request, the budget open for it again."""
    learner, client = loopback_coordinator(tmp_path)
    try:
        client.register()
        first = client.request_tasks(2).tasks
        assert len(first) == 2 and client.request_tasks(1, wait_s=0.2).reason == "budget"
        assert client.nack([first[0].task_id], "RuntimeError: boom")
        again = client.request_tasks(2).tasks
        assert [(t.task_id, t.attempt) for t in again] == [(first[0].task_id, 1)]
        metrics = learner.coordinator.metrics()
        assert metrics["coordinator/tasks/failures/failed"] == 1
        assert metrics["accounting/train/dealt"] == 2
        assert metrics["accounting/train/in_flight"] == 2
    finally:
        client.close()
        learner.close()


def test_a_resumed_run_does_not_wait_for_min_servers_to_start_again():
    """A run scaled down to one server, then its learner restarted: the start-up rule
    (control.min_servers_to_start) is not applied again, or the run would never go on."""
    st = _state(1, min_servers_to_start=2)
    for sid in ("a", "b"):
        st.register(m.Register(server_id=sid, engine_world_size=0), now=0.0)
    assert st.grant("a", 1, 0.1).tasks
    st.leave("b")  # scaled down
    restarted = _state(1, min_servers_to_start=2)
    restarted.load_state_dict(st.state_dict())
    restarted.recovery.needs_inventory = False  # no buffer in this test
    restarted.register(m.Register(server_id="a", engine_world_size=0), now=1.0)
    assert restarted.grant("a", 1, 1.1).tasks


def test_validation_groups_a_new_buffer_scored_are_not_counted_lost():
    """Found by a review: the inventory of a buffer that restarted was reconciled before
    the validation groups it scored were marked done. Not held (scored groups are not
    kept), they were counted ``requeued/lost`` and put back to be dealt again."""
    val = [make_row("arithmetic", f"{i}+2=", str(i + 2), split="test", index=i) for i in range(3)]
    source = TaskSource(_rows(50), val, shuffle=False, n=N, lineage="")
    st = ControlState(
        TaskLedger(source, Budget(1, B)), SyncBook(), heartbeat_s=0.5, dead_after_s=2.0,
        store_host="h", store_port=1,
    )  # fmt: skip
    st.register(m.Register(server_id="s", engine_world_size=0), now=0.0)
    assert st.start_validation(0)
    tasks = st.grant("s", 64, 0.0).tasks
    for t in tasks:
        st.ack("s", [t.task_id], 0.0)  # pushed to the buffer that dies
    st.recovery.buffer_session = "old"
    assert not st.recovery.buffer_contact("new", now=10.0)
    assert st.recovery.buffer_contact("new", now=13.0)
    new = ReplayBuffer(batch_size=B, capacity_groups=10**6, max_policy_lag=1)
    for t in tasks:  # their pushes waited in the socket and reached the new buffer
        new.add_packed(_group(t, 0), 13.0)
    held, dropped, validated = new.inventory()
    assert len(validated) == 3
    assert st.reconcile_buffer(held, dropped, validated=validated) == 0
    assert st.ledger.counts["requeued/lost"] == 0
    a = st.ledger.accounting()
    assert a["accounting/val/scored"] == 3 and a["accounting/train/unaccounted"] == 0
