"""A validation round against a buffer restart, over real sockets: rank 0's control plane
(its coordinator serving in threads), the buffer service and a stand-in rollout server that
registers, takes tasks and pushes fixed groups (``tests/standins/rollout.py``)."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest

from asyncrl.control import loop as control_loop
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
