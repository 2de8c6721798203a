"""The servers' counters in the step records are run totals: a server restarted under the
same id, one that left, a reaped one that comes back, and a learner restarted from its
checkpoint never make a counter fall (found by a review: summed over the live servers,
a restarted server's counts vanished and the records went backwards)."""

from __future__ import annotations

import json

from asyncrl.control import messages as m
from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.server_totals import INCARNATION, ServerTotals
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource
from asyncrl.tasks import make_row
from learner.metrics import rollout_summary

ERR, TOK = "rollout/reward_errors", "rollout/tokens"


def _state() -> ControlState:
    rows = [make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(8)]
    return ControlState(
        TaskLedger(TaskSource(rows, [], seed=1, n=2, lineage=""), Budget(1, 4)),
        SyncBook(),
        heartbeat_s=0.5,
        dead_after_s=2.0,
        store_host="127.0.0.1",
        store_port=1,
    )


def _beat(st: ControlState, sid: str, incarnation: float | None, errors: float, **more) -> None:
    if sid not in st.servers:  # a new process, or one reaped, registers (again)
        st.register(m.Register(server_id=sid, engine_world_size=0), now=0.0)
    metrics = {ERR: errors, TOK: 100.0 * errors, "rollout/tokens_per_s": 5.0, **more}
    if incarnation is not None:
        metrics[INCARNATION] = incarnation
    hb = m.Heartbeat(
        server_id=sid, session=st.session, policy_version=0, seen_version=0, seen_sync=0,
        metrics=metrics,
    )  # fmt: skip
    assert st.beat(hb, now=0.0) is not None


def _record(st: ControlState) -> dict[str, float]:
    """The step record's ``rollout/*``, as the learner writes it."""
    servers = {sid: dict(r.metrics) for sid, r in st.servers.items()}
    return rollout_summary(servers, st.server_totals.totals())


def test_a_restarted_or_departed_servers_counts_stay_in_the_run_totals():
    st = _state()
    _beat(st, "a", 1.0, 40.0)
    _beat(st, "b", 2.0, 10.0)
    seen = [_record(st)[ERR]]
    st.leave("a")  # killed: the launcher's Leave
    seen.append(_record(st)[ERR])
    _beat(st, "a", 3.0, 1.0)  # its restart, counting from 0 again
    seen.append(_record(st)[ERR])
    st.leave("b")  # gone for good
    seen.append(_record(st)[ERR])
    assert seen == [50.0, 50.0, 51.0, 51.0]
    last = _record(st)
    assert last[TOK] == 5100.0 and last["rollout/servers_reporting"] == 1
    assert last["rollout/tokens_per_s"] == 5.0  # a rate: the live servers' only
    assert INCARNATION not in last  # a server's own number, never summed


def test_a_reaped_server_that_comes_back_as_the_same_process_is_counted_once():
    """A server declared dead while alive (a long pause) registers again, the same
    process: its counts go on from where they were, not on top of themselves."""
    st = _state()
    _beat(st, "a", 7.0, 40.0)
    assert st.reap(10.0) == ["a"]
    _beat(st, "a", 7.0, 45.0)
    assert _record(st)[ERR] == 45.0


def test_a_learner_restarted_from_its_checkpoint_keeps_the_totals():
    """The totals are in the coordinator's checkpoint: a server that lived on through the
    learner's restart goes on from its counts, one that restarted meanwhile adds to them,
    and one that left before the checkpoint is still counted."""
    st = _state()
    _beat(st, "a", 1.0, 40.0)
    _beat(st, "b", 2.0, 10.0)
    _beat(st, "c", 4.0, 3.0)
    st.leave("c")
    saved = json.loads(json.dumps(st.state_dict()))  # as the checkpoint stores it
    restarted = _state()
    restarted.load_state_dict(saved)
    before = _record(restarted)  # no server has registered with the new learner yet
    assert before[ERR] == 53.0 and before["rollout/servers_reporting"] == 0
    _beat(restarted, "a", 1.0, 42.0)  # lived on
    _beat(restarted, "b", 5.0, 1.0)  # restarted while the learner was down
    assert _record(restarted)[ERR] == 42.0 + 10.0 + 1.0 + 3.0


def test_a_server_without_an_incarnation_restarted_when_a_count_fell():
    totals = ServerTotals()
    totals.observe("a", {ERR: 5.0, TOK: 50.0})
    totals.observe("a", {ERR: 6.0})  # a heartbeat cut short: tokens where they were
    assert totals.totals()[TOK] == 50.0 and totals.totals()[ERR] == 6.0
    totals.observe("a", {ERR: 1.0, TOK: 10.0})  # fell: another process
    assert (totals.totals()[ERR], totals.totals()[TOK]) == (7.0, 60.0)


def test_each_server_process_draws_its_own_incarnation():
    from rollout_servers.server_stats import ServerStats

    drawn = {ServerStats(tok=None).metrics[INCARNATION] for _ in range(20)}  # type: ignore[arg-type]
    assert len(drawn) == 20


def test_a_cut_heartbeat_keeps_the_servers_own_counters():
    """A heartbeat past its 1024 keys was cut by name, and the agents' counters (named as
    they arise, ``rollout/agent/...``) sort before ``rollout/tokens``: the core counters and
    the incarnation were the ones left out. Those named as they arise are cut now."""
    from asyncrl.control.client import CoordinatorClient

    client = CoordinatorClient.__new__(CoordinatorClient)
    client.server_id, client._metrics_cut_said = "a", False
    client.metrics = {f"rollout/agent/tool_errors/t{i:04d}": 1.0 for i in range(1100)}
    client.metrics |= {ERR: 3.0, TOK: 30.0, INCARNATION: 9.0}
    sent = client._heartbeat_metrics()
    assert len(sent) == m.HEARTBEAT_METRICS_MAX
    assert (sent[ERR], sent[TOK], sent[INCARNATION]) == (3.0, 30.0, 9.0)


def test_the_step_record_carries_the_run_totals(tmp_path, arithmetic_data):
    """Rank 0's step record, written by its control plane: the counts of a server that
    left are still in it."""
    from asyncrl.config import run_dir
    from asyncrl.control.client import CoordinatorClient
    from asyncrl.metrics import read_metrics
    from tests.standins.rank_zero import validating_rank_zero

    with validating_rank_zero(tmp_path, arithmetic_data) as rig:
        coordinator = rig.rank0.coordinator
        client = CoordinatorClient(
            coordinator.tasks_addr, coordinator.control_addr, "a", engine_world_size=0
        )
        try:
            client.register(wait_s=10.0)
            client.metrics = {ERR: 40.0, TOK: 4000.0, INCARNATION: 1.0}
            client.heartbeat(wait_s=10.0)
            assert client.leave("done", timeout_s=10.0)
        finally:
            client.close()
        assert coordinator.servers() == {}
        rig.rank0.log_step(1, {"loss/total": 0.5}, 0)
    [record] = [r for r in read_metrics(run_dir(rig.cfg)) if r["step"] == 1]
    assert record[ERR] == 40.0 and record["rollout/servers_reporting"] == 0
