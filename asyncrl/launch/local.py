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
whole process tree killed first; a rollout server that exits 0 on its own (sent SIGTERM
to scale down: it leaves the run) is not, while a buffer that exits 0 with the learner still
running (30 s on) is, as after a crash. See :mod:`asyncrl.launch.supervise`.

Exit: 0 when the learner finishes (the coordinator then ends the run and the other roles
exit on their own); a role's exit code (128 + N for signal N), with its last log lines,
when it dies once more after its restarts are used up; 130 on Ctrl-C, 143 on SIGTERM, after
stopping only the processes it started, gently (SIGTERM) then firmly (SIGKILL); 2 before
anything starts when the config cannot run, or another live launch holds this run's
directory or a port the user chose (:mod:`asyncrl.launch.ports`: a default port that is
taken moves to a free one instead). However it ends, no process the run started outlives it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from asyncrl.cli import parse_role_args
from asyncrl.config import ConfigError, write_resolved
from asyncrl.config import run_dir as run_dir_of
from asyncrl.config.advisories import config_advisories
from asyncrl.config.ending import complete_line, data_spent_at, finished_step, resumed_step
from asyncrl.config.inputs import (
    DATA,
    LOGGER,
    MODEL,
    RESUME,
    REWARD,
    ROWS,
    short_data_line,
    total_training_steps,
)
from asyncrl.config.machine import cores_problem, device_problem, gpu_sharing_problem
from asyncrl.config.resumed import launch_line
from asyncrl.launch.departures import Departures
from asyncrl.launch.ports import claim, hold_run_dir
from asyncrl.launch.roles import commands_text, drive, plan_roles
from asyncrl.launch.supervise import RestartPolicy, Supervisor
from asyncrl.net.security import keys_problem

log = logging.getLogger("asyncrl.launch")


def _launch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray",
        action="store_true",
        help="place the roles on a Ray cluster (launch.backend=ray; see launch.ray.*)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ray" in argv:  # launch.backend=ray, so that every config rule reads it so
        argv.append("launch.backend=ray")
    cfg, args = parse_role_args(
        "asyncrl-launch",
        "Start the buffer, the rollout servers and the learner of one run on this machine "
        "(or, with --ray, on a Ray cluster).",
        None,
        argv,
        extra=_launch_options,
        needs=(
            MODEL,
            DATA,
            ROWS,
            REWARD,
            RESUME,
            LOGGER,
        ),  # found missing here, before any role starts
    )
    if (step := finished_step(cfg)) is not None:  # what auto would resume is the end
        spent = data_spent_at(run_dir_of(cfg))
        log.warning("%s", complete_line(step, total_training_steps(cfg), spent))
        return 0
    if args.ray or cfg.launch.backend == "ray":
        from asyncrl.launch.ray_main import main_ray

        return main_ray(cfg)
    # What only this machine can answer (Ray's nodes check their own, and Ray drops the
    # launch.cpus / launch.gpus pins): every role runs here.
    here = [
        cores_problem(cfg),
        gpu_sharing_problem(cfg),
        device_problem(cfg),
        keys_problem(cfg.endpoints),
    ]
    if problems := [p for p in here if p is not None]:
        sys.stderr.write(f"asyncrl-launch: {ConfigError(problems)}\n")
        return 2
    if cfg.launch.ray.learner_nodes > 1:
        sys.stderr.write(
            f"asyncrl-launch: launch.ray.learner_nodes={cfg.launch.ray.learner_nodes} (veRL's "
            "trainer.nnodes): a learner over several nodes needs --ray (or "
            "launch.backend=ray); this launcher runs one machine\n"
        )
        return 2
    run_dir = run_dir_of(cfg)
    try:  # before anything starts: another run on this machine may hold them
        held = hold_run_dir(run_dir)  # noqa: F841 - locked while this launcher lives
        cfg = claim(cfg)
    except ConfigError as e:
        sys.stderr.write(f"asyncrl-launch: {e}\n")
        return 2
    for line in config_advisories(cfg):  # the learner logs them too, in its own log
        log.warning("%s", line)
    if (short := short_data_line(cfg)) is not None:
        log.warning("%s", short)
    if (step := resumed_step(cfg)) is not None:
        log.warning(
            "resuming this run from its checkpoint at step %d (trainer.resume_mode=auto; "
            "trainer.resume_mode=disable starts over, keeping its checkpoints aside)",
            step,
        )
        if (changed := launch_line(cfg)) is not None:
            log.warning("%s", changed)
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
