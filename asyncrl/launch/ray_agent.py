"""The node side of ``asyncrl-launch --ray``: one small agent per role, on the role's node.

An agent is a Ray actor placed in the role's placement-group bundle. It does not run the
role in its own process (our roles stay separate processes, as under the local launcher);
it starts the role's real command line as a child and supervises that child's process tree
with the local launcher's own machinery (:class:`asyncrl.launch.supervise.Supervisor`: a session
per role, the tree killed and reaped when the role ends, a watchdog that kills the tree if
the agent itself dies, say with its node). The launcher drives it with short calls:
``start``, ``poll``, ``terminate``, ``reap``; the restart rules stay in the launcher.

The role's resolved config and its log live on the agent's node, at the paths the config
names (``<run dir>/config.yaml``, ``<run dir>/logs/<role>.log``); the launcher reads them
through :meth:`RoleAgent.tail` and :meth:`RoleAgent.read`. This module never imports
``ray`` itself: the launcher wraps the class with ``ray.remote``.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

from asyncrl.config.ending import COMPLETE_FILE
from asyncrl.launch.process_tree import has_exited
from asyncrl.launch.ray_handles import NotOnNode
from asyncrl.launch.restart_policy import take_final_exit
from asyncrl.launch.supervise import STOP_GRACE_S, RestartPolicy, Role, Supervisor, tail

# Not inherited by a role: a role (vLLM above all) must not join the Ray instance its agent
# runs in, nor start one of its own (vLLM picks its Ray executor where it finds Ray).
RAY_ENV_PREFIXES = ("RAY_",)
LEARNER = "learner"  # the role whose start clears a recorded final exit (learner-k's do not)


class _NodeSupervisor(Supervisor):
    """The local supervisor for one role on this node: its records (``launch.jsonl``,
    ``pids.json``) are the launcher's to write, not this node's; the exit code of a role
    it stopped is kept for the launcher to record (see :meth:`RoleAgent.stop`), with
    whether it was signalled (a role that ended on its own just before is not)."""

    stopped_code: int | None = None
    signalled: bool = False

    def _event(self, role: str, event: str, **fields: Any) -> None:
        if event == "exit":
            self.stopped_code = fields["exit_code"]
            self.signalled = "stopped_by" in fields

    def _write_pids(self) -> None:
        pass

    def _is_learner(self, role: Role) -> bool:
        """By its name: here the role is the only one, so always the last. The buffer
        shares the learner's node (bundle 0), and its restart there must not clear the
        final exit the learner has just written."""
        return role.name == LEARNER


class RoleAgent:
    """Starts and watches one role's process tree on this node (see the module docstring).

    Every method returns at once; ``poll`` is called about once a second by the launcher.
    """

    def __init__(self, run_dir: str, name: str, launch_id: str, cwd: str):
        # Relative paths of the config resolve as at the launcher (same layout per node);
        # a node without that directory is told at the start (see _missing).
        self.missing_cwd = None if Path(cwd).is_dir() else cwd
        if self.missing_cwd is None:
            os.chdir(cwd)
        self.run_dir = Path(run_dir)
        self.name = name
        self.launch_id = launch_id
        self.sup = _NodeSupervisor([], self.run_dir, RestartPolicy())
        self.sup.begin()
        self.role: Role | None = None

    def where(self) -> dict[str, Any]:
        """Where this agent runs: node IP (Ray's view), host name, pid, and whether it
        shares the launcher's run directory (the launcher wrote its id there)."""
        import ray

        marker = self.run_dir / ".launch_id"
        shared = marker.exists() and marker.read_text() == self.launch_id
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "shared_run_dir": shared,
        }

    def write(self, files: dict[str, str]) -> None:
        """Write ``files`` (paths relative to the run directory -> text) on this node."""
        for rel, text in files.items():
            path = self.run_dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def start(
        self, cmd: list[str], env: dict[str, str], attempt: int, cpus: list[int] | None = None
    ) -> int:
        """Start the role (attempt ``attempt``, 1 for the first; pinned to ``cpus`` of this
        node if given); returns its pid. Raises :class:`NotOnNode` if its command or the
        launcher's working directory does not exist on this node."""
        if (missing := self._missing(cmd, env)) is not None:
            raise NotOnNode(missing)
        self.role = Role(self.name, cmd, env=env, cpus=cpus, unset=RAY_ENV_PREFIXES)
        self.role.attempt = attempt - 1  # Supervisor.start counts this start
        self.sup.roles = [self.role]
        try:
            self.sup.start(self.role)
        except FileNotFoundError as e:  # gone since _missing looked
            raise NotOnNode(self._not_here("command", e.filename or cmd[0])) from e
        assert self.role.proc is not None
        return self.role.proc.pid

    def _missing(self, cmd: list[str], env: dict[str, str]) -> str | None:
        """Why ``cmd`` cannot start on this node (one line naming the node and the path
        missing here), else None."""
        if self.missing_cwd is not None:
            return self._not_here("working directory", self.missing_cwd)
        path = env.get("PATH", os.environ.get("PATH", os.defpath))
        exe = cmd[0] if cmd else ""
        found = os.access(exe, os.X_OK) if os.sep in exe else shutil.which(exe, path=path)
        return None if found else self._not_here("command", exe)

    def _not_here(self, what: str, path: str) -> str:
        try:
            import ray

            node = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
        except Exception:  # outside Ray (tests)
            node = socket.gethostname()
        return (
            f"{self.name} cannot start on node {node}: its {what} {path} does not exist "
            "there (every node needs the launcher's interpreter path and working directory)"
        )

    def poll(self) -> int | None:
        """The role's exit code once it exited (its tree then killed and reaped), else None."""
        role = self.role
        if role is None or role.proc is None:
            return None
        self.sup._track()
        if not has_exited(role.proc.pid):
            return None
        return self.sup.reap(role)

    def reap(self) -> int | None:
        """Kill what is left of the role's tree and return its exit code (None: not running)."""
        if self.role is None or self.role.proc is None:
            return None
        return self.sup.reap(self.role)

    def stop(self, grace_s: float = STOP_GRACE_S) -> tuple[int | None, bool]:
        """Stop the role gently, then firmly; kill whatever of the run is left on this node.
        Returns the role's exit code (as ``Popen.returncode``; None if it was not running)
        and whether this stop signalled it (False: it had ended on its own)."""
        self.sup.stopped_code, self.sup.signalled = None, False
        self.sup.stop_all(grace_s)
        return self.sup.stopped_code, self.sup.signalled

    def tail(self, lines: int = 30) -> str:
        """The last lines of the role's log on this node."""
        return tail(self.run_dir / "logs" / f"{self.name}.log", lines)

    def read(
        self, rel: str, offset: int = 0, inode: int = 0, limit: int = 1 << 20
    ) -> tuple[int, int, bytes]:
        """``(inode, start, data)``: up to ``limit`` bytes of ``<run dir>/<rel>`` from
        ``start``, which is ``offset`` unless the file is not the one read before
        (``inode``, 0: not known) or is shorter: replaced (a learner that set it aside),
        it is read from 0; cut (a half-written last line), from its end. Absent: nothing,
        from ``offset``."""
        try:
            f = open(self.run_dir / rel, "rb")  # noqa: SIM115 (closed below)
        except OSError:
            return inode, offset, b""
        with f:
            st = os.fstat(f.fileno())  # of the file opened, even if it is replaced now
            start = offset
            if (inode and st.st_ino != inode) or (not inode and st.st_size < offset):
                start = 0
            elif st.st_size < offset:
                start = st.st_size
            f.seek(start)
            return st.st_ino, start, f.read(limit)

    def take_final_exit(self) -> int | None:
        """The learner's final exit recorded on this node (then forgotten), or None: under
        torchrun the launcher sees 1 for it (see :mod:`asyncrl.launch.restart_policy`)."""
        return take_final_exit(self.run_dir)

    def ended_since(self, wall: float) -> bool:
        """Whether the run's ending (``complete.json``) was recorded on this node at or
        after ``wall`` (the launch's start, by the launcher's clock)."""
        try:
            return (self.run_dir / COMPLETE_FILE).stat().st_mtime >= wall
        except OSError:
            return False

    def close(self) -> None:
        self.sup.close()
