"""Ending a run: every role (the buffer service process, stand-in rollout processes) exits 0
within a few seconds of the coordinator's shutdown, whoever asks for it; a stand-in whose
coordinator vanished gives up with its own exit code instead of hanging; a real rollout
server stopped while its engine starts exits 0 and leaves no engine process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.control import CoordinatorClient
from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import config_endpoint
from asyncrl.sandbox.proc_table import scan
from asyncrl.tasks import make_row
from buffer.service import BufferService
from tests.helpers import wait_until
from tests.standins import rollout
from tests.standins.learner import StandInLearner, loopback_config, spawn_buffer
from tests.standins.rollout import read_journal

BASE = [
    "control.heartbeat_s=0.2",
    "control.dead_after_s=2.0",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "staleness.max_policy_lag=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "sync.timeout_s=15",
    "launch.start_timeout_s=30",
]
# What these tests check is that every role exits by itself once told (no role waits for
# a timeout): on a quiet machine each exits within 1-2 s. The bound leaves room for a loaded
# 2-core machine; a role that waited for one of its timeouts instead (30 s here) still fails.
EXIT_WITHIN_S = 12.0
ROWS = [make_row("arithmetic", f"{i}+3=", str(i + 3), split="train", index=i) for i in range(40)]


def _acks(journal: Path) -> int:
    if not journal.exists():
        return 0
    return sum(e["event"] == "ack" for e in read_journal(str(journal)))


@pytest.fixture
def procs():
    """Processes a test started; any still running at the end is killed."""
    started: list = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _standin(procs, tmp_path: Path, config: Path, server_id: str, **kwargs):
    journal = tmp_path / f"{server_id}.jsonl"
    log = tmp_path / f"{server_id}.log"
    proc = rollout.spawn(config, server_id, journal=journal, log_path=log, **kwargs)
    procs.append(proc)
    return proc, journal


def _exit_times(named: dict, start: float) -> dict[str, tuple[int, float]]:
    out = {}
    for name, proc in named.items():
        code = proc.wait(EXIT_WITHIN_S * 3)
        out[name] = (code, time.monotonic() - start)
    return out


@pytest.mark.timeout(90)
def test_every_role_exits_zero_after_the_coordinators_shutdown(tmp_path, procs):
    cfg, config = loopback_config(tmp_path, [*BASE, "staleness.max_policy_lag=10"])
    buffer = spawn_buffer(config, tmp_path / "buffer.log")
    procs.append(buffer)
    with BufferClient(config_endpoint(cfg.endpoints, "batches")) as client:
        client.hello(wait_s=30)  # the buffer process is up
    learner = StandInLearner(cfg, train_rows=ROWS, val_rows=[]).start()
    try:
        a, ja = _standin(procs, tmp_path, config, "a", weights=True)
        # b is slow, so the budget still has room when a (importing torch) starts asking.
        b, jb = _standin(procs, tmp_path, config, "b", task_delay_s=0.2)
        wait_until(lambda: len(learner.coordinator.servers()) == 2, "two servers", 40)
        result = learner.push()  # a holds a live sync group when the run ends
        assert result.ok == ["a"]
        wait_until(lambda: _acks(ja) and _acks(jb), "both servers to push groups", 40)

        start = time.monotonic()
        assert learner.shutdown("training done", wait_s=EXIT_WITHIN_S)
        assert not learner.coordinator.running
        times = _exit_times({"buffer": buffer, "a": a, "b": b}, start)
    finally:
        learner.close()
    print("exit code and seconds after the shutdown call:", times)
    assert {name: code for name, (code, _) in times.items()} == {"buffer": 0, "a": 0, "b": 0}
    assert max(t for _, t in times.values()) < EXIT_WITHIN_S, times
    for journal in (ja, jb):
        assert read_journal(str(journal))[-1] == {**read_journal(str(journal))[-1], "code": 0}


@pytest.mark.timeout(60)
def test_a_peer_can_ask_for_the_shutdown(tmp_path, procs):
    cfg, config = loopback_config(tmp_path, BASE)
    with BufferService.from_config(cfg) as service:
        learner = StandInLearner(cfg, train_rows=ROWS, val_rows=[]).start()
        try:
            proc, _ = _standin(procs, tmp_path, config, "s0")
            wait_until(lambda: learner.coordinator.servers(), "the server", 40)
            with CoordinatorClient.from_config(cfg, "operator", engine_world_size=0) as op:
                op.request_shutdown("operator says stop")
            start = time.monotonic()
            assert learner.coordinator.shutdown_requested.wait(5)
            assert proc.wait(EXIT_WITHIN_S) == 0
            assert service.wait(EXIT_WITHIN_S)  # the buffer was told too
            wait_until(lambda: not learner.coordinator.running, "the coordinator to stop", 5)
            assert time.monotonic() - start < EXIT_WITHIN_S
        finally:
            learner.close()


@pytest.mark.timeout(60)
def test_a_stopped_server_leaves_and_its_tasks_are_redealt_at_once(tmp_path, procs):
    cfg, config = loopback_config(tmp_path, [*BASE, "control.dead_after_s=30"])
    with BufferService.from_config(cfg):
        learner = StandInLearner(cfg, train_rows=ROWS, val_rows=[]).start()
        coord = learner.coordinator
        try:
            proc, journal = _standin(procs, tmp_path, config, "s0", hold_after=2)
            wait_until(
                lambda: any(e["event"] == "hold" for e in read_journal(str(journal))), "hold", 40
            )
            held = [e for e in read_journal(str(journal)) if e["event"] == "hold"][0]["task_ids"]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(EXIT_WITHIN_S) == 0
            # Long before dead_after_s: it said it leaves.
            assert coord.servers() == {}
            taken_back = coord.metrics()
            assert taken_back["coordinator/tasks/requeued/left"] == len(held)
            assert taken_back["coordinator/tasks/redeal_queue"] == len(held)
        finally:
            learner.close()


@pytest.mark.timeout(60)
def test_a_server_whose_coordinator_vanished_gives_up(tmp_path, procs):
    cfg, config = loopback_config(tmp_path, [*BASE, "launch.start_timeout_s=2"])
    with BufferService.from_config(cfg):
        learner = StandInLearner(cfg, train_rows=ROWS, val_rows=[]).start()
        proc, _ = _standin(procs, tmp_path, config, "s0")
        wait_until(lambda: learner.coordinator.servers(), "the server", 40)
        learner.close()  # the learner crashed: nobody answers any more
        start = time.monotonic()
        assert proc.wait(20) == 3
        # It gives up after launch.start_timeout_s (2 s) without an answer; the margin is
        # for a loaded machine (its heartbeat timeouts are 30 s, far beyond it).
        assert time.monotonic() - start < 2 + 10


def _session(sid: int) -> list[int]:
    """Live processes of the session ``sid``."""
    procs = scan()
    return [pid for pid, p in procs.items() if p.sid == sid and p.state != "Z"]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


@pytest.mark.timeout(600)  # building the tiny model, when no test before needed it
@pytest.mark.slow  # starts a vLLM engine
def test_a_rollout_server_stopped_while_starting_exits_0_and_takes_its_engine(tmp_path, tiny_model):
    """SIGTERM while vLLM starts (a blocking call, before the server can leave): the real
    server kills the engine processes started so far and exits 0, so a supervisor does not
    restart it and nothing of it is left."""
    _, config = loopback_config(tmp_path, [*BASE, f"model.path={tiny_model}"])
    log = open(tmp_path / "s0.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_servers.main", str(config), "--server-id", "s0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # vLLM's engine core process (spawned by multiprocessing) is starting.
        wait_until(
            lambda: (
                proc.poll() is not None
                or any(
                    b"spawn_main" in _cmdline(pid) for pid in _session(proc.pid) if pid != proc.pid
                )
            ),
            "the engine core to start",
            120,
        )
        assert proc.poll() is None, (tmp_path / "s0.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(EXIT_WITHIN_S) == 0, (tmp_path / "s0.log").read_text()[-3000:]
        wait_until(lambda: not _session(proc.pid), "the engine processes to go", EXIT_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
