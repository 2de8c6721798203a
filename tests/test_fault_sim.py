"""The fault simulation of the control plane (benchmarks/fault_model.py and its parts).

Three kinds of checks:

- a few hundred seeded schedules (kills, restarts, loss, duplication, delay, reordering)
  keep every invariant of benchmarks/fault_checks.py;
- one seed is one schedule: a run replays exactly, shrunk or not;
- the harness is sensitive: with one recovery fix reverted (the fixed method patched back to
  its old behaviour), some seed of a small range violates an invariant. Each mutation test
  names the defect whose fix it reverts (F1, F1b, F2, F4, F5a, F5b, the three found by
  this simulation: catch-ups after a fresh start, a fresh start's replay, the ack audit,
  and one found by a sweep of it: a slot whose reply was lost).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from asyncrl.control.ledger import TaskLedger
from asyncrl.control.task_states import DONE, EXTERNAL, QUEUED, external_task
from asyncrl.control.versions import Versions
from benchmarks import fault_api, fault_learner
from benchmarks.fault_model import Outcome, run
from buffer.core import ReplayBuffer

pytestmark = pytest.mark.timeout(300)

SEEDS = range(300)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    """The classes under test log every fault they handle: thousands per sweep."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def first_failure(seeds: range) -> Outcome | None:
    for seed in seeds:
        out = run(seed)
        if out.failed:
            return out
    return None


def test_a_few_hundred_schedules_keep_every_invariant() -> None:
    failures = {}
    skipping = 0
    for seed in SEEDS:
        out = run(seed)
        skipping += out.skipped > 0
        if out.failed:
            failures[seed] = [f"{v.invariant}: {v.detail}" for v in out.violations[:2]]
    assert not failures, failures
    # Prompt skipping is drawn in about one schedule of seven (with the filter): the faults
    # must meet it, with rows coming back within a run, not only in its own tests.
    assert skipping >= 20, f"only {skipping} of {len(SEEDS)} schedules passed over a prompt"


def test_a_version_raised_during_a_push_still_moves_the_window() -> None:
    """Found by this simulation: finish_sync skipped the consumption when a registration
    raised the version during the round (the window stayed shut at max_policy_lag 0)."""
    out = run(645)
    assert not out.failed, out.violations


def test_a_fresh_learner_gets_batches_from_a_buffer_that_saw_higher_versions() -> None:
    """Found by this simulation: a learner started without a checkpoint numbered its
    versions below what the surviving buffer measured lag against: every group was stale."""
    out = run(388)
    assert not out.failed, out.violations


def test_one_seed_is_one_schedule() -> None:
    a, b = run(7), run(7)
    assert (a.events, a.virtual_s, a.violations) == (b.events, b.virtual_s, b.violations)
    kept = list(range(0, 200, 3))
    assert run(7, kept).events == run(7, kept).events


# ---------------------------------------------------------------------- mutation tests
def test_reverting_f1_fresh_lineages_reuses_task_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """F1: a coordinator started without a checkpoint dealt train/0/0... again, which a
    surviving buffer had seen for other work."""
    monkeypatch.setattr(fault_api, "LINEAGE", False)  # every source deals plain ids again
    out = first_failure(range(10))
    assert out is not None and "id_reuse" in out.invariants()


def test_reverting_f1b_batch_sessions_confuses_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """F1b: a hello's acked_through was applied to another buffer session's batch ids."""
    restart = ReplayBuffer.restart

    def old(self: ReplayBuffer, acked_through: Any = None, consumer: Any = None, session="", **kw):
        # The session is not looked at: every acked_through taken as this session's.
        return restart(self, acked_through, consumer, session=self.session, **kw)

    monkeypatch.setattr(ReplayBuffer, "restart", old)
    out = _first_with(range(70, 90), "batch_confusion")
    assert out is not None


def test_reverting_f2_deals_a_slot_over_a_live_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """F2: deal_external built ext/<serial+1> without looking at the entries, and a restored
    serial met slots dealt after the checkpoint: the entry was overwritten."""

    def old(self: TaskLedger, server_id: str, now: float = 0.0) -> Any:
        if not self.budget.free(self.committed):
            return None, "budget"
        self.external_serial += 1
        tid = f"{EXTERNAL}{self.external_serial}"
        self.track(tid, QUEUED, external_task(tid, self.budget.version))
        self.redeal.append(tid)
        return self._hand(tid, server_id, now), ""

    monkeypatch.setattr(TaskLedger, "deal_external", old)
    monkeypatch.setattr(fault_api, "LEDGER_SESSION", False)
    out = _first_with(range(20), "tally")
    assert out is not None


def test_reverting_f4_adopts_a_version_nobody_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """F4: adopt() made current any version up to the replay's count, which included a
    batch the previous life never trained."""

    def old(self: Versions, version: int) -> bool:
        replay = self.recovery.replay_through
        if replay is None or not self.version < version <= replay:
            return False
        self.ledger.budget.consume(self.ledger.tally["train"][DONE])
        self.ledger.budget.advance(version)
        return True

    monkeypatch.setattr(Versions, "adopt", old)
    out = _first_with(range(50, 70), "adopt_unheld")
    assert out is not None


def test_reverting_f5_resends_loses_late_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """F5a: a batch whose reply came after the learner stopped waiting was never sent
    again: released, never trained."""
    monkeypatch.setattr(fault_api, "RESEND", False)
    out = _first_with(range(10, 30), "lost")
    assert out is not None


def test_reverting_f5_cursors_loses_drop_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """F5b: the buffer's drop and validation reports were drained as they were answered, so
    a reply that missed the poll's timeout lost them for good."""

    taken: dict[int, tuple[int, int]] = {}  # buffer -> what its reader took so far

    def drained(self: ReplayBuffer, drops_from: int, validated_from: int) -> Any:
        _, drops, validated = self.inventory()  # the whole logs
        at = taken.get(id(self), (0, 0))
        taken[id(self)] = (len(drops), len(validated))
        return drops[at[0] :], validated[at[1] :]

    monkeypatch.setattr(ReplayBuffer, "reports_since", drained)
    out = _first_with(range(15, 35), "lost")
    assert out is not None


def _first_with(seeds: range, invariant: str) -> Outcome | None:
    for seed in seeds:
        out = run(seed)
        if invariant in out.invariants():
            return out
    return None


def test_reverting_fresh_resume_leaves_servers_without_catchups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A learner started without a checkpoint offered no weights to catch-ups before its
    first push: servers that outlived the previous learner were refused tasks for good."""
    monkeypatch.setattr(fault_learner, "RESUME_FRESH", False)
    assert _first_with(range(10, 50), "liveness") is not None


def test_reverting_fresh_hello_trains_stale_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner started without a checkpoint was redelivered the previous life's batches
    as a replay, with no lag filter."""
    monkeypatch.setattr(fault_api, "RESUMED", False)
    # Seeds 86 and 89 break it (26 too, before a failed catch-up's back-off stopped
    # falling on a server restarted meanwhile, which moved the schedules).
    assert _first_with(range(20, 100), "lag") is not None


def test_reverting_the_audit_leaves_late_acks_charged(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ack that reached the coordinator after it met a restarted buffer, for a group
    that died with the old one, stayed charged for good."""
    monkeypatch.setattr(fault_api, "AUDIT", False)
    assert _first_with(range(200, 220), "budget_leak") is not None


def test_a_late_copy_after_a_buffer_restart_is_not_trained_again() -> None:
    """Found by the simulation: a server cut off with a pushed group is declared dead, its
    task is dealt again and trained from the first buffer; that buffer restarts; the
    partition heals and the stale copy reaches the new buffer, which never saw the id. The
    learner leaves it out of the batch (its weights trained it already)."""
    out = run(3633)
    assert "trained_twice" not in out.invariants(), out.violations


def test_a_learner_killed_mid_push_resumes_above_the_version_the_buffer_saw() -> None:
    """Found by the simulation: the previous life asked for a batch at the version it was
    pushing and died before any server had it; the restored learner's replay stops below
    that version, and at policy lag 0 the buffer dropped every new group as stale."""
    out = run(11730)
    assert "liveness" not in out.invariants(), out.violations


# Found by a sweep of 4000 of the simulation's draws with the give-back reverted; the
# control plane's rules shape each draw's schedule, so a change to them moves the seeds
# (944 and 3158 until overflow drops were dealt again and lost sync members restarted a
# round): sweep again when this test says so.
SLOT_SEEDS = (1187, 1839, 3744)


def test_a_slot_whose_reply_was_lost_is_given_back() -> None:
    """Found by a sweep of the simulation: a slot request whose reply was lost and that the
    server never repeated (no group opened after) held its slot to the end of the run;
    external slots are not reclaimed by the task timeout. The server now asks once more
    under its id and gives back what it gets (``give_back_unanswered_slots``)."""
    for seed in SLOT_SEEDS:
        out = run(seed)
        assert "budget_leak" not in out.invariants(), (seed, out.violations)


def test_reverting_the_slot_give_back_leaves_the_slot_charged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks.fault_server import Server

    monkeypatch.setattr(Server, "_give_back_slot", lambda self, now: None)
    leaked = [seed for seed in SLOT_SEEDS if "budget_leak" in run(seed).invariants()]
    assert leaked == list(SLOT_SEEDS)


def test_the_benchmark_exits_1_when_it_finds_violations(monkeypatch, tmp_path, capsys) -> None:
    """The fault simulation's command exited 0 with 62 violations in its last line: a
    script or CI step running it read success."""
    from benchmarks import fault_sim

    monkeypatch.setattr(fault_api, "LINEAGE", False)  # F1 reverted, as above
    argv = ["--schedules", "10", "--workers", "1", "--out", str(tmp_path)]
    assert fault_sim.main(argv) == 1
    assert "violations by invariant: {'id_reuse'" in capsys.readouterr().out
