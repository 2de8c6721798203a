"""The launcher's announcements to its watchdog (:func:`tell_watchdog`) never block the
supervisor loop, on a real watchdog stopped with SIGSTOP whose pipe fills: descendant
announcements are dropped with one warning and counted; role announcements wait and reach
the watchdog once it reads again (it then kills the announced role's session)."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from asyncrl.launch.process_tree import start_watchdog, tell_watchdog
from tests.helpers import wait_until

NO_PID = 2**22 + 1  # above the kernel's pid_max limit (2**22): never a process
LINE_BYTES = len(f"={NO_PID} 000000\n")  # 16: whole lines tile the pipe's 4096-byte pages
NOT_READING = "is not reading its pipe"
READS_AGAIN = "reads its pipe again"


@dataclass
class Watchdog:
    proc: subprocess.Popen
    fd: int  # the write end of its pipe
    closed: bool = False

    def close(self) -> None:
        """What the launcher's exit does: the watchdog reads EOF and acts."""
        if not self.closed:
            self.closed = True
            os.close(self.fd)


@pytest.fixture
def stopped_watchdog(caplog) -> Iterator[Watchdog]:
    """A real watchdog (of a run no process belongs to), stopped as by SIGSTOP; killed and
    its pipe closed after the test whatever happened."""
    caplog.set_level(logging.WARNING, logger="asyncrl.launch")
    wd = Watchdog(*start_watchdog(f"test-watchdog-{os.getpid()}-{time.monotonic_ns()} ", 0.2))
    os.kill(wd.proc.pid, signal.SIGSTOP)
    try:
        yield wd
    finally:
        if wd.proc.poll() is None:
            wd.proc.kill()  # also frees a write blocked on its pipe (EPIPE, suppressed)
            wd.proc.wait(10)
        wd.close()


def _fill(fd: int, count: int) -> None:
    """Announce ``count`` descendants (none real) in a thread; fail if it blocks."""
    teller = threading.Thread(
        target=lambda: [tell_watchdog(fd, f"={NO_PID} {i:06d}") for i in range(count)],
        daemon=True,
    )
    teller.start()
    teller.join(10)  # a few thousand non-blocking writes take milliseconds
    assert not teller.is_alive(), "tell_watchdog blocked on the stopped watchdog's full pipe"


def _lines_to_fill(fd: int) -> int:
    """Four pipes' worth of announcements: far past full whatever the pipe's size."""
    return 4 * fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // LINE_BYTES


def _messages(caplog, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if part in r.getMessage()]


def _told_again(fd: int, caplog) -> bool:
    """Announce a harmless role departure (queued, not dropped, while the pipe is full);
    true once the watchdog read the backlog and the recovery line was logged."""
    tell_watchdog(fd, f"-{NO_PID}")
    return bool(_messages(caplog, READS_AGAIN))


def test_a_stopped_watchdog_costs_one_warning_not_a_frozen_launcher(stopped_watchdog, caplog):
    wd, fd = stopped_watchdog, stopped_watchdog.fd
    count = _lines_to_fill(fd)
    _fill(fd, count)
    (warning,) = _messages(caplog, NOT_READING)  # one line, not one per dropped line
    assert f"pid {wd.proc.pid}" in warning and "cannot clean up" in warning

    os.kill(wd.proc.pid, signal.SIGCONT)
    wait_until(lambda: _told_again(fd, caplog), "the watchdog to read its pipe again", 10)
    (recovered,) = _messages(caplog, READS_AGAIN)
    dropped = re.search(r"; (\d+) announcements", recovered)
    # The pipe took exactly its size in lines (atomic 16-byte writes fill every page).
    fit = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // LINE_BYTES
    assert dropped is not None and int(dropped[1]) == count - fit, (count, fit, recovered)
    wd.close()  # the launcher exits normally: the watchdog finds nothing and ends
    assert wd.proc.wait(10) == 0


def test_a_role_announced_while_the_pipe_was_full_still_reaches_the_watchdog(
    stopped_watchdog, caplog
):
    """The announcement the watchdog needs most (a role's session) is held back, not
    dropped: once the watchdog reads again and the launcher dies, that session is killed."""
    wd, fd = stopped_watchdog, stopped_watchdog.fd
    role = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )
    try:
        _fill(fd, _lines_to_fill(fd))
        assert _messages(caplog, NOT_READING)
        tell_watchdog(fd, f"+{role.pid}")  # the pipe is full: this one must wait
        os.kill(wd.proc.pid, signal.SIGCONT)
        wait_until(lambda: _told_again(fd, caplog), "the watchdog to read its pipe again", 10)
        wd.close()  # the launcher is gone: the watchdog clears the announced session
        wait_until(lambda: role.poll() is not None, "the watchdog to kill the role", 10)
        assert role.returncode == -signal.SIGKILL
        assert wd.proc.wait(10) == 0
    finally:
        if role.poll() is None:
            os.killpg(role.pid, signal.SIGKILL)
            role.wait(10)
