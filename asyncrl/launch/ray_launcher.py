"""``asyncrl-launch --ray CONFIG [overrides]`` (or ``launch.backend: ray``): the same roles
and command lines as the local launcher, placed on a Ray cluster.

- **Cluster**: ``launch.ray.address`` (``auto``: the running cluster; with none, a local Ray
  instance is started for the run).
- **Placement**: one placement group (``launch.ray.strategy`` PACK or SPREAD). Bundle 0 holds
  the buffer and the learner ranks (GPUs = ``trainer.nproc`` on CUDA), then one bundle per
  further learner node (``launch.ray.learner_nodes``), then one per rollout server (GPUs =
  its tensor-parallel size). Custom resources (``launch.ray.resources``) tie bundles to the
  nodes that offer them. Each role gets a small agent actor in its bundle that starts the
  role's real command as a child process (:mod:`asyncrl.launch.ray_agent`): roles stay processes.
- **Addresses**: bundle 0's node IP becomes ``endpoints.host`` for every role; ports stay the
  configured ones. The resolved config is written on every role's node; relative paths in it
  (model, data, run directory) resolve against the launcher's working directory on each
  node, so every node needs them at the same place (a shared file system, or copies).
- **Supervision**: :class:`asyncrl.launch.supervise.Supervisor`'s rules (restarts with backoff
  within ``launch.max_restarts``, the learner resuming from its checkpoint, the run ending
  with the learner's exit 0). A role whose agent dies with its node counts as killed
  (SIGKILL) and is restarted in the same bundle, which Ray places again on a node with room
  (waiting up to ``launch.ray.start_timeout_s``, at most ``launch.max_restarts`` times in a
  row however long each wait: then the run ends). An agent that only answers slowly is
  asked again; one given up is killed (:mod:`asyncrl.launch.ray_handles`). Bundle 0 placed
  again on another node ends the run in one line (every role dials the lost node's
  address); the same command resumes it from its last checkpoint. Ctrl-C stops every role
  on every node.
- **Records**: ``launch.jsonl`` and ``pids.json`` as locally, plus each role's node (IP, Ray
  node id, host name) in its ``start`` events. Where a node does not share the launcher's
  run directory, the learner's metrics and every role's log are copied back as they grow
  (and once more as a role is seen to exit or is stopped; a replaced agent on the same node,
  or the next launch of the run, goes on from what was copied:
  :mod:`asyncrl.launch.ray_copies`), so the progress line and the summary read as locally;
  the learner's final exit is read on its node. A node without
  the role's command or the launcher's working directory fails the run in one line, exit 2
  (a config problem).

This module imports ``ray`` only when a run starts, so ``--help`` answers at once; the run
starts in :mod:`asyncrl.launch.ray_main`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from asyncrl.launch.ray_copies import NodeCopies
from asyncrl.launch.ray_handles import SLOW_POLLS, Agent, not_on_node, slow_answer
from asyncrl.launch.ray_plan import Placement, unshared_learner_problem
from asyncrl.launch.restart_policy import CONFIG_ERROR, clear_final_exit
from asyncrl.launch.supervise import STOP_GRACE_S, RestartPolicy, Role, Supervisor, View

log = logging.getLogger("asyncrl.launch")

NODE_LOST = -9  # the exit reported for a role whose agent (or node) is gone: as SIGKILL
ENDED = 1  # the launcher's exit when the run cannot go on on this cluster (see _fail)
CALL_TIMEOUT_S = 30.0  # one call to a live agent


class RaySupervisor(Supervisor):
    """:class:`Supervisor` with every role on a Ray node, driven through its agent. The
    rules (restarts, the end of the run) are the base class's; this class only says how a
    role is started, seen to exit, stopped and recorded."""

    def __init__(
        self,
        roles: list[Role],
        run_dir: Path,
        policy: RestartPolicy,
        placement: Placement,
        pg: Any,
        files: dict[str, str],
        start_timeout_s: float,
    ):
        super().__init__(roles, run_dir, policy)
        self.placement = placement
        self.pg = pg
        self.files = files  # written on each role's node before it starts
        self.start_timeout_s = start_timeout_s
        self.agents: dict[str, Agent] = {}
        self.host: str | None = None  # bundle 0's node IP: endpoints.host of every role
        self.unplaced: dict[str, int] = {}  # starts in a row whose bundle found no node
        self.fatal: str | None = None  # why the run must end now (see _fail)
        # What was copied back from nodes that do not share the run directory.
        self.copies = NodeCopies(self.run_dir)

    # ---------------------------------------------------------------- agents
    def agent(self, role: Role) -> Agent:
        """The role's agent, created in its bundle if it has none (a lost one is replaced)."""
        if role.name not in self.agents:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            from asyncrl.launch.ray_agent import RoleAgent

            strategy = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.placement.bundle_of[role.name]
            )
            remote = ray.remote(RoleAgent).options(
                scheduling_strategy=strategy,
                num_cpus=0,
                num_gpus=self.placement.gpus_of[role.name],
                max_restarts=0,
            )
            handle = remote.remote(str(self.run_dir), role.name, self.launch_id, os.getcwd())
            self.agents[role.name] = Agent(handle)
        return self.agents[role.name]

    def _call(self, ag: Agent, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """One call to the agent, waited for up to ``timeout_s``."""
        import ray

        return ray.get(getattr(ag.handle, method).remote(*args), timeout=timeout_s)

    def _lose(self, role: Role, why: str) -> int:
        """The role's agent is gone (its node, most likely): drop it, report SIGKILL."""
        log.warning("%s: its agent is gone (%s): counted as killed", role.name, why)
        self._drop(role)
        return NODE_LOST

    def _drop(self, role: Role) -> None:
        """Forget the role's agent, killed should it live yet (see
        :mod:`asyncrl.launch.ray_handles`)."""
        import ray

        lost = self.agents.pop(role.name, None)
        if lost is not None:
            if lost.pid is not None:
                role.last_pid = lost.pid
            try:
                ray.kill(lost.handle, no_restart=True)
            except Exception as e:  # dead already, or its node unreachable
                log.debug("killing the lost agent of %s: %s", role.name, e)
        self._write_pids()

    def _fail(self, why: str) -> int:
        """The run cannot go on on this cluster: :meth:`_end` ends it with ``why``."""
        self.fatal = why
        return ENDED

    def _end(self, role: Role, code: int, view: View) -> int | None:
        if self.fatal is None:
            return super()._end(role, code, view)
        log.error("%s", self.fatal)
        self._event(role.name, "gave_up", exit_code=ENDED, why=self.fatal)
        self.stop_all()
        view.finish(ok=False)
        return ENDED

    # ---------------------------------------------------------------- starting
    def begin(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / ".launch_id").write_text(self.launch_id)
        self._event("launcher", "launch", pid=os.getpid(), launch_id=self.launch_id, ray=True)

    def start(self, role: Role) -> None:
        """Ask the role's agent to start it (answered later: its bundle may still wait for
        a node); :meth:`_look_at` collects the answer."""
        ag = self.agent(role)
        role.attempt += 1
        role.restart_at = None
        if self._is_learner(role):
            clear_final_exit(self.run_dir)
        role.log_path = self.log_dir / f"{role.name}.log"
        ag.handle.write.remote(self.files)
        ag.pending = ag.handle.start.remote(role.command(), role.env, role.attempt, role.cpus)
        ag.since = time.monotonic()
        log.info(
            "starting %s (attempt %d) in bundle %d", role.name, role.attempt, self.bundle(role)
        )

    def bundle(self, role: Role) -> int:
        return self.placement.bundle_of[role.name]

    def _started(self, role: Role, ag: Agent) -> int | None:
        """Collect a pending start: None while waiting (or started), an exit code if it
        failed."""
        import ray

        ready, _ = ray.wait([ag.pending], timeout=0)
        if not ready:
            waited = time.monotonic() - ag.since
            if waited > self.start_timeout_s:
                # Counted apart from the restart window: each try lasts start_timeout_s,
                # which may exceed launch.restart_window_s, and then it would try for ever.
                tries = self.unplaced[role.name] = self.unplaced.get(role.name, 0) + 1
                if tries > self.policy.max_restarts:
                    self._drop(role)  # else the run's stop waits for it to be placed
                    return self._fail(
                        f"{role.name}: bundle {self.bundle(role)} "
                        f"({self.placement.bundles[self.bundle(role)]}) found no node in "
                        f"{tries} tries of launch.ray.start_timeout_s={self.start_timeout_s:.0f}"
                        "s: add a node that offers it, then run the same command again"
                    )
                log.error(
                    "%s: no node with room for bundle %d (%s) after %.0fs "
                    "(launch.ray.start_timeout_s): add a node that offers it",
                    role.name,
                    self.bundle(role),
                    self.placement.bundles[self.bundle(role)],
                    waited,
                )
                return self._lose(role, "never placed")
            return None
        ag.pending = None
        try:
            ag.pid = ray.get(ready[0])
            ag.where = self._call(ag, "where")
        except Exception as e:  # the agent died before it answered, or could not start it
            if (missing := not_on_node(e)) is not None:
                log.error("%s", missing)  # a config problem: not restarted, the run stops
                return CONFIG_ERROR
            return self._lose(role, _said(e))
        assert ag.where is not None
        self.unplaced.pop(role.name, None)
        if self.bundle(role) == 0 and self.host is not None and ag.where["ip"] != self.host:
            # The buffer and the coordinator listen there and every role dials endpoints.host:
            # a moved bundle 0 would bind the lost node's address, and crash-loop.
            return self._fail(
                f"{role.name} started on {ag.where['ip']}, not on {self.host} (endpoints.host): "
                "bundle 0's node was lost; run the same command again to resume from the "
                "last checkpoint"
            )
        problem = unshared_learner_problem(role.name, self.placement, ag.where["shared_run_dir"])
        if problem is not None:
            log.error("%s", problem)
            return 2  # a config problem: not restarted, the run stops
        if not ag.where["shared_run_dir"] and ag.mirror is None:
            # Host name and address: either alone may be shared by two nodes (containers).
            ag.mirror = self.copies.mirror(role.name, f"{ag.where['hostname']}/{ag.where['ip']}")
        log.info(
            "started %s (pid %d on %s, node %s)",
            role.name,
            ag.pid,
            ag.where["hostname"],
            ag.where["ip"],
        )
        self._event(
            role.name,
            "start",
            pid=ag.pid,
            attempt=role.attempt,
            ip=ag.where["ip"],
            node_id=ag.where["node_id"],
            hostname=ag.where["hostname"],
        )
        self._write_pids()
        return None

    # ---------------------------------------------------------------- watching
    def _track(self) -> None:
        """Copy back what grew on nodes that do not share the run directory."""
        for ag in self.agents.values():
            if ag.pid is not None:
                self._pull(ag)

    def _pull(self, ag: Agent) -> None:
        """Copy back what grew in the files of ``ag``'s role, if its node does not share
        the run directory."""
        if ag.mirror is None:
            return
        self.copies.pull(ag.mirror, lambda rel, off, ino: self._call(ag, "read", rel, off, ino))

    def _look_at(self, role: Role) -> int | None:
        if role.done:
            return None
        ag = self.agents.get(role.name)
        if ag is None or (ag.pid is None and ag.pending is None):
            if role.restart_at is not None and time.monotonic() >= role.restart_at:
                self.start(role)
            return None
        if ag.pending is not None:
            return self._started(role, ag)
        try:
            code = self._call(ag, "poll")
        except Exception as e:  # RayActorError and kin: the agent or its node died
            ag.slow += 1
            if not slow_answer(e) or ag.slow >= SLOW_POLLS:
                return self._lose(role, type(e).__name__)
            log.warning(
                "%s: its agent did not answer within %.0fs (%s), %d of %d times in a row "
                "before it counts as lost",
                role.name,
                CALL_TIMEOUT_S,
                type(e).__name__,
                ag.slow,
                SLOW_POLLS,
            )
            return None
        ag.slow = 0
        if code is not None:
            self._pull(ag)  # the end of its log
            role.last_pid, ag.pid = ag.pid or 0, None
            self._write_pids()
        return code

    def _alive(self, role: Role) -> bool:
        ag = self.agents.get(role.name)
        if ag is None or ag.pid is None:
            return False
        try:
            code = self._call(ag, "poll")
        except Exception:
            return False
        if code is not None:  # it exited by itself as the run winds down
            self._pull(ag)  # its last lines
            self._event(role.name, "exit", exit_code=code)
            role.last_pid, ag.pid = ag.pid, None
        return code is None

    def _final_exit(self, role: Role) -> int | None:
        """The final exit the learner recorded, read (and forgotten) on its node where that
        node does not share the run directory."""
        ag = self.agents.get(role.name)
        if ag is not None and ag.where is not None and not ag.where["shared_run_dir"]:
            try:
                return self._call(ag, "take_final_exit")
            except Exception as e:  # its node is gone: nothing to read
                log.warning("%s: its final exit could not be read: %s", role.name, e)
                return None
        return super()._final_exit(role)

    def _ending_recorded(self) -> bool:
        """As the base class's, read on the learner's node where that node does not share
        the run directory (``complete.json`` is written there and never copied back)."""
        ag = self.agents.get("learner")
        if ag is not None and ag.where is not None and not ag.where["shared_run_dir"]:
            try:
                return bool(self._call(ag, "ended_since", self.launched_wall))
            except Exception as e:  # its node is gone: the learner's own loss says so
                log.debug("learner: its ending could not be read: %s", e)
                return False
        return super()._ending_recorded()

    # ---------------------------------------------------------------- stopping
    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """Every agent stops its role (SIGTERM, then SIGKILL after ``grace_s``; the rollout
        servers' first, as under the local launcher) and kills
        what is left of the run on its node; each role stopped gets its ``exit`` event, as
        under the local launcher (its exit code, or NODE_LOST where its agent did not say;
        ``stopped_by`` only where the agent signalled it)."""
        import ray

        running = {n for n, ag in self.agents.items() if ag.pid is not None or ag.pending}
        deadline = time.monotonic() + grace_s
        # The rollout servers first, as the local launcher stops them (for up to half of
        # grace_s): the coordinator and the buffer still answer their leave and take their
        # last groups.
        servers = {n: ag for n, ag in self.agents.items() if n.startswith("rollout")}
        refs = {name: ag.handle.stop.remote(grace_s) for name, ag in servers.items()}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=grace_s / 2)
        left = max(0.0, deadline - time.monotonic())
        for name, ag in self.agents.items():
            if name not in servers:
                refs[name] = ag.handle.stop.remote(left)
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=left + CALL_TIMEOUT_S)
        for name, ref in refs.items():
            try:
                code, signalled = ray.get(ref, timeout=0)
                self._pull(self.agents[name])  # what its role wrote as it stopped
            except Exception as e:  # not done in time, or the agent (its node) is gone
                log.debug("%s: no exit code from its agent at stop: %s", name, e)
                code, signalled = (NODE_LOST if name in running else None), True
            # A role that ended on its own just before the stop is not recorded as stopped.
            by = {"stopped_by": "launcher"} if signalled else {}
            if code is not None:
                self._event(name, "exit", exit_code=code, **by)
        for ag in self.agents.values():
            ag.pid, ag.pending = None, None
        self._write_pids()

    def reap(self, role: Role) -> int:
        ag = self.agents.get(role.name)
        if ag is None:
            return NODE_LOST
        try:
            code = self._call(ag, "reap")
        except Exception as e:
            return self._lose(role, type(e).__name__)
        role.last_pid, ag.pid = ag.pid or role.last_pid, None
        return NODE_LOST if code is None else code

    def close(self) -> None:
        """Stop every role, end every agent and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self.stop_all()
        if self.departures is not None:
            self.departures.close()
            self.departures = None
        for ag in self.agents.values():
            try:
                self._call(ag, "close", timeout_s=STOP_GRACE_S)
            except Exception as e:
                log.debug("closing an agent: %s", e)
            ray.kill(ag.handle)
        self.agents.clear()
        remove_placement_group(self.pg)

    # ---------------------------------------------------------------- records
    def _write_pids(self) -> None:
        import json

        data = {
            "launcher": os.getpid(),
            "launch_id": self.launch_id,
            "roles": {
                r.name: (self.agents[r.name].pid if r.name in self.agents else None)
                for r in self.roles
            },
            "nodes": {name: ag.where for name, ag in self.agents.items()},
        }
        tmp = self.run_dir / ".pids.json.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.run_dir / "pids.json")


def _said(e: BaseException) -> str:
    """An agent's failure in one line: its type and the last line of its message, for a
    task that raised on its node its cause's (the task error's message is the traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1][:300]}" if lines else type(e).__name__
