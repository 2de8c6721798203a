"""What sandboxed user code (tools, scorers) may write to the caller's stdout and stderr,
and how a worker that exits while it starts is reported; with real worker processes."""

from __future__ import annotations

import os
import textwrap
import threading
import time
from pathlib import Path

import pytest

from asyncrl.rewards import RewardPool
from asyncrl.sandbox.output import JOB_OUTPUT_BYTES, OutputDrain
from asyncrl.sandbox.workers import WorkerPool
from asyncrl.tools import ToolCall, ToolPool
from tests.test_tools import entry, write_config

PRINTER = """
import os, subprocess, sys

from asyncrl.tools import BaseTool


class Printer(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        n, how = parameters["n"], parameters["how"]
        if how == "print":
            print("P" * n)
        elif how == "fd":  # below sys.stdout: what C code and os.write do
            os.write(2, b"F" * n)
        else:  # a subprocess inherits the worker's fds 1 and 2
            subprocess.run(["head", "-c", str(n), "/dev/zero"], check=True)
        return "printed", 0.0, {}
"""

EXITS = """
import sys

from asyncrl.tools import BaseTool

if "{where}" == "import":
    sys.exit("no API key set: export FOO")


class Exits(BaseTool):
    def __init__(self, config, tool_schema):
        sys.exit("SANDBOX_URL is not set")
"""

MIB = 1 << 20


def _tool_config(tmp_path: Path, name: str, source: str, class_name: str) -> Path:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return write_config(tmp_path / f"{name}.yaml", [entry(f"{name}.py:{class_name}", name)])


# ------------------------------------------------------------- 1. output is bounded


@pytest.mark.parametrize("how", ["print", "fd", "subprocess"])
def test_what_a_tool_writes_reaches_the_servers_output_only_up_to_the_cap(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """Found by a review: a tool that wrote 50 MiB to stdout put 50 MiB in the server's
    log (its workers inherited fds 1 and 2). print, os.write and a subprocess are bounded
    alike, the call still answers, and one line says how much was dropped and why."""
    config = _tool_config(tmp_path, "printer", PRINTER, "Printer")
    with ToolPool(config, num_workers=1, timeout_s=30, max_memory_mb=0) as pool:
        result = pool.call(ToolCall("printer", {"n": 4 * MIB, "how": how}))
        assert (result.text, result.error) == ("printed", None)
        again = pool.call(ToolCall("printer", {"n": 10, "how": how}))  # a fresh job budget
        assert again.error is None
    out, err = capfd.readouterr()
    assert JOB_OUTPUT_BYTES <= len(out) + len(err) <= 2 * JOB_OUTPUT_BYTES + 200
    notes = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert notes and all("JOB_OUTPUT_BYTES" in note for note in notes)
    # One line, or one per pause of over a second in the tool's writing (a loaded machine).
    dropped = sum(int(note.split("dropped ")[1].split()[0]) for note in notes)
    assert dropped >= 4 * MIB - 2 * JOB_OUTPUT_BYTES


def test_a_scorer_that_prints_is_bounded_and_its_start_up_error_still_shows(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Reward workers share the sandbox: the same cap; and what a scorer printed before it
    failed to start reaches the caller's stderr before the pool raises."""
    scorer = tmp_path / "loud.py"
    scorer.write_text(
        "def compute_score(*args, **kwargs):\n    print('S' * (4 << 20))\n    return 1.0\n"
    )
    with RewardPool(num_workers=1, custom_path=str(scorer), max_memory_mb=0) as pool:
        assert pool.score("x", "y", "z").score == 1.0
    out, _ = capfd.readouterr()
    assert JOB_OUTPUT_BYTES <= len(out) <= JOB_OUTPUT_BYTES + 2

    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('MARKER-before-the-raise', file=sys.stderr)\n1 / 0\n")
    with pytest.raises(ValueError, match="ZeroDivisionError"):
        RewardPool(num_workers=1, custom_path=str(broken), max_memory_mb=0)
    assert "MARKER-before-the-raise" in capfd.readouterr().err


def test_a_worker_passes_on_at_most_its_life_budget(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Per job and per worker life: past the life budget, one line and then nothing, so
    a log grows by a bounded amount per worker however many calls print."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    alive_read, alive_write = os.pipe()  # the worker's sentinel: readable once it "exits"
    reads = (os.fdopen(out_read, "rb", buffering=0), os.fdopen(err_read, "rb", buffering=0))
    drain = OutputDrain(reads, alive_read, "test worker", job_bytes=10, worker_bytes=25)
    for _ in range(5):
        drain.next_job()
        os.write(out_write, b"o" * 8)
        os.write(err_write, b"e" * 8)
        time.sleep(0.15)  # the thread reads each job before the next starts
    os.close(alive_write)
    drain.join(5)
    assert not any(t.name == "test worker-output" for t in threading.enumerate())
    out, err = capfd.readouterr()
    assert len(out.replace("\n", "")) + len(err.replace("\n", "")) <= 25
    notes = [r.getMessage() for r in caplog.records if r.name == "asyncrl.sandbox.output"]
    assert "WORKER_OUTPUT_BYTES" in notes[-1] and "the rest of its output is dropped" in notes[-1]
    assert len(notes) <= 3, notes
    for fd in (out_write, err_write, alive_read):
        os.close(fd)


# ------------------------------------------------------------- 2. exits during start-up


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("import", "importing tool class .*exits.py:Exits.*SystemExit\\('no API key set"),
        ("init", "constructing tool 'exits' .*SystemExit\\('SANDBOX_URL is not set'\\)"),
    ],
)
def test_a_tool_that_calls_sys_exit_while_starting_is_named(
    tmp_path: Path, where: str, expected: str
) -> None:
    """Found by a review: sys.exit() in a tool's module or __init__ was reported as "tool
    worker exited during start (exit code -9)", our own kill, not the tool or its message."""
    config = _tool_config(tmp_path, "exits", EXITS.replace("{where}", where), "Exits")
    with pytest.raises(ValueError, match=expected):
        ToolPool(config, num_workers=1, startup_timeout_s=30, max_memory_mb=0)


def test_a_scorer_that_calls_sys_exit_on_import_is_reported_with_its_message(
    tmp_path: Path,
) -> None:
    scorer = tmp_path / "exits.py"
    scorer.write_text("import sys\nsys.exit('no API key')\n")
    with pytest.raises(ValueError, match="SystemExit\\('no API key'\\)") as caught:
        RewardPool(num_workers=1, custom_path=str(scorer), max_memory_mb=0)
    assert "\n" not in str(caught.value)


def close_pipes_then_exit(code: int) -> None:
    """A setup whose worker closes its pipe to the parent, then exits a moment later (as
    an interpreter does that tears down before its exit code is known)."""
    os.closerange(3, 1 << 16)
    time.sleep(0.3)
    os._exit(code)


def test_a_worker_that_exits_while_starting_reports_its_own_exit_code() -> None:
    """wait_ready read the exit code after killing the worker, so it reported -9 (our
    SIGKILL) rather than the worker's own code."""
    with pytest.raises(ValueError, match=r"exited during start \(exit code 3\)"):
        WorkerPool(
            close_pipes_then_exit,
            (3,),
            name="TestPool",
            role="test",
            explanations={},
            num_workers=1,
            startup_timeout_s=30,
        )
