"""The roles of a run, shared by both launchers: which processes it has, in what order, on
which cores or GPUs, with what command lines (``commands.txt``), and :func:`drive`, which
starts them under a supervisor and runs it to the end.
"""

from __future__ import annotations

import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import TypeGuard

from asyncrl.config import Config
from asyncrl.config.ending import ended_whole, new_run
from asyncrl.launch import startup
from asyncrl.launch.supervise import Role, Supervisor
from asyncrl.metrics import METRICS_FILE, set_aside

log = logging.getLogger("asyncrl.launch")


def omp_bind(cpus: list[int], ranks: int) -> str:
    """vLLM's CPU thread binding for a server on ``cpus``: one list per tensor-parallel
    rank, ``|`` between them (``0,1|2,3``); the config check asks for a core per rank."""
    per_rank = max(1, len(cpus) // max(ranks, 1))
    parts = [cpus[r * per_rank : (r + 1) * per_rank] for r in range(ranks)] if ranks > 1 else [cpus]
    return "|".join(",".join(map(str, part)) for part in parts)


def plan_roles(cfg: Config, config_path: Path) -> list[Role]:
    """The processes of a job, in start order (buffer, rollout servers, learner)."""
    py = sys.executable
    cpus = cfg.launch.cpus or {}
    gpus = cfg.launch.gpus or {}
    buffer = [py, "-m", "buffer.main", str(config_path)]
    roles = [Role("buffer", buffer, cpus=_ids(cpus, "buffer"), nice=_nice(cfg, "buffer"))]
    for i in range(cfg.rollout.num_servers):
        env: dict[str, str] = {}
        server_cpus = _ids(cpus, "rollout", i)
        if server_cpus is not None:  # vLLM's OpenMP threads on exactly these cores
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(
                server_cpus, cfg.rollout.tensor_model_parallel_size
            )
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
                nice=_nice(cfg, "rollout", i),
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
            restart_args=learner_restart_args(cfg),
            nice=_nice(cfg, "learner"),
        )
    )
    return roles


def learner_restart_args(cfg: Config) -> list[str]:
    """What a restarted learner adds to its command: ``resume_mode=auto``, so it continues
    from the run's last checkpoint, or before the first one from what its first start
    loaded (``auto`` falls back to ``resume_from_path``). A first start under ``disable``
    loaded nothing: its restart must not load a ``resume_from_path`` left in the config
    (veRL reads that key only under ``resume_path``), which would swap the run for
    another one's weights, step and data cursor."""
    args = ["trainer.resume_mode=auto"]
    if cfg.trainer.resume_mode == "disable":
        args.append("trainer.resume_from_path=null")
    return args


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


def _nice(cfg: Config, role: str, server: int = 0) -> int:
    """A role's niceness from ``launch.nice`` (rollout: its server's, or the one for all)."""
    value = (cfg.launch.nice or {}).get(role, 0)
    return value[server] if isinstance(value, list) else value


def _flat(ids: object) -> TypeGuard[list[int]]:
    return isinstance(ids, list) and all(isinstance(x, int) for x in ids)


def commands_text(roles: list[Role], bundles: dict[str, int] | None = None) -> str:
    """``commands.txt``: each role's environment and command line (and its Ray bundle)."""
    return "".join(
        f"{r.name}: {' '.join(f'{k}={v}' for k, v in r.env.items())} {shlex.join(r.cmd)}"
        + (f"  # nice {r.nice}" if r.nice else "")
        + (f"  # bundle {bundles[r.name]}" if bundles else "")
        + "\n"
        for r in roles
    )


def drive(sup: Supervisor, run_dir: Path, cfg: Config) -> int:
    """Start every role and supervise the run to its end; the launcher's exit code.
    Ctrl-C and SIGTERM stop only the processes the run started (exit 130 and 143, as a
    shell reports a process those signals ended: a scheduler reading 143 sees its own
    SIGTERM)."""
    terminated = []

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C
        terminated.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    if new_run(cfg):  # the learner would too, but one that fails first left them on view
        set_aside(run_dir / METRICS_FILE)
    try:
        startup.begin(run_dir)
        sup.begin()
        sup.start_all()
        from asyncrl.launch.progress import ProgressView

        return sup.run(ProgressView(run_dir, cfg))
    except KeyboardInterrupt:
        log.warning("interrupted: stopping the roles this launcher started")
        # A second signal must not cut the stopping short and leave roles running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sup.stop_all()
        log.warning("%s", _resume_hint(run_dir, cfg))
        return 128 + signal.SIGTERM if terminated else 130
    finally:
        sup.close()  # nothing the run started outlives it, however the launcher ends


def _resume_hint(run_dir: Path, cfg: Config) -> str:
    """What an interrupted run resumes from when the same command is run again."""
    from asyncrl.config.inputs import scan_checkpoints

    found, _ = scan_checkpoints(run_dir / "checkpoints")
    if cfg.trainer.resume_mode != "auto":
        return "stopped; trainer.resume_mode is not auto, so a new launch does not resume here"
    if found and ended_whole(cfg, run_dir, step := max(found)):  # stopped in its wind-down
        return f"stopped; the run had ended whole at step {step}: the same command starts nothing"
    if not found and cfg.trainer.resume_from_path:  # auto falls back to it (learner.restore)
        return (
            "stopped before the first checkpoint: the same command starts again from "
            f"trainer.resume_from_path={cfg.trainer.resume_from_path}"
        )
    if not found:
        return (
            "stopped before the first checkpoint: the same command starts the run over "
            "(trainer.save_freq sets how often one is written)"
        )
    return f"stopped; the same command resumes the run from its checkpoint at step {max(found)}"
