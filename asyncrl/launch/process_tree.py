"""Process trees of the launcher's roles: start a role so that its whole tree can be found
again, kill and reap that tree (also when the role itself got SIGKILL), and a watchdog that
clears the run's processes when the launcher itself is killed.

How a role's tree is found. Every role starts in a session of its own (its pid is its
session and process group id) and with an environment marker, ``ASYNCRL_LAUNCH="<launch
id> <role> <attempt>"``, that every descendant inherits. Its tree is every process in its
session or process group, every process that carries its marker, every descendant the
supervisor saw while the role ran (pid and start time), and every descendant of those.
Each of these alone misses something:

- vLLM's engine core (and its workers, with tensor parallelism) stays in the rollout
  server's session: multiprocessing spawns it without a new one. It outlives a server
  killed with SIGKILL (nothing in vLLM watches the server process), but its session finds
  it. Its marker does not: it renames itself (``VLLM::EngineCore``, setproctitle), which
  overwrites what ``/proc/<pid>/environ`` shows.
- torchrun starts the learner's ranks in sessions of their own (``start_new_session``);
  their marker finds them after torchrun is gone and they were re-parented.
- A process that does both is known from the supervisor's earlier looks at the tree.

The launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans of a dead role are
re-parented to it rather than to init, and it reaps them. Each role gets
``PR_SET_PDEATHSIG`` (SIGTERM) so that it stops when the launcher dies, and a watchdog in a
session of its own kills whatever of the run is left once the launcher is gone.

Linux only (``/proc``, ``prctl``), as the launcher always was (``sched_setaffinity``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.sandbox.proc_table import Proc, descendants, scan

log = logging.getLogger("asyncrl.launch")

MARKER = "ASYNCRL_LAUNCH"  # environment variable every process of a run inherits
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_libc: ctypes.CDLL | None = None


def marker_of(pid: int) -> str | None:
    """The run marker in ``pid``'s environment (as it was at exec), if it carries one."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:  # gone, or not ours
        return None
    prefix = MARKER.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def find_tree(
    procs: dict[int, Proc],
    roots: Iterable[int] = (),
    match: Callable[[str], bool] | None = None,
    known: dict[int, int] | None = None,
    extra: Iterable[int] = (),
) -> set[int]:
    """Live (not zombie) processes of one tree: the sessions and process groups of
    ``roots``, the processes whose marker ``match`` accepts, the ``known`` ones (pid: start
    time, so a reused pid is not mistaken for one), ``extra``, and every descendant of
    these. Never this process."""
    roots = set(roots)
    seeds = {p.pid for p in procs.values() if p.sid in roots or p.pgid in roots}
    if match is not None:
        seeds |= {pid for pid in procs if (m := marker_of(pid)) is not None and match(m)}
    seeds |= {
        pid for pid, start in (known or {}).items() if pid in procs and procs[pid].start == start
    }
    seeds |= {pid for pid in extra if pid in procs}
    tree = descendants(procs, seeds)
    tree.discard(os.getpid())
    return {pid for pid in tree if procs[pid].state not in ("Z", "X")}


def adopted(procs: dict[int, Proc], keep: set[int]) -> set[int]:
    """Children of this process it did not start itself (orphans re-parented to it)."""
    me = os.getpid()
    return {p.pid for p in procs.values() if p.ppid == me and p.pid not in keep}


def reap_adopted(procs: dict[int, Proc], keep: set[int]) -> None:
    """Reap adopted orphans that have exited; ``keep`` (what ``Popen`` reaps) is left alone."""
    for pid in adopted(procs, keep):
        if procs[pid].state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def kill_tree(
    roots: Iterable[int] = (),
    match: Callable[[str], bool] | None = None,
    known: dict[int, int] | None = None,
    extra: Iterable[int] = (),
    reap_keep: set[int] | None = None,
    timeout_s: float = 10.0,
) -> set[int]:
    """SIGKILL every process of the tree (see :func:`find_tree`) until none is left.
    Repeats, because a dying process may have just spawned another. With ``reap_keep`` (in
    a subreaper) it also reaps the orphans re-parented to this process, all but those pids
    (children that ``Popen`` reaps). Returns the pids it killed; logs what survived
    ``timeout_s`` (a process stuck in the kernel)."""
    roots, extra = set(roots), set(extra)
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        procs = scan()
        if reap_keep is not None:
            reap_adopted(procs, reap_keep)
        alive = find_tree(procs, roots, match, known, extra)
        if not alive:
            return killed
        if time.monotonic() > deadline:
            log.error("processes still alive after SIGKILL: %s", sorted(alive))
            return killed
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= alive
        time.sleep(0.05)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a role's process group (the role and the children that stayed)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def has_exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, leaving it unreaped: while its zombie holds the
    pid, the pid (its session and group id) cannot be reused, so its tree can be killed
    without hitting a stranger. ``Popen`` reaps it afterwards."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped
        return True


def _prctl_fn() -> Callable[..., int]:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.prctl


def _prctl(option: int, value: int) -> bool:
    return _prctl_fn()(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process instead of init."""
    ok = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if not ok:
        log.warning("could not become a child subreaper: orphans of dead roles go to init")
    return ok


def spawn(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    cpus: list[int] | None,
    marker: str,
    unset: tuple[str, ...] = (),
    nice: int = 0,
) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, output appended to ``log_path``, pinned to
    ``cpus``, at niceness ``nice``, with this process's environment less the variables
    starting with one of ``unset``, plus ``env`` and the run ``marker``; it gets SIGTERM
    when this thread dies (``PR_SET_PDEATHSIG``), so call it from the main thread.

    The niceness is set on the process and on its session's scheduling group: where the
    kernel groups each session (autogroup), CPU time is first shared between groups, and a
    process's own niceness only orders it within its group."""
    prctl = _prctl_fn()  # loaded before the fork, not in the child
    parent = os.getpid()

    def setup() -> None:  # runs in the child before exec
        os.setsid()
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above
            os.kill(os.getpid(), signal.SIGTERM)
        if cpus:
            os.sched_setaffinity(0, cpus)
        if nice:
            os.nice(nice)
            with contextlib.suppress(OSError):  # no autogroups here: the niceness above does
                fd = os.open("/proc/self/autogroup", os.O_WRONLY)
                try:
                    os.write(fd, str(nice).encode())
                finally:
                    os.close(fd)

    out = open(log_path, "a")  # noqa: SIM115 (the child keeps it)
    try:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={
                **{k: v for k, v in os.environ.items() if not (unset and k.startswith(unset))},
                **env,
                MARKER: marker,
            },
            preexec_fn=setup,
        )
    finally:
        out.close()


@dataclass
class _Announcements:
    """What the launcher could not tell its watchdog: its pipe was full (the watchdog is
    stopped or starved). One per write end of a watchdog's pipe."""

    watchdog: int | None  # its pid, for the log lines
    backlog: list[str] = field(default_factory=list)  # "+PID"/"-PID" not sent yet, in order
    dropped: int = 0  # "=PID START" lines dropped in this stall
    warned: bool = False  # this stall was logged


_announcements: dict[int, _Announcements] = {}


def start_watchdog(prefix: str, grace_s: float) -> tuple[subprocess.Popen, int]:
    """Start the watchdog of a run whose markers start with ``prefix``. Returns it and the
    write end of its pipe, on which :func:`tell_watchdog` announces the roles; the watchdog
    acts once every copy of that end is closed (this process exited, however it ended)."""
    read_end, write_end = os.pipe()  # not inherited by roles (PEP 446)
    # A stalled watchdog must not stall the supervisor loop: a write to its full pipe
    # fails (EAGAIN) instead of blocking, and tell_watchdog decides what waits and what is
    # dropped. O_NONBLOCK is on the write end's file description only: the watchdog's
    # reads still block.
    os.set_blocking(write_end, False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.launch.process_tree", prefix, str(grace_s)],
        stdin=read_end,
        start_new_session=True,  # a signal to the launcher's group does not reach it
    )
    os.close(read_end)
    _announcements[write_end] = _Announcements(proc.pid)  # a reused fd starts afresh
    return proc, write_end


def _send(fd: int, line: str) -> bool:
    """Write one announcement without blocking; False when the pipe is full. A write under
    PIPE_BUF bytes (4096) is atomic: the watchdog never reads half a line."""
    try:
        os.write(fd, f"{line}\n".encode())
    except BlockingIOError:
        return False
    except OSError:  # the watchdog is gone: it cannot be told, so nothing is held back
        pass
    return True


def tell_watchdog(fd: int, message: str) -> None:
    """Tell the watchdog ``+PID`` (a role started: its session is the run's), ``-PID`` (a
    role was reaped: its pid may be reused) or ``=PID START`` (a descendant of a role).

    Never blocks. While the pipe is full, role announcements (``+``/``-``: few, and what
    the watchdog needs most) wait for a later call, in order; descendant announcements
    (``=``: most of the traffic, and the watchdog finds most of those processes by their
    role's session or their marker anyway) are dropped and counted. One warning per
    stall, one line with the count when the watchdog reads again."""
    state = _announcements.get(fd)
    if state is None:  # a pipe start_watchdog did not make: never block on it either
        os.set_blocking(fd, False)
        state = _announcements[fd] = _Announcements(None)
    if message.startswith("-") and (started := f"+{message[1:]}") in state.backlog:
        state.backlog.remove(started)  # it was never told of the role: nothing to take back
        return
    queue = [*state.backlog, message]
    sent = 0
    while sent < len(queue) and _send(fd, queue[sent]):
        sent += 1
    if sent == len(queue):
        state.backlog = []
        if state.warned:
            log.warning(
                "the launch watchdog (pid %s) reads its pipe again; %d announcements of "
                "role descendants were dropped meanwhile",
                state.watchdog,
                state.dropped,
            )
        state.dropped, state.warned = 0, False
        return
    state.backlog = [line for line in queue[sent:] if not line.startswith("=")]
    if message.startswith("="):
        state.dropped += 1
    if not state.warned:
        state.warned = True
        log.warning(
            "the launch watchdog (pid %s) is not reading its pipe (stopped?): if this launcher "
            "dies now, it cannot clean up the role descendants it is not told of (those that "
            "left their role's session and renamed themselves outlive the run); their "
            "announcements are dropped (counted, logged when it reads again), roles' wait",
            state.watchdog,
        )


def watchdog(prefix: str, grace_s: float) -> None:
    """Consumes the launcher's announcements of roles on stdin; waits for its end (EOF:
    the launcher exited or was killed). Then gives the run's processes ``grace_s`` to stop
    on their own (roles got SIGTERM when the launcher died) and SIGKILLs what is left: the
    sessions of the roles still announced, the descendants announced and whatever carries
    the run's marker. After a
    normal exit of the launcher nothing is left and it returns at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    roots: set[int] = set()
    known: dict[int, int] = {}
    for line in sys.stdin:
        kind, *numbers = line[0], *map(int, line[1:].split())
        if kind == "+":
            roots.add(numbers[0])
        elif kind == "-":
            roots.discard(numbers[0])
        else:
            known[numbers[0]] = numbers[1]

    def match(m: str) -> bool:
        return m.startswith(prefix)

    deadline = time.monotonic() + grace_s
    while find_tree(scan(), roots, match, known) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = kill_tree(roots, match, known)
    if killed:
        sys.stderr.write(f"launch watchdog: killed {len(killed)} processes left by the run\n")


if __name__ == "__main__":
    watchdog(sys.argv[1], float(sys.argv[2]))
