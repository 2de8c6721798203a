"""``asyncrl-launch CONFIG [overrides]``: run every role of a job on this machine.

Starts the buffer, ``rollout.num_servers`` rollout servers and the learner (under
``torchrun`` when ``trainer.nproc`` > 1) as child processes, each with its log in
``<run dir>/logs/``, pinned to the cores (or GPUs) ``launch.cpus`` / ``launch.gpus`` give
it. The resolved config and each role's command line are written to the run directory, so
any role can be restarted by hand. While the job runs, a live line shows its progress
(from ``<run dir>/metrics.jsonl`` and ``launch.jsonl``); at the end a summary table and
plots.

A role that dies is restarted (the learner from its last checkpoint) within the limits of
``launch.max_restarts``, ``launch.restart_window_s`` and ``launch.restart_backoff_s``, its
whole process tree killed first; a role that exits 0 on its own (a rollout server sent
SIGTERM to scale down: it leaves the run) is not. See :mod:`asyncrl.supervise`.

Exit: 0 when the learner finishes (the coordinator then ends the run and the other roles
exit on their own); a role's exit code (128 + N for signal N), with its last log lines,
when it dies once more after its restarts are used up; 130 on Ctrl-C / SIGTERM after
stopping only the processes it started, gently (SIGTERM) then firmly (SIGKILL). However it
ends, no process the run started outlives it.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import TypeGuard

from asyncrl import startup
from asyncrl.cli import parse_role_args
from asyncrl.config import Config, write_resolved
from asyncrl.config.inputs import DATA, MODEL, REWARD
from asyncrl.supervise import RestartPolicy, Role, Supervisor
from asyncrl.supervise_leave import Departures

log = logging.getLogger("asyncrl.launch")


def plan_roles(cfg: Config, config_path: Path) -> list[Role]:
    """The processes of a job, in start order (buffer, rollout servers, learner)."""
    py = sys.executable
    cpus = cfg.launch.cpus or {}
    gpus = cfg.launch.gpus or {}
    roles = [Role("buffer", [py, "-m", "buffer.main", str(config_path)], cpus=_ids(cpus, "buffer"))]
    for i in range(cfg.rollout.num_servers):
        env: dict[str, str] = {}
        server_cpus = _ids(cpus, "rollout", i)
        if server_cpus is not None:  # vLLM's OpenMP threads on exactly these cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, server_cpus))
            # The rest of the server starts on every core and pins itself once its engine
            # is up: its start-up is imports that one shared core would serialise (see
            # rollout_servers.affinity).
            env["ASYNCRL_PIN_CPUS"] = ",".join(map(str, server_cpus))
            # Thread pools sized for the cores it will have, not the ones it starts on:
            # an OpenMP pool of two threads later pinned to one core spins against itself
            # (measured: the demo's generation 5x slower).
            env["OMP_NUM_THREADS"] = str(len(server_cpus))
        server_gpus = _ids(gpus, "rollout", i)
        if server_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, server_gpus))
        roles.append(
            Role(
                f"rollout-{i}",
                [py, "-m", "rollout_servers.main", str(config_path), "--server-id", f"rollout-{i}"],
                env=env,
                server_id=f"rollout-{i}",
            )
        )
    learner = [py, "-m", "learner.main", str(config_path)]
    if cfg.trainer.nproc > 1:
        learner = [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={cfg.trainer.nproc}",
            "-m",
            "learner.main",
            str(config_path),
        ]
    learner_gpus = _ids(gpus, "learner")
    env = (
        {"CUDA_VISIBLE_DEVICES": ",".join(map(str, learner_gpus))}
        if learner_gpus is not None
        else {}
    )
    roles.append(
        Role(
            "learner",
            learner,
            env=env,
            cpus=_ids(cpus, "learner"),
            restart_args=["trainer.resume_mode=auto"],
        )
    )
    return roles


def _ids(
    table: dict[str, list[int] | list[list[int]]], role: str, server: int = -1
) -> list[int] | None:
    """One process's core or GPU ids: ``table[role]``, or rollout ``server``'s list in it
    (the config rules refuse any other shape); None when the table leaves the role out."""
    if role not in table:
        return None
    ids = table[role] if server < 0 else table[role][server]
    assert _flat(ids), f"launch: {role} ids {ids!r} are not one list"
    return ids


def _flat(ids: object) -> TypeGuard[list[int]]:
    return isinstance(ids, list) and all(isinstance(x, int) for x in ids)


def commands_text(roles: list[Role], bundles: dict[str, int] | None = None) -> str:
    """``commands.txt``: each role's environment and command line (and its Ray bundle)."""
    return "".join(
        f"{r.name}: {' '.join(f'{k}={v}' for k, v in r.env.items())} {shlex.join(r.cmd)}"
        + (f"  # bundle {bundles[r.name]}" if bundles else "")
        + "\n"
        for r in roles
    )


def drive(sup: Supervisor, run_dir: Path, cfg: Config) -> int:
    """Start every role and supervise the run to its end; the launcher's exit code.
    Ctrl-C and SIGTERM stop only the processes the run started (130)."""

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        startup.begin(run_dir)
        sup.begin()
        sup.start_all()
        from asyncrl.progress import ProgressView

        return sup.run(ProgressView(run_dir, cfg))
    except KeyboardInterrupt:
        log.warning("interrupted: stopping the roles this launcher started")
        # A second signal must not cut the stopping short and leave roles running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sup.stop_all()
        return 130
    finally:
        sup.close()  # nothing the run started outlives it, however the launcher ends


def _launch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray",
        action="store_true",
        help="place the roles on a Ray cluster (launch.backend=ray; see launch.ray.*)",
    )


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_role_args(
        "asyncrl-launch",
        "Start the buffer, the rollout servers and the learner of one run on this machine "
        "(or, with --ray, on a Ray cluster).",
        None,
        argv,
        extra=_launch_options,
        needs=(MODEL, DATA, REWARD),  # found missing here, before any role starts
    )
    if args.ray or cfg.launch.backend == "ray":
        from asyncrl.launch_ray import main_ray

        return main_ray(cfg)
    from asyncrl.config import run_dir as run_dir_of

    run_dir = run_dir_of(cfg)
    config_path = write_resolved(cfg)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    roles = plan_roles(cfg, config_path)
    (run_dir / "commands.txt").write_text(commands_text(roles))
    log.info("run directory %s; logs in %s", run_dir, log_dir)
    sup = Supervisor(roles, run_dir, RestartPolicy.from_config(cfg.launch))
    sup.departures = Departures.from_config(cfg)
    return drive(sup, run_dir, cfg)


if __name__ == "__main__":
    raise SystemExit(main())
