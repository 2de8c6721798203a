"""A role whose restart cannot start its process (its command is gone) is restarted and
given up on as after any failure, in one line; the launcher neither dies with a traceback
nor leaves the other roles unwatched. Real processes, no vLLM."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from asyncrl.launch import supervise
from asyncrl.launch.supervise import START_FAILED, QuietView, RestartPolicy, Role, Supervisor

# An executable that deletes itself and fails: its restarts find no command.
VANISHING = """#!/bin/sh
rm -f "$0"
exit 1
"""
LEARNER = "import time; time.sleep(60)"  # still running when the run is given up


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "launch.jsonl").read_text().splitlines()]


@pytest.mark.timeout(60)
def test_a_restart_whose_command_is_gone_is_counted_and_given_up_on(tmp_path, monkeypatch):
    monkeypatch.setattr(supervise, "POLL_S", 0.05)
    monkeypatch.setattr(supervise, "STOP_GRACE_S", 2.0)
    (tmp_path / "logs").mkdir()
    buffer = tmp_path / "buffer.sh"
    buffer.write_text(VANISHING)
    buffer.chmod(0o755)
    roles = [Role("buffer", [str(buffer)]), Role("learner", [sys.executable, "-c", LEARNER])]
    sup = Supervisor(roles, tmp_path, RestartPolicy(max_restarts=2, backoff_s=0.1))
    try:
        sup.start_all()
        start = time.monotonic()
        code = sup.run(QuietView())
        took = time.monotonic() - start
    finally:
        sup.close()
    assert code == START_FAILED
    events = _events(tmp_path)
    failed = [e for e in events if e["event"] == "start_failed"]
    assert [e["role"] for e in failed] == ["buffer"] * 2  # both restarts
    assert "No such file" in failed[0]["error"]
    assert [e["role"] for e in events if e["event"] == "gave_up"] == ["buffer"]
    assert roles[1].proc is None or roles[1].proc.poll() is not None  # the learner stopped
    assert took < 30.0
