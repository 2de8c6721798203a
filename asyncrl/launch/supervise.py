"""Supervision of a run's roles on one machine: start them, restart the ones that die, stop
them all at the end. The restart rules (docs/DESIGN.md section 10, one set for every launcher) live
in :mod:`asyncrl.launch.restart_policy`, process-tree mechanics in :mod:`asyncrl.launch.process_tree`.
Before a role is restarted, and whenever the launcher ends, what is left of its process
tree is killed and reaped; nothing the run started outlives it.

What a test or an operator can read: ``<run dir>/pids.json`` (the launcher's pid, the run's
marker and each role's current pid), ``<run dir>/launch.jsonl`` (one event per line:
``launch``, ``start``, ``start_failed`` (a restart that could not start its process),
``restart`` with ``launch/restarts/<role>``, ``exit``, ``gave_up``),
and the launcher's log lines ``started <role> (pid N)`` and ``restarting <role> ...``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from asyncrl.config.ending import COMPLETE_FILE
from asyncrl.launch import startup
from asyncrl.launch.departures import Departures
from asyncrl.launch.process_tree import (
    adopted,
    become_subreaper,
    find_tree,
    has_exited,
    kill_tree,
    reap_adopted,
    scan,
    signal_group,
    spawn,
    start_watchdog,
    tell_watchdog,
)
from asyncrl.launch.restart_policy import (
    FINAL_EXITS,
    RestartPolicy,
    clear_final_exit,
    describe_exit,
    exit_status,
    recent_restarts,
    restart_delay,
    take_final_exit,
)
from asyncrl.launch.role_state import QuietView as QuietView
from asyncrl.launch.role_state import Role as Role
from asyncrl.launch.role_state import View, tail

log = logging.getLogger("asyncrl.launch")

POLL_S = 1.0  # how often the supervisor looks at its roles
STOP_GRACE_S = 15.0  # how long roles get to exit after SIGTERM before SIGKILL
REAP_WAIT_S = 30.0  # how long a SIGKILLed role gets to be reaped (more: stuck in the kernel)
AFTER_LEARNER_S = 30.0  # how long the others get to exit once the learner is done
COORDINATOR_GONE = 3  # a rollout server's exit: the coordinator went silent (or never came)
# What a restart that could not start its process reads as (the shell's "cannot execute"):
# its command gone, no process or memory to spare. Restarted as any failure.
START_FAILED = 127
# How long the learner gets to finish once the buffer (or learner-k) exited 0: the learner
# stops the buffer moments before it exits, and learner-k's torchrun leaves the learner's at
# its exit barrier. Past it, the exit 0 was a stop from outside (`kill <pid>`) and counts as
# a crash: the learner would wait for its batches for ever.
EARLY_EXIT_GRACE_S = 30.0
EVENTS_FILE = "launch.jsonl"
PIDS_FILE = "pids.json"


class Supervisor:
    """Starts, watches, restarts and stops the roles of one run; the last role is the
    learner, whose exit 0 ends the run."""

    def __init__(self, roles: list[Role], run_dir: Path, policy: RestartPolicy):
        self.roles = roles
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.policy = policy
        self.launched_wall = time.time()  # a run's ending recorded since is this launch's
        self.launch_id = f"{os.getpid()}.{scan()[os.getpid()].start}"
        self.watchdog: subprocess.Popen | None = None
        self._watchdog_fd: int | None = None
        self.subreaper = False  # orphans of the run are re-parented to this process
        # Tells the coordinator at once about a rollout server that died (None: it finds
        # out from the missing heartbeats).
        self.departures: Departures | None = None

    # ---------------------------------------------------------------- starting
    def begin(self) -> None:
        """Become the subreaper of the run's orphans, start the watchdog, log the launch."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.subreaper = become_subreaper()
        self.watchdog, self._watchdog_fd = start_watchdog(f"{self.launch_id} ", STOP_GRACE_S)
        self._event("launcher", "launch", pid=os.getpid(), launch_id=self.launch_id)

    def start(self, role: Role) -> None:
        """Start (or restart) ``role``; its output goes to ``logs/<name>.log``."""
        cmd = role.command()
        role.log_path = self.log_dir / f"{role.name}.log"
        role.attempt += 1
        role.restart_at = None
        role.stopped = False
        if self._is_learner(role):
            clear_final_exit(self.run_dir)
        marker = f"{self.launch_id} {role.name} {role.attempt}"
        with open(role.log_path, "a") as f:  # a restarted role appends to the same log
            f.write(f"---- {role.name} start {role.attempt} at {time.ctime()}: {shlex.join(cmd)}\n")
        role.started_wall = time.time()
        role.proc = spawn(cmd, role.env, role.log_path, role.cpus, marker, role.unset, role.nice)
        role.known = {}
        if self._watchdog_fd is not None:
            tell_watchdog(self._watchdog_fd, f"+{role.proc.pid}")
        log.info("started %s (pid %d)", role.name, role.proc.pid)
        self._event(role.name, "start", pid=role.proc.pid, attempt=role.attempt)
        self._write_pids()

    def _is_learner(self, role: Role) -> bool:
        """Whether ``role`` is the learner (the last role): only its own start clears the
        final exit an earlier learner recorded; any other role's must leave it for the
        launcher to read as the learner exits."""
        return role is self.roles[-1]

    def start_all(self) -> None:
        for role in self.roles:
            self.start(role)

    # ---------------------------------------------------------------- watching
    def run(self, view: View) -> int:
        """Watches every role until the run ends. Consumes the roles' exits (looked at
        every ``POLL_S``); produces restarts, events in ``launch.jsonl`` and the live view.
        Waits for nothing else; unblocked by the learner's exit 0 (the others are wound
        down, returns 0), a role out of restarts (everything is stopped, returns that
        role's exit code) or a signal (KeyboardInterrupt, for the caller to handle)."""
        while True:
            view.update()
            self._track()
            self._collect_departures()
            for role in self.roles:
                code = self._look_at(role)
                if code is not None and (result := self._end(role, code, view)) is not None:
                    return result
                if self._left_early(role) and (result := self._restart(role, 0, view)):
                    return result
            time.sleep(POLL_S)

    def _track(self) -> None:
        """Note every running role's descendants (a process that leaves the role's session
        and renames itself can be found by nothing else once its parent is gone) and reap
        orphans re-parented to the launcher that have exited."""
        procs = scan()
        for role in self.roles:
            if role.proc is None:
                continue
            role.known = {
                pid: start
                for pid, start in role.known.items()
                if pid in procs and procs[pid].start == start
            }
            for pid in find_tree(procs, [role.proc.pid]) - role.known.keys():
                role.known[pid] = procs[pid].start
                if self._watchdog_fd is not None:
                    tell_watchdog(self._watchdog_fd, f"={pid} {procs[pid].start}")
        if (keep := self._reap_keep()) is not None:
            reap_adopted(procs, keep)

    def _look_at(self, role: Role) -> int | None:
        """Starts a restart that is due; returns the exit code of a role that just exited
        (its tree already killed), else None."""
        if role.done:
            return None
        if role.proc is None:
            if role.restart_at is not None and time.monotonic() >= role.restart_at:
                return self._start_again(role)
            return None
        if not has_exited(role.proc.pid):
            return None
        return self.reap(role)

    def _start_again(self, role: Role) -> int | None:
        """Restart ``role``; a start that fails reads as its exit :data:`START_FAILED`,
        restarted or given up on as any other (raised, it ended the launcher with a
        traceback and left the other roles unwatched)."""
        try:
            self.start(role)
        except (OSError, subprocess.SubprocessError) as e:  # the latter: setting it up failed
            if role.proc is not None:  # it runs: what failed came after, in its records
                raise
            log.error("%s could not be started again: %s", role.name, e)
            if role.log_path is not None:
                with contextlib.suppress(OSError), open(role.log_path, "a") as f:
                    f.write(f"---- not started: {e}\n")
            self._event(role.name, "start_failed", error=str(e))
            return START_FAILED
        return None

    def _final_exit(self, role: Role) -> int | None:
        """The final exit the learner ``role`` recorded (read and forgotten), or None."""
        return take_final_exit(self.run_dir)

    def _end(self, role: Role, code: int, view: View) -> int | None:
        """Decide what a role's exit means: the end of the run (an exit code for the
        launcher) or a restart to schedule (None)."""
        if self._is_learner(role) and code != 0 and code not in FINAL_EXITS:
            code = self._final_exit(role) or code  # torchrun's 1 hides the learner's
        if code != 0 and code not in FINAL_EXITS and code != START_FAILED:  # told at its exit
            self._tell_gone(role, code)
        if code != 0 and not self._is_learner(role) and self._ending_recorded():
            return self._let_go(role, code)
        if code == COORDINATOR_GONE and role.server_id is not None:
            if self._learner_loading() or self._waited_through_learner_restart(role):
                return self._restart_uncounted(role)
            self._learner_hung(role)
        if code == 0:
            self._event(role.name, "exit", exit_code=0)
            if role.server_id is None and not self._is_learner(role):
                role.left_at = time.monotonic()  # see _left_early
                return None
            role.done = True
            if self._is_learner(role):
                return self._wind_down(view)
            log.info(
                "%s exited 0: its part is done (the run is ending, or it was told to leave)",
                role.name,
            )
            return None
        if code in FINAL_EXITS:
            return self._give_up(role, code, view, FINAL_EXITS[code])
        return self._restart(role, code, view)

    def _let_go(self, role: Role, code: int) -> None:
        """``role`` failed after the learner recorded the run's ending (a server's engine
        teardown, say): the learner's exit decides the run. Restarted, it joined a run
        that ends; with its restarts used up, it failed a complete run and stopped the
        learner in its metrics' close."""
        log.warning(
            "%s exited %d after the run's ending was recorded: not restarted, the learner's "
            "exit decides the run",
            role.name,
            code,
        )
        self._event(role.name, "exit", exit_code=code, after_ending=True)
        role.done = True

    def _learner_loading(self) -> bool:
        """Whether the learner's coordinator is not serving in its current start: it loads
        (a big checkpoint or model), has just exited (not yet looked at) or waits for its
        restart. A server that gave up on it meanwhile (exit 3, ``launch.start_timeout_s``)
        did not fail: the learner's own exit decides the run. Seen in CI: the learner
        ended as a server gave up, and that exit used the server's last restart."""
        learner = next((r for r in self.roles if self._is_learner(r)), None)
        if learner is None:
            return False
        if learner.proc is None:  # waiting for its restart (under Ray: always None)
            return learner.restart_at is not None
        if not self._alive(learner):
            return True  # it exited, its exit not yet looked at: that decides the run
        return not startup.marked_since(
            self.run_dir, "learner", "coordinator_up", learner.started_wall
        )

    def _waited_through_learner_restart(self, server: Role) -> bool:
        """Whether ``server`` registered in its current start, but not with the learner
        running now: it gave up on the learner before, through that one's restart and
        load (its exit can reach the launcher after the new coordinator came up). Not a
        failure of its own, and no sign the new learner hangs."""
        learner = self.roles[-1]
        sid = server.server_id
        assert sid is not None
        return startup.marked_since(
            self.run_dir, sid, "registered", server.started_wall
        ) and not startup.marked_since(self.run_dir, sid, "registered", learner.started_wall)

    def _restart_uncounted(self, server: Role) -> None:
        """Restart ``server``, which gave up on a learner loading or restarting, without counting it
        among its restarts in a row: counted, a learner loading for longer than the
        servers' patience used their restarts up, and the run failed naming a server."""
        server.restart_at = time.monotonic() + self.policy.backoff_s
        log.warning(
            "%s gave up waiting for the coordinator while the learner loads or restarts: "
            "restarting it in %.1fs (not counted among its restarts)",
            server.name,
            self.policy.backoff_s,
        )
        server.waits += 1
        self._event(
            server.name,
            "restart",
            exit_code=COORDINATOR_GONE,
            learner_loading=True,
            **{f"launch/restarts/{server.name}": len(server.restarts) + server.waits},
        )

    def _learner_hung(self, server: Role) -> None:
        """A rollout server that had registered gave up on the coordinator (exit 3) while
        the learner, whose coordinator came up in its current start, still runs: the
        learner is hung (a process that runs its coordinator's thread answers). It is
        killed, to restart from its last checkpoint; left, the servers' restarts ran out
        and the run failed naming a server, after minutes of restarts that could not help.
        A learner still loading (no ``coordinator_up`` yet) or a server that never reached
        the coordinator (a wrong address) is left alone. Local launcher only."""
        learner = next((r for r in self.roles if self._is_learner(r)), None)
        if learner is None or learner.proc is None or not self._alive(learner):
            return
        assert server.server_id is not None
        # A server registered with an earlier learner only is not asked here (_end:
        # _waited_through_learner_restart): its exit says nothing of this one.
        marks = (
            (server.server_id, "registered", server.started_wall),
            ("learner", "coordinator_up", learner.started_wall),
        )
        if not all(startup.marked_since(self.run_dir, *m) for m in marks):
            return
        log.error(
            "%s lost the coordinator (exit 3) while the learner (pid %d) runs: the learner is "
            "hung, its coordinator silent for launch.start_timeout_s; killing it to restart "
            "from its last checkpoint",
            server.name,
            learner.proc.pid,
        )
        self._event(learner.name, "hung", pid=learner.proc.pid, told_by=server.name)
        signal_group(learner.proc.pid, signal.SIGKILL)

    def _left_early(self, role: Role) -> bool:
        """Whether ``role`` exited 0 (only the rollout servers may leave a run) and the
        learner is still running ``EARLY_EXIT_GRACE_S`` later: then it is restarted as
        after a crash."""
        if role.left_at is None or time.monotonic() - role.left_at < EARLY_EXIT_GRACE_S:
            return False
        if self._ending_recorded():
            return False  # the learner is ending the run: its teardown may outlast the grace
        log.warning(
            "%s exited 0 %.0fs ago while the learner still runs (stopped from outside?): "
            "restarting it as after a crash",
            role.name,
            time.monotonic() - role.left_at,
        )
        role.left_at = None
        return True

    def _ending_recorded(self) -> bool:
        """Whether the learner recorded the run's ending (``complete.json``) during this
        launch. It stops the buffer right after, then closes its metrics (a W&B upload)
        and its process group: a buffer let go then is not restarted, however long that
        takes (it was, 30 s on, and with its restarts used up that failed a complete run)."""
        try:
            return (self.run_dir / COMPLETE_FILE).stat().st_mtime >= self.launched_wall
        except OSError:
            return False

    def _restart(self, role: Role, code: int, view: View) -> int | None:
        """Schedule the restart of ``role``, which ended with ``code``; or, its restarts
        used up, end the run (returns the launcher's exit code)."""
        now = time.monotonic()
        delay = restart_delay(self.policy, role.restarts, now)
        if delay is None:
            return self._give_up(
                role,
                code,
                view,
                (
                    f"after {recent_restarts(self.policy, role.restarts, now)} restarts in a "
                    f"row, none running {self.policy.window_s:.0f}s"
                ),
            )
        role.restarts.append(now + delay)  # when the restarted process starts
        role.restart_at = now + delay
        log.warning(
            "restarting %s in %.1fs (it ended: %s; restart %d of %d in a row, each that "
            "runs %.0fs starting the row over); last lines of %s:\n%s",
            role.name,
            delay,
            describe_exit(code),
            recent_restarts(self.policy, role.restarts, now + delay),
            self.policy.max_restarts,
            self.policy.window_s,
            role.log_path,
            tail(role.log_path, 10),
        )
        self._event(
            role.name,
            "restart",
            exit_code=exit_status(code),
            delay_s=delay,
            **{f"launch/restarts/{role.name}": len(role.restarts) + role.waits},
        )
        return None

    def _tell_gone(self, role: Role, code: int) -> None:
        """A rollout server died: tell the coordinator now (without waiting for its answer)
        so that its tasks are dealt again at once, not after ``control.dead_after_s``."""
        if self.departures is None or role.server_id is None:
            return
        reason = f"its process {role.last_pid} ended ({describe_exit(code)})"
        self.departures.send(role.server_id, role.last_pid, reason)

    def _collect_departures(self) -> None:
        """Record the coordinator's answers to the departures told (``leave`` events)."""
        if self.departures is not None:
            for fields in self.departures.poll():
                self._event(fields.pop("server_id"), "leave", **fields)

    def _give_up(self, role: Role, code: int, view: View, why: str) -> int:
        """End the run for a role that will not be restarted; returns the launcher's code."""
        self._event(role.name, "gave_up", exit_code=exit_status(code))
        log.error(
            "%s ended (%s, %s): giving up; last lines of %s:\n%s",
            role.name,
            describe_exit(code),
            why,
            role.log_path,
            tail(role.log_path),
        )
        self.stop_all()
        view.finish(ok=False)
        return exit_status(code) or 1  # a buffer that kept exiting 0 failed the run all the same

    # ---------------------------------------------------------------- stopping
    def _wind_down(self, view: View) -> int:
        """The learner is done and told the others to stop: give them time, then make sure.
        A rollout server that never registered (restarted late) has nothing to finish and no
        coordinator left to stop it: it is stopped at once (waited for, it ended the run
        30 s late)."""
        for role in filter(self._never_registered, self._running()):
            assert role.proc is not None  # _never_registered lists started roles only
            log.info("%s never registered with the coordinator: stopping it", role.name)
            signal_group(role.proc.pid, signal.SIGTERM)
            role.stopped = True
        late = self._wait_exited(self._running(), AFTER_LEARNER_S)
        for role in late:
            log.warning("%s still running after the learner finished: stopping it", role.name)
        self.stop_all(grace_s=5.0)
        view.finish(ok=True)
        return 0

    def _never_registered(self, role: Role) -> bool:
        """Whether ``role`` is a rollout server started here whose current attempt has not
        marked ``registered`` (:mod:`asyncrl.launch.startup`). Never under Ray: its roles
        have no process here, and their marks stay on nodes that may not share the run
        directory (such a server is waited for, as before)."""
        if role.server_id is None or role.proc is None:
            return False
        since = role.started_wall
        return not startup.marked_since(self.run_dir, role.server_id, "registered", since)

    def _alive(self, role: Role) -> bool:
        """Started and not exited (an exited role is left unreaped)."""
        return role.proc is not None and not has_exited(role.proc.pid)

    def _running(self) -> list[Role]:
        return [r for r in self.roles if self._alive(r)]

    def _wait_exited(self, roles: list[Role], timeout_s: float) -> list[Role]:
        """Wait up to ``timeout_s`` for ``roles`` to exit (leaving them unreaped); returns
        the ones still running."""
        deadline = time.monotonic() + timeout_s
        while True:
            roles = [r for r in roles if self._alive(r)]
            if not roles or time.monotonic() >= deadline:
                return roles
            time.sleep(0.1)

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every running role's process group, the rollout servers first (for up
        to half of ``grace_s``: the coordinator and the buffer still answer their leave
        and take their last groups; with both gone each wait ran out, and a server
        overran the grace), wait up to ``grace_s`` in all, then kill and reap what is left
        of every role's tree, and every other process of the run."""
        deadline = time.monotonic() + grace_s
        servers = [r for r in self._running() if r.name.startswith("rollout")]
        for role in servers:
            assert role.proc is not None  # _running lists started roles only
            signal_group(role.proc.pid, signal.SIGTERM)
            role.stopped = True
        if servers:
            self._wait_exited(servers, grace_s / 2)
        # The others as they are now: one that ended meanwhile was not stopped by us.
        others = [r for r in self._running() if not r.name.startswith("rollout")]
        for role in others:
            assert role.proc is not None
            signal_group(role.proc.pid, signal.SIGTERM)
            role.stopped = True
        for role in self._wait_exited(servers + others, max(0.0, deadline - time.monotonic())):
            log.warning("%s did not stop within %.0fs: killing it", role.name, grace_s)
        for role in self.roles:
            if role.proc is not None:
                code = self.reap(role)
                # A role that ended on its own before the stop (a server the coordinator
                # told to) is not recorded as stopped by the launcher.
                by = {"stopped_by": "launcher"} if role.stopped else {}
                self._event(role.name, "exit", exit_code=code, **by)
        self.sweep()

    def reap(self, role: Role) -> int:
        """Kill what is left of ``role``'s tree (the role itself included), reap the role
        and return its exit code. Call it before the role is reaped: its zombie keeps its
        pid, the id of its session and group, from being reused meanwhile."""
        assert role.proc is not None, f"{role.name} is not started"
        marker = f"{self.launch_id} {role.name} {role.attempt}"
        pid = role.proc.pid
        keep = self._reap_keep()
        killed = kill_tree([pid], marker.__eq__, role.known, self._orphans_of(role, keep), keep)
        try:
            code = role.proc.wait(REAP_WAIT_S)
        except subprocess.TimeoutExpired:  # SIGKILLed, yet alive: stuck in the kernel (a
            # driver, a network file system); the run goes on without it rather than freeze
            log.error(
                "%s (pid %d) survived SIGKILL for %.0fs (stuck in the kernel?); leaving it "
                "and going on",
                role.name,
                pid,
                REAP_WAIT_S,
            )
            code = -9
        role.last_pid = pid
        killed.discard(pid)
        if self._watchdog_fd is not None:
            tell_watchdog(self._watchdog_fd, f"-{pid}")
        if killed:
            log.info("%s: killed %d processes left of its tree", role.name, len(killed))
        role.proc = None
        self._write_pids()
        return code

    def _orphans_of(self, role: Role, keep: set[int] | None) -> set[int]:
        """Orphans re-parented to the launcher (a subreaper) that no other running role is
        known to own: what ``role`` started and left without a trace, such as a child in a
        session of its own that it started just before it died."""
        if keep is None:
            return set()
        procs = scan()
        others: set[int] = set()
        for r in self._running():
            if r is not role and r.proc is not None:
                # A live role's helper adopted before _track saw it (a double fork, as the
                # sandbox's reaper) is in its session, or carries its marker.
                marker = f"{self.launch_id} {r.name} {r.attempt}"
                others |= find_tree(procs, [r.proc.pid], marker.__eq__, r.known)
        return adopted(procs, keep) - others

    def _reap_keep(self) -> set[int] | None:
        """As a subreaper, the children that are not orphans (roles and the watchdog, which
        their ``Popen`` reaps); None otherwise: then all children are someone else's."""
        if not self.subreaper:
            return None
        keep = {r.proc.pid for r in self.roles if r.proc is not None}
        return keep | ({self.watchdog.pid} if self.watchdog is not None else set())

    def sweep(self) -> None:
        """Kill and reap every process of the run but the roles' own (call it once they are
        reaped): anything that carries the run's marker, and (as a subreaper) orphans
        re-parented to the launcher."""
        prefix = f"{self.launch_id} "
        keep = self._reap_keep()
        orphans = adopted(scan(), keep) if keep is not None else set()
        known = {pid: start for role in self.roles for pid, start in role.known.items()}
        killed = kill_tree([], lambda m: m.startswith(prefix), known, orphans, reap_keep=keep)
        if killed:
            log.info("killed %d leftover processes of the run", len(killed))

    def close(self) -> None:
        """The launcher ends: nothing of the run may outlive it (roles still running are
        stopped as by :meth:`stop_all`); release the watchdog."""
        self.stop_all()
        if self.departures is not None:
            self.departures.close()
            self.departures = None
        if self._watchdog_fd is not None:
            os.close(self._watchdog_fd)
            self._watchdog_fd = None
            assert self.watchdog is not None  # started together with its pipe
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watchdog.wait(5)

    # ---------------------------------------------------------------- records
    def _event(self, role: str, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "role": role, "event": event, **fields}
        with open(self.run_dir / EVENTS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _write_pids(self) -> None:
        """``pids.json``: the launcher, the run's marker and each role's pid (null between
        a death and its restart), replaced atomically."""
        data = {
            "launcher": os.getpid(),
            "launch_id": self.launch_id,
            "roles": {r.name: (r.proc.pid if r.proc else None) for r in self.roles},
        }
        tmp = self.run_dir / f".{PIDS_FILE}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.run_dir / PIDS_FILE)
