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
  (waiting up to ``launch.ray.start_timeout_s``). Ctrl-C stops every role on every node.
- **Records**: ``launch.jsonl`` and ``pids.json`` as locally, plus each role's node (IP, Ray
  node id, host name) in its ``start`` events. Where a node does not share the launcher's
  run directory, the learner's metrics and every role's log are copied back as they grow,
  so the progress line and the summary read as locally.

This module imports ``ray`` only when a run starts, so ``--help`` answers at once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.launch.departures import Departures
from asyncrl.launch.ray_plan import (
    Placement,
    drop_local_pins,
    learner_roles,
    plan_placement,
    unshared_learner_problem,
)
from asyncrl.launch.supervise import STOP_GRACE_S, RestartPolicy, Role, Supervisor

log = logging.getLogger("asyncrl.launch")

NODE_LOST = -9  # the exit reported for a role whose agent (or node) is gone: as SIGKILL
CALL_TIMEOUT_S = 30.0  # one call to a live agent
MIRRORED = ("metrics.jsonl", "startup.jsonl")  # the learner's records the view reads


def connect(address: str) -> None:
    """Join the cluster at ``address``; ``auto`` with no cluster running starts a local
    Ray instance for this run."""
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError:
        if address != "auto":
            raise
        log.info("no Ray cluster is running: starting a local Ray instance for this run")
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)


class Mirror:
    """Copies files that grow on a role's node into the launcher's run directory: each
    call appends what is new (``read(rel, offset) -> bytes`` reads the node's copy)."""

    def __init__(self, run_dir: Path, files: tuple[str, ...]):
        self.run_dir = run_dir
        self.offsets = dict.fromkeys(files, 0)

    def pull(self, read: Any) -> None:
        for rel, offset in self.offsets.items():
            data = read(rel, offset)
            if data:
                path = self.run_dir / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "ab") as f:
                    f.write(data)
                self.offsets[rel] = offset + len(data)


@dataclass
class _Agent:
    """The launcher's view of one role's agent."""

    handle: Any
    pending: Any = None  # the ObjectRef of a start call not answered yet
    since: float = 0.0  # when that call was made
    pid: int | None = None  # the role's pid on its node while it runs
    where: dict[str, Any] | None = None
    mirror: Mirror | None = None  # None: the node shares the launcher's run directory


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
        self.agents: dict[str, _Agent] = {}

    # ---------------------------------------------------------------- agents
    def agent(self, role: Role) -> _Agent:
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
            self.agents[role.name] = _Agent(handle)
        return self.agents[role.name]

    def _call(self, ag: _Agent, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """One call to the agent, waited for up to ``timeout_s``."""
        import ray

        return ray.get(getattr(ag.handle, method).remote(*args), timeout=timeout_s)

    def _lose(self, role: Role, why: str) -> int:
        """The role's agent is gone (its node, most likely): forget it, report SIGKILL."""
        log.warning("%s: its agent is gone (%s): counted as killed", role.name, why)
        lost = self.agents.pop(role.name, None)
        if lost is not None and lost.pid is not None:
            role.last_pid = lost.pid
        self._write_pids()
        return NODE_LOST

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
        role.log_path = self.log_dir / f"{role.name}.log"
        ag.handle.write.remote(self.files)
        ag.pending = ag.handle.start.remote(role.command(), role.env, role.attempt, role.cpus)
        ag.since = time.monotonic()
        log.info(
            "starting %s (attempt %d) in bundle %d", role.name, role.attempt, self.bundle(role)
        )

    def bundle(self, role: Role) -> int:
        return self.placement.bundle_of[role.name]

    def _started(self, role: Role, ag: _Agent) -> int | None:
        """Collect a pending start: None while waiting (or started), an exit code if it
        failed."""
        import ray

        ready, _ = ray.wait([ag.pending], timeout=0)
        if not ready:
            waited = time.monotonic() - ag.since
            if waited > self.start_timeout_s:
                log.error(
                    "%s: no node with room for bundle %d (%s) after %.0fs "
                    "(launch.ray.start_timeout_s): add a node that offers it",
                    role.name,
                    self.bundle(role),
                    self.placement.bundles[self.bundle(role)],
                    waited,
                )
                ray.kill(ag.handle)
                return self._lose(role, "never placed")
            return None
        ag.pending = None
        try:
            ag.pid = ray.get(ready[0])
            ag.where = self._call(ag, "where")
        except Exception as e:  # the agent died before it answered
            return self._lose(role, f"{type(e).__name__}")
        assert ag.where is not None
        problem = unshared_learner_problem(role.name, self.placement, ag.where["shared_run_dir"])
        if problem is not None:
            log.error("%s", problem)
            return 2  # a config problem: not restarted, the run stops
        if not ag.where["shared_run_dir"] and ag.mirror is None:
            files = (f"logs/{role.name}.log",) + (MIRRORED if role.name == "learner" else ())
            ag.mirror = Mirror(self.run_dir, files)
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
            if ag.mirror is not None and ag.pid is not None:
                try:
                    ag.mirror.pull(lambda rel, off, a=ag: self._call(a, "read", rel, off))
                except Exception as e:  # a lost node is noticed by _look_at
                    log.debug("mirroring: %s", e)

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
            return self._lose(role, type(e).__name__)
        if code is not None:
            self._track()  # the end of its log
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
        if code is not None:
            ag.pid = None
        return code is None

    # ---------------------------------------------------------------- stopping
    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """Every agent stops its role (SIGTERM, then SIGKILL after ``grace_s``) and kills
        what is left of the run on its node."""
        import ray

        refs = [ag.handle.stop.remote(grace_s) for ag in self.agents.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=grace_s + CALL_TIMEOUT_S)
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


def main_ray(cfg: Config) -> int:
    """Run the job on the Ray cluster (see the module docstring); the launcher's exit code."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group

    from asyncrl.config import run_dir as run_dir_of
    from asyncrl.config import write_resolved
    from asyncrl.launch.roles import commands_text, drive, plan_roles
    from asyncrl.net.security import exposure_problem

    for line in drop_local_pins(cfg):
        log.warning("%s", line)
    # Absolute, so that every node resolves the run directory alike.
    cfg.trainer.default_local_dir = str(Path(cfg.trainer.default_local_dir).resolve())
    run_dir = run_dir_of(cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    ray_cfg = cfg.launch.ray
    connect(ray_cfg.address)
    try:
        names = learner_roles(cfg, plan_roles(cfg, run_dir / "config.yaml"), "")
        placement = plan_placement(cfg, names)
        pg = placement_group(placement.bundles, strategy=ray_cfg.strategy)
        try:
            ray.get(pg.ready(), timeout=ray_cfg.start_timeout_s)
        except GetTimeoutError:
            log.error(
                "the cluster cannot hold the run's bundles %s after %.0fs (free now: %s): "
                "add nodes, or lower launch.ray.*_cpus / launch.ray.resources",
                placement.bundles,
                ray_cfg.start_timeout_s,
                ray.available_resources(),
            )
            return 1
        policy = RestartPolicy.from_config(cfg.launch)
        sup = RaySupervisor(names, run_dir, policy, placement, pg, {}, ray_cfg.start_timeout_s)
        # Bundle 0's node is where the coordinator and the buffer listen.
        host = sup._call(sup.agent(names[0]), "where", timeout_s=ray_cfg.start_timeout_s)["ip"]
        cfg.endpoints.host = host
        if (why := exposure_problem(cfg.endpoints)) is not None:  # now a network address
            log.error("%s", why)
            return 2
        config_path = write_resolved(cfg)
        sup.roles = learner_roles(cfg, plan_roles(cfg, config_path), host)
        sup.departures = Departures.from_config(cfg)  # dials the coordinator at ``host``
        sup.files = {str(config_path.relative_to(run_dir)): config_path.read_text()}
        (run_dir / "commands.txt").write_text(commands_text(sup.roles, placement.bundle_of))
        log.info("run directory %s; roles meet at %s; bundles %s", run_dir, host, placement.bundles)
        return drive(sup, run_dir, cfg)
    finally:
        ray.shutdown()
