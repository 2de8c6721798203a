"""A validation round against a buffer restart, over real sockets: rank 0's control plane
(its coordinator serving in threads), the buffer service and a stand-in rollout server that
registers, takes tasks and pushes fixed groups (``tests/standins/rollout.py``)."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import run_dir
from asyncrl.control import loop as control_loop
from asyncrl.metrics import read_metrics
from tests.helpers import wait_until
from tests.standins.rank_zero import RankZeroRig, validating_rank_zero
from tests.standins.rollout import StandInRollout


class LateReports:
    """The coordinator's buffer client with the buffer's "validation group scored" reports
    held back: they reach the coordinator late, as when the buffer dies right after the
    learner read a round's scores."""

    def __init__(self, client) -> None:
        self.client = client

    def drain(self):
        return msgspec.structs.replace(self.client.drain(), validated=[])

    def inventory(self, *args):
        return msgspec.structs.replace(self.client.inventory(*args), validated=[])


@pytest.mark.timeout(120)
def test_a_round_the_learner_reported_is_not_dealt_again_after_the_buffer_restarts(
    tmp_path: Path, arithmetic_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The learner reads a validation round's scores and reports it; the buffer then dies
    before its own report of those groups reached the coordinator. The new buffer does not
    hold them, but the round is complete: none of its groups may be dealt again (each would
    be generated for nothing and counted "in flight" to the end of the run). Before the
    mend, every group of the round came back as lost and was dealt again."""
    real_poll = control_loop._poll_once
    monkeypatch.setattr(
        control_loop, "_poll_once", lambda client, *a: real_poll(LateReports(client), *a)
    )
    with validating_rank_zero(tmp_path, arithmetic_data) as rig:
        server = StandInRollout(rig.cfg, "s0")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            _read_the_round_then_restart_the_buffer(rig, server, thread)
        finally:
            server.stop.set()


def _read_the_round_then_restart_the_buffer(
    rig: RankZeroRig, server: StandInRollout, thread: threading.Thread
) -> None:
    rank0 = rig.rank0
    coordinator = rank0.coordinator

    def reported() -> bool:
        rank0.after_step(0)  # the end of a step: polls the round's scores
        return not rank0.validation.pending(coordinator.validation_progress())

    wait_until(reported, "the round's scores at the learner", 60.0, every_s=0.2)
    groups = coordinator.validation_progress().round_groups
    assert groups > 0
    server.stop.set()  # nothing new is generated from here on
    thread.join(timeout=30)
    trained_lost_before = coordinator.metrics().get("coordinator/tasks/requeued/lost", 0.0)

    rig.buffer.stop()  # the buffer dies with the round's groups and some training groups
    rig.restart_buffer()
    # The coordinator meets the new buffer, settles, takes its inventory: the training
    # groups acknowledged to the old one are dealt again (proof that it reconciled: it
    # requeues every lost group under the coordinator's lock, read by metrics() too).
    wait_until(
        lambda: (
            coordinator.metrics().get("coordinator/tasks/requeued/lost", 0.0) > trained_lost_before
        ),
        "the coordinator's reconciliation with the new buffer",
        30.0,
        every_s=0.2,
        details=coordinator.accounting,
    )
    acc = coordinator.accounting()
    assert acc["accounting/val/dealt"] == groups
    assert acc["accounting/val/scored"] == groups, acc
    assert acc["accounting/val/in_flight"] == 0, acc


@pytest.mark.timeout(120)
def test_scores_the_coordinator_saw_but_the_learner_never_read_are_scored_again(
    tmp_path: Path, arithmetic_data: Path
) -> None:
    """Found by a review: the coordinator counts a validation group scored when it drains
    the buffer's report; the learner reads the round's sums later, between steps. A buffer
    that died in between took those sums with it, the coordinator never dealt them again,
    and the round was never reported (the run's end waited launch.start_timeout_s for it)."""
    with validating_rank_zero(tmp_path, arithmetic_data) as rig:
        rank0, coordinator = rig.rank0, rig.rank0.coordinator
        server = StandInRollout(rig.cfg, "s0")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            groups = coordinator.validation_progress().round_groups
            wait_until(  # every group scored and drained; the learner has read none
                lambda: coordinator.accounting()["accounting/val/scored"] == groups,
                "the coordinator's count of the round's scored groups",
                60.0,
                every_s=0.2,
                details=coordinator.accounting,
            )
            rig.buffer.stop()  # the buffer dies with the round's sums
            rig.restart_buffer()

            def reported() -> bool:
                rank0.after_step(0)
                return not rank0.validation.pending(coordinator.validation_progress())

            wait_until(reported, "the round reported from groups scored again", 60.0, every_s=0.2)
        finally:
            server.stop.set()
    assert coordinator.metrics()["coordinator/tasks/requeued/lost"] >= groups
    (record,) = [r for r in read_metrics(run_dir(rig.cfg)) if "val/score" in r]
    assert record["val/responses"] == groups * rig.cfg.rollout.val_kwargs.n
    # The versions its responses came from, as the buffer read them (no push meanwhile).
    assert (record["val/version_min"], record["val/version_max"]) == (0, 0)


@pytest.mark.timeout(120)
def test_a_round_with_a_prompt_given_up_is_reported_without_it(
    tmp_path: Path, arithmetic_data: Path
) -> None:
    """Found by a review: a validation prompt that fails every time (a malformed row; too
    long under data.truncation=error, now refused at start) is given up after
    control.task_retries, and its round waited for it for good: no validation score for
    the rest of the run."""
    with validating_rank_zero(tmp_path, arithmetic_data, ["control.task_retries=1"]) as rig:
        rank0, coordinator = rig.rank0, rig.rank0.coordinator
        server = StandInRollout(rig.cfg, "s0", fail_val_rows=(1,))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:

            def reported() -> bool:
                rank0.after_step(0)
                return not rank0.validation.pending(coordinator.validation_progress())

            wait_until(reported, "the round reported without its failing prompt", 60.0)
        finally:
            server.stop.set()
    groups = coordinator.validation_progress().round_groups
    (record,) = [r for r in read_metrics(run_dir(rig.cfg)) if "val/score" in r]
    assert record["val/groups_given_up"] == 1
    assert record["val/responses"] == (groups - 1) * rig.cfg.rollout.val_kwargs.n
    assert coordinator.accounting()["accounting/val/given_up"] == 1


@pytest.mark.timeout(120)
def test_the_final_round_is_waited_for_while_its_groups_come_in(
    tmp_path: Path, arithmetic_data: Path
) -> None:
    """Found by a review: the run's ending waited ``launch.start_timeout_s`` for its last
    validation round in all, however fast its groups came in: a round of long answers
    (val_kwargs.n of 32, a large model) lost the run's headline score, and ``complete.json``
    kept a rerun from measuring it. The wait is now bounded without progress."""
    overrides = ["launch.start_timeout_s=2"]
    with validating_rank_zero(tmp_path, arithmetic_data, overrides) as rig:
        rank0, coordinator = rig.rank0, rig.rank0.coordinator
        groups = coordinator.validation_progress().round_groups
        assert groups * 0.4 > 3 * 2  # the round outlasts the wait three times over
        server = StandInRollout(rig.cfg, "s0", task_delay_s=0.4)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            rank0.finish(0, validate=False)
        finally:
            server.stop.set()
    (record,) = [r for r in read_metrics(run_dir(rig.cfg)) if "val/score" in r]
    assert record["val/responses"] == groups * rig.cfg.rollout.val_kwargs.n
