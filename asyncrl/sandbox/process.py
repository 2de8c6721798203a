"""One worker process of a :class:`~asyncrl.sandbox.workers.WorkerPool`: what runs inside it
(setup once, then one answer per job) and the parent's handle on it (:class:`Worker`: start,
run a job within its time, kill).

Protocol (parent <-> its own child, plain picklable tuples):

- child -> parent at start: ``("ready", None)`` or ``("startup_error", message)``
- parent -> child: ``(seq, job)`` (anything picklable), or ``None`` to stop
- child -> parent: ``(seq, (status, payload))``, the handler's answer to job ``seq``;
  ``("exception", message)`` if the handler raised (``SystemExit`` included),
  ``("out_of_memory", detail)`` if it ran out of memory under the worker's cap
  (:class:`MemoryCap`). The parent drops an answer whose ``seq`` is not the job's, so no
  job can take another's answer.

Each worker is its own process group, so the pool's kill also ends what the user code
started, and a signal to the caller's group (the launcher's stop) leaves the workers to
the pool's own close. On Linux a worker dies with its parent (``PR_SET_PDEATHSIG``), and
an idle *reaper* in its group (not its child) kills the group when the worker ends, so
nothing the user code left running outlives a killed caller (:func:`_start_reaper`).
Workers are not daemons: daemonic processes may not have children, and scorers that run
code in a ``multiprocessing.Process`` (veRL's ``prime_code``) need them.

A worker's stdout and stderr (fds 1 and 2) are pipes the parent drains within a per-job
and a per-worker limit (:mod:`asyncrl.sandbox.output`), so user code that prints cannot
fill the caller's log.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import queue
import resource
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

from asyncrl.sandbox.memory import NO_CAP, MemoryCap, from_memory, limit_memory
from asyncrl.sandbox.output import OutputDrain, flush_std_streams, redirect_output

logger = logging.getLogger(__name__)

#: What a worker does with one job: returns ``(status, payload)``, both picklable.
Handler = Callable[[Any], tuple[str, Any]]
#: Runs once in each worker and returns its handler; must be a module-level function.
Setup = Callable[..., Handler]

MAX_MESSAGE_CHARS = 300  # an error message's longest form, so a huge repr cannot flood logs
# How long workers may take to exit (all together, at a close) before they are killed.
STOP_GRACE_S = 1.0
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
    _start_reaper()


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


def _start_reaper() -> None:
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


def _worker_main(
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


# Linux sends PR_SET_PDEATHSIG when the *thread* that started the child ends, not the
# process: a worker started by a short-lived respawn thread would die with that thread.
# So every worker is started by one thread that lives as long as this process.
_spawner_lock = threading.Lock()
_spawner: tuple[int, queue.Queue[tuple[Any, Future[None]]]] | None = None


def _spawn_loop(jobs: queue.Queue[tuple[Any, Future[None]]]) -> None:
    """The spawner thread: consumes processes to start, forever; waits on its queue."""
    while True:
        process, done = jobs.get()
        try:
            process.start()
        except BaseException as exc:
            done.set_exception(exc)
        else:
            done.set_result(None)


def _start_process(process: Any) -> None:
    """Start ``process`` from the spawner thread (created once per process); raise what
    ``start`` raised."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # none yet, or we were forked
            jobs: queue.Queue[tuple[Any, Future[None]]] = queue.Queue()
            threading.Thread(
                target=_spawn_loop, args=(jobs,), name="asyncrl-worker-spawner", daemon=True
            ).start()
            _spawner = (os.getpid(), jobs)
        jobs = _spawner[1]
    done: Future[None] = Future()
    jobs.put((process, done))
    done.result()


def _kill_group(process: Any) -> None:
    """SIGKILL the worker's process group: the worker and whatever its user code started."""
    if process.pid is None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:  # no such group yet (not reached setpgrp) or no longer
        with contextlib.suppress(OSError):
            process.kill()


class Worker:
    """The parent's handle on one worker process (:attr:`process`) and its pipe."""

    def __init__(
        self,
        ctx: Any,
        setup: Setup,
        setup_args: tuple[Any, ...],
        role: str,
        cap: MemoryCap = NO_CAP,
    ) -> None:
        self.role = role
        self._send_lock = threading.Lock()  # a job and a close's stop never interleave
        self._kill_lock = threading.Lock()  # a close and a caller may kill it at once
        self._killed = False
        self._seq = 0
        self.conn, child_conn = ctx.Pipe(duplex=True)
        out_read, out_write = ctx.Pipe(duplex=False)
        err_read, err_write = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_worker_main,
            args=(child_conn, setup, setup_args, os.getpid(), cap, (out_write, err_write)),
            name=f"asyncrl-{role}-worker",
            daemon=False,  # see the module's docstring; the pool's finalizer stops it
        )
        try:
            _start_process(self.process)
        except BaseException:
            for end in (out_read, out_write, err_read, err_write):
                end.close()
            raise
        # Without closing our copy of the child's end, its death would never read as EOF.
        child_conn.close()
        out_write.close()
        err_write.close()
        self._output = OutputDrain(
            (out_read, err_read), self.process.sentinel, f"{role} worker {self.process.pid}"
        )

    def wait_ready(self, timeout_s: float, slow_start: str = "") -> None:
        """Block until the worker's setup has run; raise ValueError if it cannot
        (``slow_start``: what the message adds when the setup took too long, its fix)."""
        if not self.conn.poll(timeout_s):
            self.kill()
            raise ValueError(f"{self.role} worker did not start within {timeout_s}s{slow_start}")
        try:
            status, message = self.conn.recv()
        except (EOFError, OSError):
            # Its pipe closes a moment before it exits: wait for its own exit code, or our
            # kill would be what is reported (-9).
            self.process.join(STOP_GRACE_S)
            code = self.process.exitcode
            self.kill()
            raise ValueError(f"{self.role} worker exited during start (exit code {code})") from None
        if status != "ready":
            self.kill()
            raise ValueError(message)

    def run(self, job: Any, timeout_s: float) -> tuple[str, Any]:
        """Send one job and wait for its answer; ``("timeout"|"worker_died", detail)`` if none,
        ``("unsent", exit code)`` when the worker had died while idle (the job never ran)."""
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            self._output.next_job()
            try:
                self.conn.send((seq, job))
            except OSError:  # killed while idle (an OOM kill), or by a close
                self.process.join(STOP_GRACE_S)
                return "unsent", self.process.exitcode
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ready = wait([self.conn, self.process.sentinel], deadline - time.monotonic())
            except (OSError, ValueError):  # the pipe was closed under us: a close killed it
                break
            if not ready:
                return "timeout", None
            if self.conn not in ready:
                break
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, tuple) and len(message) == 2 and message[0] == seq:
                return message[1]
            logger.debug("%s worker: dropped an answer that is not job %d's", self.role, seq)
        self.process.join(STOP_GRACE_S)
        return "worker_died", self.process.exitcode

    def kill(self) -> None:
        """SIGKILL the worker's process group and close the pipe; idempotent, thread-safe."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
            _kill_group(self.process)
            self.process.join(STOP_GRACE_S)
            self.conn.close()
            # What it wrote last (a start-up traceback) reaches the log before the caller
            # goes on (a server that stops on a start-up error would lose it).
            self._output.join(STOP_GRACE_S)

    def request_stop(self) -> None:
        """Ask the worker to exit after its current job, without waiting."""
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # gone or closed
            self.conn.send(None)

    def stop(self) -> None:
        """Ask the worker to exit, and kill it (and its group) if it does not promptly."""
        self.request_stop()
        self.process.join(STOP_GRACE_S)
        self.kill()
