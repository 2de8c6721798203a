"""Starting stand-in processes and buffer services for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def standin_env() -> dict[str, str]:
    """This environment with the repository root on ``PYTHONPATH`` (for ``tests.standins``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start_standin(module: str, *args: str) -> subprocess.Popen:
    """``python -m tests.standins.<module> args`` with its stdout piped (one JSON object a
    line)."""
    return subprocess.Popen(
        [sys.executable, "-m", f"tests.standins.{module}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=standin_env(),
    )


def finish(proc: subprocess.Popen, timeout: float = 60) -> list[dict[str, Any]]:
    """Wait for a stand-in, fail with its stderr if it failed; its JSON lines."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"stand-in timed out; stderr:\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"stand-in exited {proc.returncode}:\n{err[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def read_lines(proc: subprocess.Popen, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    """Read ``n`` JSON lines from a running stand-in (which keeps running)."""
    deadline = time.monotonic() + timeout
    lines: list[dict[str, Any]] = []
    while len(lines) < n:
        assert time.monotonic() < deadline, f"got {len(lines)} of {n} lines"
        line = proc.stdout.readline()
        assert line, f"stand-in ended early: {proc.stderr.read()[-3000:]}"
        lines.append(json.loads(line))
    return lines


def spec_file(tmp: Path, messages: list[list[dict[str, Any]]], name: str = "spec.json") -> str:
    """Write a producer spec: a list of messages, each a list of trajectory specs."""
    path = tmp / name
    path.write_text(json.dumps({"messages": messages}))
    return str(path)


def group_spec(task_id: str, size: int, **kw: Any) -> list[dict[str, Any]]:
    """The trajectory specs of a whole group (one message)."""
    return [{"task_id": task_id, "index": i, "size": size, **kw} for i in range(size)]
