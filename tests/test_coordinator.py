"""The coordinator with real peers: stand-in rollout processes, the real buffer service, real
sockets and gloo groups on 127.0.0.1. The coordinator runs in this process (as in learner
rank 0), inside the stand-in learner; the buffer service runs in a thread of it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncrl import wire
from asyncrl.control import Coordinator, coordinator_from_config
from asyncrl.control import messages as m
from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import ReqClient, RequestRefused, config_endpoint
from asyncrl.sync.plan import WeightPlan
from asyncrl.tasks import make_row, write_rows
from buffer.service import BufferService
from tests.helpers import log_tails, wait_until
from tests.standins import rollout
from tests.standins.learner import StandInLearner, loopback_config, random_weights
from tests.standins.rollout import read_journal

BASE = [
    "control.heartbeat_s=0.2",
    "control.dead_after_s=3",
    "control.tasks_per_request=2",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "sync.timeout_s=15",
    "launch.start_timeout_s=30",
]


def _rows(n: int, split: str = "train") -> list[dict]:
    return [make_row("arithmetic", f"{i}+2=", str(i + 2), split=split, index=i) for i in range(n)]


@pytest.fixture
def until(tmp_path) -> Callable[..., object]:
    """``until(pred, what)``: :func:`wait_until` for up to 40 s, failing with the stand-ins'
    logs (they write them to ``tmp_path``)."""
    return functools.partial(wait_until, timeout_s=40, details=lambda: log_tails(tmp_path))


def events(path: Path, kind: str) -> list[dict]:
    return [e for e in read_journal(str(path)) if e["event"] == kind] if path.exists() else []


def acked(path: Path) -> list[str]:
    return [e["task_id"] for e in events(path, "ack")]


@pytest.fixture
def start_standin(tmp_path):
    """Start stand-in rollout processes; whatever is still running at the end is killed."""
    started = []

    def start(config: Path, server_id: str, **kwargs):
        journal = tmp_path / f"{server_id}.jsonl"
        log = tmp_path / f"{server_id}.log"
        proc = rollout.spawn(config, server_id, journal=journal, log_path=log, **kwargs)
        started.append(proc)
        return proc, journal

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _head(coord: Coordinator, kind: str) -> str:
    """``train.<lineage>`` or ``val.<lineage>``: a coordinator from a config draws its own
    lineage, so its ids never repeat an earlier coordinator's."""
    return f"{kind}.{coord.state_dict()['ledger']['source']['lineage']}"


def _metric(coord: Coordinator, key: str) -> float:
    return coord.metrics().get(key, 0.0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lag", [0, 1, 4])
def test_admission_deals_exactly_the_budget_and_resumes_per_version(
    tmp_path, start_standin, until, lag
):
    overrides = [*BASE, f"staleness.max_policy_lag={lag}", "staleness.sync_every=2"]
    cfg, config = loopback_config(tmp_path, overrides)
    per_version = 4 * 2  # train_batch_size * sync_every
    limit = (lag + 1) * per_version
    with (
        BufferService.from_config(cfg),
        BufferClient(config_endpoint(cfg.endpoints, "batches")) as buf,
    ):
        learner = StandInLearner(cfg, train_rows=_rows(80), val_rows=[]).start()
        try:
            proc, journal = start_standin(config, "s0")
            coord = learner.coordinator
            # The server is asking right now (its request is held) and is refused: the
            # budget holds while asked, which is what a sleep-then-look cannot show.
            until(
                lambda: (
                    len(acked(journal)) == limit
                    and _metric(coord, "coordinator/waits/budget")
                    and _metric(coord, "coordinator/held_requests") == 1
                ),
                f"{limit} tasks acknowledged and a request held by the budget",
            )
            assert _metric(coord, "coordinator/budget/free") == 0
            assert len(events(journal, "task")) == limit
            assert _metric(coord, "coordinator/budget/dealt") == limit
            assert buf.stats()["buffer/groups_in"] == limit  # every group reached the buffer

            # The learner trains on a version's worth and pushes version 1 (no stand-in takes
            # weights): one more version's worth is dealt, no more.
            learner.coordinator.trained(acked(journal)[:per_version])
            assert learner.push().version == 1
            until(lambda: len(acked(journal)) == limit + per_version, "dealing")
            held = _metric(coord, "coordinator/waits/budget")
            until(  # asked again and held by the budget: nothing more was dealt
                lambda: (
                    _metric(coord, "coordinator/waits/budget") > held
                    and _metric(coord, "coordinator/held_requests") == 1
                ),
                "the next request held by the budget",
            )
            assert len(events(journal, "task")) == limit + per_version
            until(  # servers report their own metrics with their heartbeats
                lambda: (
                    coord.servers()["s0"]["metrics"].get("rollout/groups_pushed")
                    == limit + per_version
                ),
                "the server's metrics",
            )
            assert learner.shutdown(wait_s=5)
            assert proc.wait(10) == 0
        finally:
            learner.close()


def _train_on_everything(buf: BufferClient, batches: int) -> list[str]:
    """Act as the learner: take ``batches`` batches; the task ids they held."""
    buf.hello()
    ids = []
    for _ in range(batches):
        batch = buf.request_batch(policy_version=0, wait_s=5)
        assert batch is not None
        ids += batch.task_ids
    return ids


@pytest.mark.timeout(90)
def test_killed_client_tasks_are_redealt_to_the_other_and_the_epoch_arrives_once(
    tmp_path, start_standin, until
):
    n_rows = 24
    data = write_rows(_rows(n_rows), tmp_path / "train.parquet")
    overrides = [
        *BASE,
        f"data.train_files=[{data}]",
        "trainer.total_epochs=1",
        "staleness.max_policy_lag=10",  # the whole epoch fits in the budget
        "control.dead_after_s=1.5",
    ]
    cfg, config = loopback_config(tmp_path, overrides)
    with (
        BufferService.from_config(cfg),
        BufferClient(config_endpoint(cfg.endpoints, "batches")) as buf,
    ):
        learner = StandInLearner(cfg).start()  # reads the parquet file
        coord = learner.coordinator
        try:
            a, ja = start_standin(config, "a", hold_after=4)
            until(lambda: events(ja, "hold"), "a to hold a grant")
            b, jb = start_standin(config, "b", task_delay_s=0.02)
            until(lambda: len(acked(jb)) >= 2, "b to work")
            a.kill()  # SIGKILL, mid-run: a holds a grant it never pushed
            a.wait(10)
            held = events(ja, "hold")[0]["task_ids"]
            received_a = [e["task_id"] for e in events(ja, "task")]
            assert set(received_a) - set(acked(ja)) == set(held) and len(held) == 2

            until(
                lambda: _metric(coord, "coordinator/tasks/train_acked") == n_rows,
                "every task acknowledged",
            )
            # Exactly a's unacknowledged tasks, and no others, were re-dealt; b got them.
            assert _metric(coord, "coordinator/tasks/requeued/dead") == len(held)
            assert _metric(coord, "coordinator/tasks/redealt") == len(held)
            to_b = events(jb, "task")
            assert [e["task_id"] for e in to_b if e["attempt"]] == held
            assert len({e["task_id"] for e in to_b}) == len(to_b)  # nothing twice to b
            assert not set(acked(ja)) & {e["task_id"] for e in to_b}
            assert _metric(coord, "coordinator/budget/dealt") == n_rows

            # Every task of the epoch reaches the buffer exactly once.
            ids = _train_on_everything(buf, batches=n_rows // 4)
            assert sorted(ids) == sorted(f"{_head(coord, 'train')}/0/{i}" for i in range(n_rows))
            assert buf.stats()["buffer/drops/duplicate"] == 0
            assert learner.shutdown(wait_s=5)
            assert b.wait(10) == 0
        finally:
            learner.close()


@pytest.mark.timeout(90)
def test_dealt_cursor_survives_a_coordinator_restart(tmp_path, start_standin, until):
    cfg, config = loopback_config(tmp_path, [*BASE, "staleness.max_policy_lag=1"])
    rows = _rows(40)
    with BufferService.from_config(cfg):
        first = coordinator_from_config(cfg, train_rows=rows, val_rows=[]).start()
        _, journal = start_standin(config, "s0")
        try:
            until(lambda: len(acked(journal)) == 8, "the first 8 tasks")
            until(lambda: _metric(first, "coordinator/waits/budget"), "a refusal")
            saved = first.state_dict()
        finally:
            first.stop()  # a crash, as the server sees it
        before = acked(journal)

        second = coordinator_from_config(cfg, train_rows=rows, val_rows=[], saved_state=saved)
        second.start()
        try:
            until(lambda: "s0" in second.servers(), "s0 to register again")
            # s0 asked again and was refused: only then does "nothing more dealt" say anything.
            until(lambda: _metric(second, "coordinator/waits/budget"), "a refusal after restart")
            assert _metric(second, "coordinator/budget/dealt") == 8  # the budget came back too
            assert len(acked(journal)) == 8
            second.trained(before[:4])  # a version's worth, then a push nobody receives
            second.finish_sync(second.begin_sync(WeightPlan()))
            until(lambda: len(acked(journal)) == 12, "4 more tasks")
            after = acked(journal)[8:]
            head = _head(first, "train")
            assert _head(second, "train") == head  # a restored coordinator keeps its lineage
            assert after == [f"{head}/0/{p}" for p in range(8, 12)]  # where the cursor was
            assert not set(after) & set(before)
            assert second.shutdown(wait_s=5)
        finally:
            second.stop()


@pytest.mark.timeout(120)
def test_sync_through_the_coordinator_and_a_late_joiner_catches_up(tmp_path, start_standin, until):
    cfg, config = loopback_config(tmp_path, [*BASE, "staleness.max_policy_lag=3"])
    with BufferService.from_config(cfg):
        learner = StandInLearner(cfg, tensors=random_weights(1), train_rows=_rows(60), val_rows=[])
        learner.start()
        coord = learner.coordinator
        try:
            # a and b hold their third grant, so the budget (16) is left for the late joiner.
            (_, ja), (_, jb) = (
                start_standin(config, s, weights=True, hold_after=2) for s in ("a", "b")
            )
            until(lambda: events(ja, "hold") and events(jb, "hold"), "a and b")

            learner.set_weights(random_weights(2))
            result = learner.push()  # version announcement -> sync -> reports
            assert (result.version, sorted(result.ok), result.failed) == (1, ["a", "b"], {})
            assert result.checksums == {"a": learner.digest(), "b": learner.digest()}
            until(
                lambda: all(s["policy_version"] == 1 for s in coord.servers().values()),
                "both servers to report version 1",
            )

            _, jl = start_standin(config, "late", weights=True)
            until(lambda: coord.pending_catchups() == ["late"], "a catch-up")
            until(  # it asks for tasks and is held back until it holds the weights
                lambda: _metric(coord, "coordinator/waits/catchup") >= 1, "a catch-up wait"
            )
            assert not events(jl, "task")  # no task before its weights
            (caught_up,) = learner.serve_catchups()
            assert caught_up.ok == ["late"] and caught_up.checksums["late"] == learner.digest()
            until(lambda: acked(jl), "the late joiner's first task")
            journal = read_journal(str(jl))
            kinds = [e["event"] for e in journal]
            assert kinds.index("sync") < kinds.index("task")
            assert events(jl, "ack")[0]["version"] == 1  # generated with the new weights

            learner.set_weights(random_weights(3))
            result = learner.push()  # the main group re-forms with the late joiner
            assert (result.version, sorted(result.ok)) == (2, ["a", "b", "late"])
            assert result.generation == "main/3" and set(result.checksums.values()) == {
                learner.digest()
            }
            assert learner.shutdown(wait_s=5)
        finally:
            learner.close()


@contextlib.contextmanager
def _four_lag_drops(tmp_path, start_standin, until) -> Iterator[tuple[StandInLearner, Path]]:
    """A run at lag 0 whose first 4 groups (version 0) reach the buffer and are dropped
    for lag by a learner one version ahead; yields the learner and the server's journal,
    and shuts the learner down after the body."""
    cfg, config = loopback_config(tmp_path, [*BASE, "staleness.max_policy_lag=0"])
    with (
        BufferService.from_config(cfg),
        BufferClient(config_endpoint(cfg.endpoints, "batches")) as buf,
    ):
        learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
        try:
            _, journal = start_standin(config, "s0")
            until(lambda: len(acked(journal)) == 4, "the first 4 tasks")
            buf.hello()
            assert buf.request_batch(policy_version=1, wait_s=0) is None
            yield learner, journal
            assert learner.shutdown(wait_s=5)
        finally:
            learner.close()


@pytest.mark.timeout(60)
def test_groups_dropped_by_the_buffer_return_to_the_budget(tmp_path, start_standin, until):
    with _four_lag_drops(tmp_path, start_standin, until) as (learner, journal):
        until(lambda: len(acked(journal)) == 8, "4 refunded tasks dealt")
        assert _metric(learner.coordinator, "coordinator/budget/refunded/lag") == 4
        assert _metric(learner.coordinator, "coordinator/budget/dealt") == 4


@pytest.mark.timeout(60)
def test_validation_rounds_are_flagged_and_outside_the_budget(tmp_path, start_standin, until):
    overrides = [*BASE, "staleness.max_policy_lag=0", "trainer.val_before_train=true"]
    cfg, config = loopback_config(tmp_path, [*overrides, "trainer.test_freq=5"])
    with (
        BufferService.from_config(cfg),
        BufferClient(config_endpoint(cfg.endpoints, "batches")) as buf,
    ):
        learner = StandInLearner(cfg, train_rows=_rows(20), val_rows=_rows(3, "test")).start()
        try:
            _, journal = start_standin(config, "s0")
            until(lambda: len(acked(journal)) == 3 + 4, "validation and training")
            tasks = events(journal, "task")
            assert [e["val"] for e in tasks] == [True] * 3 + [False] * 4  # validation first
            learner.coordinator.on_step(5)  # test_freq: a new round, budget or not
            until(lambda: len(acked(journal)) == 10, "the second round")
            assert [e["task_id"] for e in events(journal, "task")[7:]] == [
                f"{_head(learner.coordinator, 'val')}/1/{i}" for i in range(3)
            ]
            by_round = buf.validation().by_round
            head = _head(learner.coordinator, "val")
            assert sorted(by_round) == [f"{head}/0", f"{head}/1"]  # per round, kept
            assert all(len(r) == 3 for r in by_round.values())  # a group per row
            groups = [g for r in by_round.values() for g in r.values()]
            assert {g.data_source for g in groups} == {"arithmetic"}
            assert sum(g.trajectories for g in groups) == 6
            assert list(buf.validation([f"{head}/1"]).by_round) == [f"{head}/1"]
            assert learner.shutdown(wait_s=5)
        finally:
            learner.close()


@pytest.mark.timeout(30)
def test_the_coordinator_refuses_what_it_cannot_serve_and_keeps_serving(tmp_path):
    cfg, _ = loopback_config(tmp_path, BASE)
    with coordinator_from_config(cfg, train_rows=_rows(4), val_rows=[]) as coord:
        addr = config_endpoint(cfg.endpoints, "tasks")
        with ReqClient(addr, timeout_s=5) as tasks:

            def ask(msg: wire.Message) -> m.Reply:
                return tasks.call(msg, lambda frames: m.decode_reply(frames[0]))

            with pytest.raises(RequestRefused, match="wrong_socket: register goes to"):
                ask(m.Register(server_id="s"))
            with pytest.raises(RequestRefused, match="invalid"):
                ask(wire.StatsRequest())  # the buffer's
            grant = ask(m.TaskRequest(server_id="s", max_tasks=1))
            assert isinstance(grant, m.TaskGrant) and grant.reason == "unregistered"
        assert _metric(coord, "coordinator/rejects") == 1


@pytest.mark.timeout(60)
def test_an_unexpected_error_in_the_buffer_poll_does_not_end_it(
    tmp_path, start_standin, until, monkeypatch
):
    """Found by a hang audit: the poll of the buffer's reports caught only the errors of a
    silent or refusing buffer, so any other one ended its thread; lag refunds then stopped
    and the run waited for batches for good. The first poll fails here; the refunds come."""
    from asyncrl.control import loop as control_loop

    real, calls = control_loop._poll_once, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a defect in the poll")
        return real(*args)

    monkeypatch.setattr(control_loop, "_poll_once", flaky)
    test_groups_dropped_by_the_buffer_return_to_the_budget(tmp_path, start_standin, until)
    assert len(calls) > 1


@pytest.mark.timeout(60)
def test_a_drop_report_that_fails_does_not_take_the_others_with_it(
    tmp_path, start_standin, until, monkeypatch
):
    """The buffer drains its drop reports as it answers: applied as one list, a defect on
    one of them lost every refund of the drain. Here the first of four lag drops fails:
    it is counted, and the other three return to the budget."""
    from asyncrl.control.ledger import TaskLedger

    real, failed = TaskLedger.dropped, []

    def dropped(self, reports):
        reports = list(reports)
        if reports and not failed:
            failed.append(reports[0].task_id)
            raise KeyError("a defect applying one report")
        return real(self, reports)

    monkeypatch.setattr(TaskLedger, "dropped", dropped)
    with _four_lag_drops(tmp_path, start_standin, until) as (learner, _):
        coord = learner.coordinator
        until(lambda: _metric(coord, "coordinator/budget/refunded/lag") == 3, "3 refunds")
        assert _metric(coord, "coordinator/buffer_reports_failed") == 1
        assert len(failed) == 1
