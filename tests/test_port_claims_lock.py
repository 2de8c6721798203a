"""The lock on the port claims (:mod:`asyncrl.launch.ports`) is waited for aloud and for a
bounded time, with a second real process holding the flock: a launch says it waits, goes
on when the lock is let go, and refuses in one line naming the lock file and its (stopped)
holder when it is not."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.launch import ports
from tests.helpers import wait_until

HOST = ["endpoints.host=127.0.0.1"]
# Takes the lock, says so, holds it until its stdin gets a line (or it is killed).
HOLD = (
    "import fcntl, sys\n"
    "f = open(sys.argv[1], 'a+')\n"
    "fcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.readline()\n"
)
WAITING = "waiting for the port-claims lock at"


@pytest.fixture
def holder(tmp_path, monkeypatch, caplog) -> Iterator[tuple[subprocess.Popen, Path]]:
    """Another launch's process holding the lock on this test's claims file."""
    caplog.set_level(logging.WARNING, logger=ports.log.name)
    path = tmp_path / "claims.json"
    monkeypatch.setattr(ports, "claims_file", lambda: path)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc, path
    finally:
        proc.kill()  # a stopped process too
        proc.wait(10)


def _waits(caplog, path: Path) -> list[str]:
    return [m for r in caplog.records if (m := r.getMessage()).startswith(f"{WAITING} {path}")]


def test_a_launch_waits_for_the_claims_lock_aloud_and_goes_on_when_it_is_let_go(
    holder, caplog, monkeypatch
):
    proc, path = holder
    monkeypatch.setattr(ports, "CLAIMS_LOCK_REPORT_S", 0.2)
    cfg = load_config(None, HOST)
    claimed: list = []
    launch = threading.Thread(target=lambda: claimed.append(ports.claim(cfg)), daemon=True)
    launch.start()
    try:
        wait_until(lambda: _waits(caplog, path), "the launch to say it waits for the lock", 10)
        assert "(held by another launch) for " in _waits(caplog, path)[0]
        assert not claimed
    finally:
        assert proc.stdin is not None
        proc.stdin.write("go\n")  # the other launch is done: it lets the lock go
        proc.stdin.flush()
        launch.join(10)
    (cfg_after,) = claimed
    mine = [getattr(cfg_after.endpoints, k) for k in ports.PORT_KEYS]
    assert json.loads(path.read_text())[str(os.getpid())] == mine


def test_a_stopped_holder_of_the_claims_lock_is_named_in_one_line_at_the_deadline(
    holder, caplog, monkeypatch
):
    """A launcher suspended with Ctrl-Z while it held the lock."""
    proc, path = holder
    monkeypatch.setattr(ports, "CLAIMS_LOCK_TIMEOUT_S", 1.5)
    monkeypatch.setattr(ports, "CLAIMS_LOCK_REPORT_S", 0.5)
    os.kill(proc.pid, signal.SIGSTOP)
    # Without a deadline the claim would block for good: the holder is killed after 10s so
    # that such a claim returns (and fails this test) rather than hang it.
    rescue = threading.Timer(10, proc.kill)
    rescue.start()
    try:
        with pytest.raises(ports.ClaimsLockTimeout) as refused:
            ports.claim(load_config(None, HOST))
    finally:
        rescue.cancel()
    line = str(refused.value)
    assert isinstance(refused.value, ConfigError)  # the launcher refuses it in one line
    assert "\n" not in line
    assert f"port-claims lock at {path} was held by pid {proc.pid} (stopped)" in line
    assert f"kill -CONT {proc.pid}" in line and f"remove {path}" in line
    # reported at 0.5s and 1s before the deadline; a loaded machine may skip one
    assert 1 <= len(_waits(caplog, path)) <= 3
