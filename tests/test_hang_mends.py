"""Four "nothing hangs" mends of a hang audit, each on real parts (rank 0's control plane
with its coordinator threads and a buffer service on 127.0.0.1, the launcher's supervisor
over a real child process):

- the learner's wait for a batch raises, naming the failure, once the coordinator's thread
  has crashed, instead of waiting for a batch that no dealt task will ever make;
- a validation poll the buffer does not answer (it restarts) is let go and asked again
  later, at the end of a step and while waiting for a batch, instead of ending the learner;
- a learner that raises (out of memory, a failed push) leaves the buffer and the servers
  up for its restart, instead of ending the run for everyone;
- the launcher's reap of a SIGKILLed role that does not die (stuck in the kernel) gives up
  after ``REAP_WAIT_S`` and says so, instead of freezing the launcher.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import run_dir
from asyncrl.control.state import ControlState
from asyncrl.launch import supervise
from asyncrl.launch.restart_policy import RestartPolicy
from asyncrl.launch.supervise import Role, Supervisor
from asyncrl.metrics import read_metrics
from asyncrl.net.ports import free_ports
from buffer.service import BufferService
from learner import control_plane
from learner.control_peer import Restored
from learner.control_plane import RankZero
from tests.helpers import alive, wait_until
from tests.standins.rank_zero import RankZeroRig, validating_rank_zero

CRASH_BOUND_S = 10.0  # a wait that outlives a crashed coordinator by this much hangs
POLL_TIMEOUT_S = 1.0  # the learner's buffer client's timeout here (10 s in a run)
REAP_BOUND_S = 1.0  # REAP_WAIT_S here (30 s in a run)
FREEZER = Path("/sys/fs/cgroup/freezer")  # cgroup v1: SIGKILL waits for a frozen task's thaw


# ------------------------------------------------------------------ rank 0 and its buffer
@pytest.fixture
def rig(tmp_path: Path, arithmetic_data: Path) -> Iterator[RankZeroRig]:
    with validating_rank_zero(tmp_path, arithmetic_data) as r:
        yield r


class PollAnswered(Exception):
    """Raised from the keepalive to end a wait once a validation poll was answered."""


# ------------------------------------------------------------------ 1. coordinator crash
@pytest.mark.timeout(60)
def test_waiting_for_a_batch_raises_once_the_coordinator_has_crashed(
    rig: RankZeroRig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator's loop dies of a defect while the learner waits for a batch: no
    task can be dealt any more, so no batch comes. The wait raises within a few polls,
    naming the failure (without the check it would wait for good: the buffer keeps
    answering "no batch yet")."""
    crash = threading.Event()
    real_reap = ControlState.reap

    def reap(state: ControlState, now: float) -> list[str]:
        # Called by the coordinator's loop every 0.1 s: a defect here ends its thread,
        # which records the error as the coordinator's failure (as any crash of it does).
        if crash.is_set():
            raise RuntimeError("injected defect in the coordinator loop")
        return real_reap(state, now)

    monkeypatch.setattr(ControlState, "reap", reap)
    # The keepalive is called on every pass of the wait (60 s apart in a run): it is how
    # this test sees that the learner is inside the wait, and how it ends one that hangs.
    monkeypatch.setattr(control_plane, "KEEPALIVE_S", 0.0)
    crashed_at: list[float] = []

    def keepalive() -> None:
        if not crashed_at:  # the learner is waiting now: crash the coordinator under it
            assert rig.rank0.coordinator.failure is None
            crash.set()
            crashed_at.append(time.monotonic())
        elif time.monotonic() - crashed_at[0] > CRASH_BOUND_S:
            raise AssertionError(
                f"still waiting for a batch {CRASH_BOUND_S:g}s after the coordinator "
                f"crashed ({rig.rank0.coordinator.failure!r})"
            )

    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as raised:
        rig.rank0.wait_batch(0, 0, keepalive=keepalive)
    waited = time.monotonic() - crashed_at[0]
    assert "the coordinator stopped (RuntimeError: injected defect" in str(raised.value)
    assert "injected defect" in repr(rig.rank0.coordinator.failure)
    assert "coordinator crashed" in caplog.text
    assert waited < CRASH_BOUND_S, waited


# ------------------------------------------------------------------ 2. silent buffer
@pytest.mark.timeout(60)
def test_a_step_goes_on_when_the_buffer_misses_a_validation_poll(
    rig: RankZeroRig, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffer restarts while a validation round is in flight: the end-of-step poll for
    its scores gets no answer. The step is logged all the same, and the next step's poll
    reaches the new buffer."""
    rank0 = rig.rank0
    answered = _answered_polls(rank0, monkeypatch)
    assert rank0.validation.pending(rank0.coordinator.validation_progress())
    rank0.buffer.timeout_s = POLL_TIMEOUT_S  # a short wait for the answer that never comes
    rig.buffer.stop()

    with caplog.at_level(logging.INFO, logger=control_plane.__name__):
        rank0.log_step(1, {"loss/total": 0.5}, 0)
        rank0.after_step(1)  # raised TimeoutError before the mend
    assert "did not answer the validation poll" in caplog.text
    assert answered == []  # the poll was indeed not answered
    logged = {record["step"] for record in read_metrics(run_dir(rig.cfg))}
    assert 1 in logged  # the step went on to its record

    restarted = rig.restart_buffer()
    rank0.log_step(2, {"loss/total": 0.4}, 0)
    rank0.after_step(2)
    assert answered == [restarted.session]  # asked again, answered
    assert rank0.validation.pending(rank0.coordinator.validation_progress())  # not lost
    assert {record["step"] for record in read_metrics(run_dir(rig.cfg))} >= {1, 2}


@pytest.mark.timeout(60)
def test_a_wait_for_a_batch_outlives_a_missed_validation_poll(
    rig: RankZeroRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffer restarts while the learner waits for a batch with a validation round in
    flight: the batch request and the validation poll both go unanswered. The wait goes on
    (it ended the learner with a TimeoutError before the mend) and, once the buffer is
    back, its next validation poll is answered."""
    rank0 = rig.rank0
    answered = _answered_polls(rank0, monkeypatch)
    rank0.buffer.timeout_s = POLL_TIMEOUT_S
    rig.buffer.stop()
    monkeypatch.setattr(control_plane, "KEEPALIVE_S", 0.0)  # see the crash test
    start = time.monotonic()
    restarted: list[BufferService] = []

    def keepalive() -> None:
        # Called after each pass's validation poll.
        if not restarted:  # the first pass, against the silent buffer: not answered
            assert answered == []
            restarted.append(rig.restart_buffer())
        elif restarted[0].session in answered:
            raise PollAnswered
        elif time.monotonic() - start > 20:
            raise AssertionError("the buffer came back, yet no validation poll reached it")

    with pytest.raises(PollAnswered):
        rank0.wait_batch(0, 0, keepalive=keepalive)


@pytest.mark.timeout(60)
def test_a_run_of_agents_only_says_where_agents_connect_while_none_holds_a_slot(
    tmp_path: Path,
    arithmetic_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run that trains only on its agents' groups (``take_tasks: false``) waits for
    good when its agent has stopped (the README's agent stopped at a server's restart).
    The wait's periodic line says that no agent holds a slot and where agents connect."""
    endpoint_only = [
        "rollout.openai_endpoint.enable=true",
        "rollout.openai_endpoint.take_tasks=false",
        "trainer.val_before_train=false",  # no server would run validation tasks
    ]
    monkeypatch.setattr(control_plane, "WAIT_LOG_S", 0.0)
    monkeypatch.setattr(control_plane, "KEEPALIVE_S", 0.0)
    passes: list[int] = []

    def keepalive() -> None:  # the first pass logs after its keepalive: end at the second
        passes.append(1)
        if len(passes) > 1:
            raise PollAnswered

    with (
        validating_rank_zero(tmp_path, arithmetic_data, endpoint_only) as r,
        caplog.at_level(logging.INFO, logger=control_plane.__name__),
        pytest.raises(PollAnswered),
    ):
        r.rank0.wait_batch(0, 0, keepalive=keepalive)
    assert "no agent holds an endpoint slot" in caplog.text, caplog.text
    assert str(run_dir(r.cfg) / "openai_endpoints") in caplog.text


def _answered_polls(rank0: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The buffer sessions that answered the learner's validation polls, as they come."""
    answered: list[str] = []
    ask = rank0.buffer.validation

    def recording(*args: Any, **kwargs: Any) -> Any:
        reply = ask(*args, **kwargs)
        answered.append(reply.session)
        return reply

    monkeypatch.setattr(rank0.buffer, "validation", recording)
    return answered


# ------------------------------------------------------------------ 3. a learner that raises
@pytest.mark.timeout(60)
def test_a_learner_that_raises_leaves_the_run_to_its_restart(rig: RankZeroRig) -> None:
    """A learner step raises (out of memory, a failed push): the launcher restarts the
    learner from its checkpoint, so the peers must stay up for it. Before the mend the
    loop's ``finally`` ended the run: the buffer and every server were told to shut down
    (they exit 0 and are never restarted), and each restarted learner then waited in vain
    for the buffer until the launcher gave up."""
    from learner.health import HealthMonitor
    from learner.loop import LearnerLoop

    class Trainer:  # the loop's view of learner.trainer.Trainer, before its first step
        rank, world_size, step, policy_version = 0, 1, 0, 0

        def full_state_for_push(self) -> dict:
            return {}

    def one_step() -> bool:
        raise RuntimeError("CUDA out of memory (injected)")

    loop = object.__new__(LearnerLoop)
    loop.cfg, loop.trainer, loop.control, loop.total = rig.cfg, Trainer(), rig.rank0, 10
    loop.stopped_by, loop._marked, loop.run_dir = None, set(), run_dir(rig.cfg)
    loop.health = HealthMonitor(rig.cfg.trainer.health)
    loop._one_step = one_step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        loop.run()
    assert not rig.rank0.coordinator.shutdown_requested.is_set()
    assert not any(t.is_alive() for t in rig.rank0.coordinator._threads)  # stopped serving
    assert rig.buffer._thread is not None and rig.buffer._thread.is_alive()
    # The next learner (the launcher's restart) finds the same buffer, and serves the
    # coordinator's endpoints again. (Its weight-sync store goes elsewhere: in a run the
    # failed process's store dies with it; here the process lives on.)
    cfg = rig.cfg.model_copy(deep=True)
    cfg.endpoints.sync_store = free_ports("127.0.0.1", 1)[0]
    again = RankZero(cfg, run_dir(cfg), Restored(None, None, None), new_run=False)
    try:
        assert again.coordinator.failure is None
        assert again.buffer.validation().session == rig.buffer.session
    finally:
        again.coordinator.stop()
        again.logger.close()
        again.buffer.close()


# ------------------------------------------------------------------ 4. bounded reap
def _sleeper(tmp_path: Path) -> tuple[Supervisor, Role]:
    """A supervisor in this process (no subreaper, no watchdog) running one role that
    sleeps for a minute, as a real child in a session of its own."""
    role = Role("rollout-0", ["sleep", "60"])
    sup = Supervisor([role], tmp_path, RestartPolicy())
    (tmp_path / "logs").mkdir()
    sup.start(role)
    return sup, role


def _reap_in_thread(sup: Supervisor, role: Role) -> tuple[threading.Thread, list[Any]]:
    """``sup.reap(role)`` in a thread, so that a reap that hangs fails the test (by the
    join's bound) instead of freezing it; the list gets its result and its duration."""
    out: list[Any] = []

    def reap() -> None:
        start = time.monotonic()
        out.append(sup.reap(role))
        out.append(time.monotonic() - start)

    thread = threading.Thread(target=reap, name="reap", daemon=True)
    thread.start()
    return thread, out


@contextlib.contextmanager
def _frozen(pid: int) -> Iterator[None]:
    """Process ``pid`` frozen in a cgroup v1 freezer of its own: a SIGKILL leaves it alive
    (in the kernel, state D) until it is thawed, as a process stuck in a driver or a
    network file system is. Thawed on exit, when a pending SIGKILL ends it."""
    group = FREEZER / f"asyncrl-test-{os.getpid()}-{pid}"
    try:
        group.mkdir()
    except OSError as e:  # mounted read-only here, say
        pytest.skip(f"cannot make a freezer cgroup: {e}")
    try:
        (group / "cgroup.procs").write_text(str(pid))
        (group / "freezer.state").write_text("FROZEN")
        wait_until(
            lambda: (group / "freezer.state").read_text().strip() == "FROZEN", "the freeze", 10
        )
        yield
    finally:
        (group / "freezer.state").write_text("THAWED")
        wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), "the thaw", 10)
        group.rmdir()


def _can_freeze() -> bool:
    """Whether this process may make freezer cgroups (v1: as root, where mounted rw)."""
    return (FREEZER / "cgroup.procs").exists() and os.access(FREEZER, os.W_OK)


def test_an_interrupted_learner_ends_the_run_without_waiting_for_rounds(rig: RankZeroRig):
    """Ctrl-C of a learner started by hand ends the run at once: it used to wait, without
    a word, up to launch.start_timeout_s (300 s) for validation rounds in flight, whose
    scores nobody would read."""
    from learner.health import HealthMonitor
    from learner.loop import LearnerLoop

    class Trainer:
        rank, world_size, step, policy_version = 0, 1, 3, 3

        def full_state_for_push(self) -> dict:
            return {}

    class Control:  # the loop's view of rank 0's control plane, recorded
        ended: list[tuple[bool, bool, bool]] = []

        def resume(self, tensors: dict) -> None:
            pass

        def version(self, current: int) -> int:
            return current

        def finish(self, step: int, validate: bool, wait_rounds=True, complete=False) -> None:
            self.ended.append((validate, wait_rounds, complete))

    def interrupted() -> bool:
        raise KeyboardInterrupt

    loop = object.__new__(LearnerLoop)
    loop.cfg, loop.trainer, loop.control, loop.total = rig.cfg, Trainer(), Control(), 10
    loop.stopped_by, loop._marked, loop.run_dir = None, set(), run_dir(rig.cfg)
    loop.health = HealthMonitor(rig.cfg.trainer.health)
    loop._one_step = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        loop.run()
    assert Control.ended == [(False, False, False)]  # no validation, no wait, not whole


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _can_freeze(), reason="needs a writable cgroup v1 freezer (root)")
def test_reaping_a_role_stuck_in_the_kernel_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A role that a SIGKILL cannot end (frozen in the kernel): the reap sends the SIGKILL,
    waits ``REAP_WAIT_S`` for the exit, then says so and goes on with the role marked
    killed, instead of waiting for good (the launcher would freeze with it)."""
    monkeypatch.setattr(supervise, "REAP_WAIT_S", REAP_BOUND_S)
    # kill_tree's own bound on SIGKILLing what survives (10 s), shortened: same behaviour.
    monkeypatch.setattr(supervise, "kill_tree", functools.partial(supervise.kill_tree, timeout_s=1))
    sup, role = _sleeper(tmp_path)
    proc = role.proc
    assert proc is not None
    try:
        with caplog.at_level(logging.ERROR, logger="asyncrl.launch"), _frozen(proc.pid):
            thread, out = _reap_in_thread(sup, role)
            thread.join(1 + REAP_BOUND_S + 10)  # kill_tree's second, the bound, slack
            assert not thread.is_alive(), "the reap of a process that survives SIGKILL hangs"
            assert alive(proc.pid)  # it survived the SIGKILL: the reap did not wait for it
        code, took = out
        assert code == -signal.SIGKILL and role.proc is None
        assert took < 1 + REAP_BOUND_S + 5, took
        assert "survived SIGKILL" in caplog.text and str(proc.pid) in caplog.text
        assert proc.wait(10) == -signal.SIGKILL  # thawed, it dies of the SIGKILL it was sent
    finally:
        proc.kill()  # a no-op once it is reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


@pytest.mark.timeout(60)
def test_reaping_a_role_the_sigkill_misses_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same bound where no freezer is at hand: the SIGKILL is withheld (the process
    goes on as one the kernel cannot end), and the reap still returns after
    ``REAP_WAIT_S`` and says so."""
    monkeypatch.setattr(supervise, "REAP_WAIT_S", REAP_BOUND_S)
    monkeypatch.setattr(supervise, "kill_tree", lambda *args, **kwargs: set())
    sup, role = _sleeper(tmp_path)
    proc = role.proc
    assert proc is not None
    try:
        with caplog.at_level(logging.ERROR, logger="asyncrl.launch"):
            thread, out = _reap_in_thread(sup, role)
            thread.join(REAP_BOUND_S + 10)
        assert not thread.is_alive(), "the reap of a process that survives SIGKILL hangs"
        code, took = out
        assert code == -signal.SIGKILL and role.proc is None
        assert took < REAP_BOUND_S + 5, took
        assert "survived SIGKILL" in caplog.text
        assert proc.poll() is None  # still running: the reap gave up on it, as it should
    finally:
        proc.kill()  # ends the sleeper (and the reap thread's wait, if it hangs)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
