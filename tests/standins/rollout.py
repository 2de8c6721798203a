"""Stand-in rollout server: a real process that plays a rollout server without vLLM.

It registers with the coordinator, heartbeats, takes tasks, answers every task with the
same fixed response (``n`` times), pushes each group whole to the buffer with a
:class:`~asyncrl.net.transport.TrajectoryPusher` and then acknowledges the task. With
``--weights`` it also takes part in weight syncs (one engine rank) and keeps the received
tensors; without, it takes no part in syncs and adopts announced versions.

Test hooks: ``--journal`` writes one JSON line per event (registered, task, ack, hold,
sync, exit), flushed at once, so a test can read what a killed process had done;
``--hold-after K`` makes it hold the first grant that arrives after K acknowledged tasks
without pushing it (still heartbeating), so a kill leaves known tasks unacknowledged.

Run it as ``python -m tests.standins.rollout CONFIG [overrides] --server-id ID``. It exits
0 when the coordinator announces shutdown or on SIGTERM/SIGINT (after leaving), 3 when
the coordinator stays silent past ``launch.start_timeout_s``.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.cli import role_parser, setup_logging
from asyncrl.config import Config, ConfigError, load_config
from asyncrl.control.client import CoordinatorClient, CoordinatorGone
from asyncrl.control.messages import SyncStart, Task
from tests.standins.harness import standin_env

log = logging.getLogger("tests.standins.rollout")

FIXED_RESPONSE = (7, 8, 9)  # token ids of every response
FIXED_LOGPROB = -0.5


class Journal:
    """JSON lines, one per event, flushed immediately (a SIGKILL loses nothing written)."""

    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_journal(path: str) -> list[dict[str, Any]]:
    """The events a stand-in wrote (none yet if it has not started; a last line cut by a
    kill is skipped)."""
    out: list[dict[str, Any]] = []
    if not Path(path).exists():
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def fixed_group(task: Task, server_id: str, version: int, cfg: Config) -> list[Any]:
    """The ``task.n`` trajectories of a task, all with the fixed response."""
    from asyncrl.wire import Trajectory

    text = "\n".join(str(msg.get("content", "")) for msg in task.prompt)
    prompt = [b % 256 for b in text.encode()][: cfg.data.max_prompt_length] or [0]
    response = list(FIXED_RESPONSE[: cfg.data.max_response_length])
    now = time.time()
    return [
        Trajectory.build(
            task_id=task.task_id,
            prompt_ids=prompt,
            response_ids=response,
            logprobs=[FIXED_LOGPROB] * len(response),
            policy_version=version,
            reward=0.0,
            group_index=i,
            group_size=task.n,
            validation=task.validation,
            data_source=task.data_source,
            server_id=server_id,
            created_at=now,
            finished_at=now,
        )
        for i in range(task.n)
    ]


class StandInRollout:
    """The stand-in's main loop; see the module docstring."""

    def __init__(
        self,
        cfg: Config,
        server_id: str,
        *,
        weights: bool = False,
        journal: str | None = None,
        hold_after: int | None = None,
        task_delay_s: float = 0.0,
        probe: bool = False,
        corrupt_from: int | None = None,
        fail_val_rows: tuple[int, ...] = (),
    ):
        from tests.standins.weights import ProbeScorer

        self.scorer = ProbeScorer(cfg.model.path) if probe else None
        self.corrupt_from = corrupt_from  # from this version on, a received tensor is flipped
        self.fail_val_rows = fail_val_rows  # validation rows whose tasks fail here every time
        self.cfg = cfg
        self.server_id = server_id
        self.weights = weights
        self.hold_after = hold_after
        self.task_delay_s = task_delay_s
        self.journal = Journal(journal)
        self.stop = threading.Event()
        self.client = CoordinatorClient.from_config(
            cfg,
            server_id,
            engine_world_size=1 if weights else 0,
            address=f"pid {_pid()}",
            timeout_s=min(5.0, cfg.launch.start_timeout_s),
        )
        self.received: dict[str, Any] = {}  # name -> tensor, with --weights
        self._store = None
        self._group = None
        self._generation = ""
        self.acked = 0

    def run(self) -> int:
        """Consumes grants and sync starts; produces groups, acks and sync reports. Waits in
        the coordinator's long-polls (task request, at most ``heartbeat_s``) and in sync
        collectives (each bounded by the sync timeout). Ends at shutdown (0), SIGTERM (0)
        or when the coordinator is gone (3)."""
        from asyncrl.net.transport import TrajectoryPusher, config_endpoint

        if self.weights:
            # Load torch before registering, as a real server has its engine up first:
            # importing it holds the GIL for a while and would starve the heartbeat.
            import torch  # noqa: F401
        try:
            reg = self.client.register()
        except CoordinatorGone as e:
            log.error("%s", e)
            return 3
        self.journal.write("registered", version=reg.policy_version, catchup=reg.catchup)
        self.client.start_watching()
        pusher = TrajectoryPusher(config_endpoint(self.cfg.endpoints, "trajectories"))
        try:
            self._loop(pusher)
        finally:
            code = 3 if self.client.gone.is_set() else 0
            if code == 0:
                self.client.leave("shutdown" if self.client.shutdown.is_set() else "stopped")
            pusher.close()
            self.client.close()
            self.journal.write("exit", code=code, acked=self.acked)
            self.journal.close()
        return code

    def _loop(self, pusher: Any) -> None:
        held: list[str] = []
        c = self.client
        while not (self.stop.is_set() or c.shutdown.is_set() or c.gone.is_set()):
            start = c.next_sync()
            if start is not None:
                self._sync(start)
                continue
            if held:  # a test holds these until it kills us
                self.stop.wait(0.05)
                continue
            grant = c.request_tasks()
            for task in grant.tasks:
                self.journal.write(
                    "task", task_id=task.task_id, attempt=task.attempt, val=task.validation
                )
            if grant.tasks and self.hold_after is not None and self.acked >= self.hold_after:
                held = [t.task_id for t in grant.tasks]
                self.journal.write("hold", task_ids=held)
                continue
            for task in grant.tasks:
                self._answer(task, pusher)

    def _answer(self, task: Task, pusher: Any) -> None:
        if self.task_delay_s:
            time.sleep(self.task_delay_s)
        if task.validation and int(task.task_id.rsplit("/", 1)[1]) in self.fail_val_rows:
            self.client.nack([task.task_id], "a validation row that fails every time")
            self.journal.write("nack", task_id=task.task_id)
            return
        version = self.client.policy_version
        pusher.send(fixed_group(task, self.server_id, version, self.cfg))
        self.client.ack([task.task_id])
        self.acked += 1
        self.client.metrics = {"rollout/groups_pushed": float(self.acked)}
        self.journal.write("ack", task_id=task.task_id, version=version)

    def _sync(self, start: SyncStart) -> None:
        """Join the sync group (reused while the generation is unchanged) and receive."""
        from asyncrl.sync.groups import form_group, open_store, store_prefix
        from asyncrl.sync.weights import receive_weights
        from tests.standins.weights import digest

        t0 = time.monotonic()
        try:
            if not self.weights:
                raise RuntimeError("this stand-in holds no weight receiver (start with --weights)")
            reg = self.client.registered
            assert reg is not None
            if start.generation != self._generation:
                # A fresh store client per group: a restarted learner hosts a new store at
                # the same address, and an old connection to it is broken.
                self._store = open_store(
                    reg.sync_store_host,
                    reg.sync_store_port,
                    is_host=False,
                    timeout_s=start.timeout_s,
                )
                self._group, self._generation = None, ""
                self._group = form_group(
                    self._store,
                    store_prefix(reg.sync_secret, start.generation),
                    start.rank,
                    start.world_size,
                    backend=start.backend,
                    timeout_s=start.timeout_s,
                )
                self._generation = start.generation
            for name, t in receive_weights(self._group, start.plan, timeout_s=start.timeout_s):
                self.received[name] = t.clone()
            if self.corrupt_from is not None and start.version >= self.corrupt_from:
                first = sorted(self.received)[0]  # as if its bucket arrived with bits flipped
                self.received[first] = -self.received[first]
        except Exception as e:  # reported to the coordinator, which drops us from the group
            self._group, self._generation = None, ""
            log.warning("sync %d failed: %s", start.sync_id, e)
            self.journal.write("sync", sync_id=start.sync_id, version=start.version, ok=False)
            self.client.sync_done(start, ok=False, error=f"{type(e).__name__}: {e}")
            return
        seconds = time.monotonic() - t0
        checksum = digest(self.received)
        probe = self.scorer.score(self.received) if self.scorer is not None else None
        self.client.sync_done(start, ok=True, seconds=seconds, checksum=checksum, probe=probe)
        self.journal.write(
            "sync",
            sync_id=start.sync_id,
            version=start.version,
            ok=True,
            generation=start.generation,
            catchup=start.catchup,
            checksum=checksum,
        )


def spawn(
    config_path: Path,
    server_id: str,
    *,
    journal: Path | None = None,
    weights: bool = False,
    hold_after: int | None = None,
    task_delay_s: float = 0.0,
    log_path: Path | None = None,
    probe: bool = False,
    corrupt_from: int | None = None,
) -> subprocess.Popen:
    """Start a stand-in rollout process (its log to ``log_path``)."""
    cmd = [sys.executable, "-m", "tests.standins.rollout", str(config_path)]
    cmd += ["--server-id", server_id, "--task-delay-s", str(task_delay_s)]
    if journal is not None:
        cmd += ["--journal", str(journal)]
    if weights:
        cmd.append("--weights")
    if hold_after is not None:
        cmd += ["--hold-after", str(hold_after)]
    if probe:
        cmd.append("--probe")
    if corrupt_from is not None:
        cmd += ["--corrupt-from", str(corrupt_from)]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=standin_env())


def main(argv: Sequence[str] | None = None) -> int:
    parser = role_parser(
        "tests.standins.rollout", "Stand-in rollout server (fixed responses, no vLLM).", None
    )
    parser.add_argument("--server-id", required=True)
    parser.add_argument("--weights", action="store_true", help="take part in weight syncs")
    parser.add_argument("--journal", help="append one JSON line per event to this file")
    parser.add_argument("--hold-after", type=int, help="hold the grant after K acked tasks")
    parser.add_argument("--task-delay-s", type=float, default=0.0, help="time per task")
    parser.add_argument("--probe", action="store_true", help="score the post-sync probe")
    parser.add_argument("--corrupt-from", type=int, help="flip a received tensor from version V")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        sys.stderr.write(f"{parser.prog}: {e}\n")
        return 2
    standin = StandInRollout(
        cfg,
        args.server_id,
        weights=args.weights,
        journal=args.journal,
        hold_after=args.hold_after,
        task_delay_s=args.task_delay_s,
        probe=args.probe,
        corrupt_from=args.corrupt_from,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: standin.stop.set())
    return standin.run()


def _pid() -> int:
    import os

    return os.getpid()


if __name__ == "__main__":
    raise SystemExit(main())
