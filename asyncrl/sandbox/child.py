"""What runs inside a worker process (:mod:`asyncrl.sandbox.process` is the parent's side):
its set-up, once, then one answer per job, until told to stop; it dies with its parent and
leaves a reaper that ends its process group when it ends (the protocol is in
:mod:`asyncrl.sandbox.process`)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import resource
import select
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from asyncrl.sandbox.memory import NO_CAP, MemoryCap, from_memory, limit_memory
from asyncrl.sandbox.output import flush_std_streams, redirect_output

logger = logging.getLogger(__name__)

#: What a worker does with one job: returns ``(status, payload)``, both picklable.
Handler = Callable[[Any], tuple[str, Any]]
#: Runs once in each worker and returns its handler; must be a module-level function.
Setup = Callable[..., Handler]

MAX_MESSAGE_CHARS = 300  # an error message's longest form, so a huge repr cannot flood logs
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def describe_exception(exc: BaseException) -> str:
    """``"Type: message"``, cut to :data:`MAX_MESSAGE_CHARS`; what the caller hears of a raise.

    Never raises: an exception whose ``__str__`` raises must not end the worker."""
    try:
        if isinstance(exc, SystemExit):
            text = f"SystemExit({exc.code!r}) (sys.exit() or exit() was called)"
        else:
            text = f"{type(exc).__name__}: {exc}"
    except Exception:
        text = f"{type(exc).__name__} (its message could not be read: str() raised)"
    return text[:MAX_MESSAGE_CHARS]


# ------------------------------------------------------------------------ worker process


def _die_with_parent(parent_pid: int) -> None:
    """Take this worker out of the caller's process group and tie its life to the caller.

    Its own group lets the pool kill whatever the user code started (``os.killpg``) and
    keeps the launcher's stop signal, sent to the caller's group, off the workers: the
    pool's close stops them. ``PR_SET_PDEATHSIG`` kills the worker when its parent dies,
    even by SIGKILL and even mid-job (Linux only; elsewhere an idle worker sees EOF)."""
    os.setpgrp()
    _set_parent_death_signal(signal.SIGKILL)  # False: keep the EOF rule
    if os.getppid() != parent_pid:  # the parent died before prctl could watch it
        os._exit(0)
        return
    start_reaper()


def _set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (thread) dies; False where
    it cannot be asked (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_reaper() -> None:
    """Start an idle process in the worker's group that kills the whole group when the
    worker ends, however it ends.

    The worker itself dies with the caller (its parent-death signal), but what a scorer
    started, and left running, is not its child's business: a SIGKILLed rollout server
    would leave those processes to run on, and the pool's kill or close, which reach the
    group, never comes. The reaper waits on a pidfd of the worker (Linux 5.3+), opened
    before the fork so that it names the worker whatever happens next, then kills the
    group, itself last. It is forked twice, so it is not the worker's child: user code
    that waits for *any* child (``os.wait()`` until none is left) never meets it. Where no
    pidfd can be opened, no reaper: the pool's kill and close are then the only reach."""
    try:
        watch = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        return
    middle = os.fork()
    if middle != 0:  # the worker: reap the middle process, which exits at once
        os.close(watch)
        os.waitpid(middle, 0)
        return
    try:  # the middle process, then the reaper: never back in the worker's code
        if os.fork() != 0:
            return
        # The worker's pipe must reach end of file when the worker dies: no copy here.
        top = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        top = os.sysconf("SC_OPEN_MAX") if top == resource.RLIM_INFINITY else top
        os.closerange(3, watch)
        os.closerange(watch + 1, top)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        waiter = select.poll()  # not select.select: it takes no fd past 1023
        waiter.register(watch, select.POLLIN)
        waiter.poll()  # readable once the worker has exited
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def _answer(handler: Handler, job: Any, pid: int, cap: MemoryCap) -> tuple[str, Any]:
    """The handler's answer to ``job``. A process forked by user code that comes back here
    (a child that returned or raised instead of calling ``os._exit``) exits at once: only
    the worker itself may answer on the pipe."""
    try:
        answer = handler(job)
    except BaseException as exc:  # SystemExit (sys.exit in user code) must not end the worker
        if os.getpid() != pid:
            code = exc.code if isinstance(exc, SystemExit) else 1
            os._exit(code if isinstance(code, int) else int(code is not None))
        if cap.mb > 0 and from_memory(exc):
            return "out_of_memory", cap.hit()
        return "exception", describe_exception(exc)
    if os.getpid() != pid:
        os._exit(0)
    return answer


def _start(
    conn: Connection, setup: Setup, setup_args: tuple[Any, ...], cap: MemoryCap
) -> Handler | None:
    """Cap the memory, run ``setup`` and tell the parent how it went; the handler, or None
    (the worker should exit) when it failed."""
    try:
        # Before setup: importing the user's module is user code too, and a scorer that
        # loads too much there fails at start, in one line, rather than on every sample.
        limit_memory(cap.mb)
    except (OSError, ValueError) as exc:  # refused here: say so rather than run uncapped
        message = f"cannot cap a worker's memory ({exc}): set {cap.key}=0 to run without a cap"
        conn.send(("startup_error", message))
        return None
    try:
        handler = setup(*setup_args)
    # SystemExit too (sys.exit() in a module's import or a tool's __init__): uncaught, it
    # ended the worker and the caller heard only an exit code, not the message.
    except (Exception, SystemExit) as exc:
        if isinstance(exc, SystemExit):
            message = (
                f"a worker's start-up raised {describe_exception(exc)}; take the exit out "
                "of the module's import and its setup"
            )
        elif cap.mb > 0 and from_memory(exc):
            message = (
                f"a worker ran out of memory while starting ({cap.hit()}): load less when "
                f"its module is imported, or raise {cap.key} (0: no cap)"
            )
        else:
            try:
                message = str(exc)
            except Exception:
                message = describe_exception(exc)
        conn.send(("startup_error", message))
        return None
    conn.send(("ready", None))
    return handler


def worker_main(
    conn: Connection,
    setup: Setup,
    setup_args: tuple[Any, ...],
    parent_pid: int,
    cap: MemoryCap = NO_CAP,
    outputs: tuple[Connection, Connection] | None = None,
) -> None:
    """Entry point of a worker process: run ``setup``, then serve jobs until told to stop.

    Consumes ``(seq, job)`` from its pipe; produces one ``(seq, answer)`` per job. Waits on
    the pipe for the next job; unblocked by a job, by ``None`` (stop) or by the parent going
    away (end of file, or SIGKILL from the kernel). A job that hangs is not its business:
    the parent kills it. ``outputs``: the write ends of the pipes its stdout and stderr
    go to (None: the caller's own, unbounded)."""
    _die_with_parent(parent_pid)
    if outputs is not None:  # before setup: importing user code may print too
        redirect_output(*outputs)
    # multiprocessing made the pool's "spawn" this process's default; user code gets the
    # platform's, as in a plain process: a spawned child could not import a scorer's
    # functions, which live in a module loaded by path.
    mp.set_start_method(None, force=True)
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    handler = _start(conn, setup, setup_args, cap)
    if handler is None:
        return
    pid = os.getpid()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone: do not outlive it
        if message is None:
            return
        seq, job = message
        answer = _answer(handler, job, pid, cap)
        flush_std_streams()
        try:
            conn.send((seq, answer))
        except (EOFError, OSError):
            return
        except Exception as exc:  # an answer that cannot be pickled
            conn.send((seq, ("exception", f"unpicklable answer: {describe_exception(exc)}")))
