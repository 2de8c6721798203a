"""``asyncrl-learner CONFIG [overrides]``: the FSDP2 learner; rank 0 hosts the coordinator.

Run it directly for one rank, or under ``torchrun --nproc-per-node N -m learner.main`` for
N ranks. The config is parsed and validated before torch is imported.
"""

from __future__ import annotations

import logging

from asyncrl.cli import parse_role_args
from asyncrl.config import ConfigError
from asyncrl.config.inputs import DATA, DEVICE, LOGGER, MODEL, RESUME
from asyncrl.launch.restart_policy import CONFIG_ERROR, FINAL_EXITS, mark_final_exit

log = logging.getLogger("learner")


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_role_args(
        "asyncrl-learner",
        "Train on the buffer's batches and push weights.",
        None,
        argv,
        needs=(MODEL, DATA, RESUME, LOGGER, DEVICE),
    )
    import os

    from asyncrl.config import run_dir
    from asyncrl.config.advisories import config_advisories
    from asyncrl.launch import startup
    from asyncrl.net import security
    from asyncrl.net.taken import endpoint_listens, exit_unless_free

    security.configure(cfg.endpoints, "learner")

    # Rank 0 binds these for the weight-sync store and the coordinator as it starts.
    listens = endpoint_listens(cfg.endpoints, "sync_store", "tasks", "control")
    try:
        if os.environ.get("RANK", "0") == "0":
            startup.mark(run_dir(cfg), "learner", "started")
            for line in config_advisories(cfg):
                log.warning("%s", line)
            exit_unless_free("learner", listens)  # before the model loads
        code = _run(cfg, listens)
    except SystemExit as e:  # a taken port (asyncrl.net.taken): CONFIG_ERROR
        if e.code not in FINAL_EXITS:
            raise
        code = int(e.code)  # pyright: ignore[reportArgumentType]  (in FINAL_EXITS: an int)
    if code in FINAL_EXITS:  # said where the launcher looks: torchrun would turn it into 1
        mark_final_exit(run_dir(cfg), code)
    return code


def _run(cfg, listens) -> int:
    """The learner from its construction to its end: its exit code."""
    from asyncrl.net.taken import exit_if_taken
    from learner.loop import LearnerLoop

    try:
        with exit_if_taken("learner", listens):
            loop = LearnerLoop(cfg)
        return loop.run()
    except ConfigError as e:  # found at start-up (a resume path that is no checkpoint, a
        # weight sync the servers could not read)
        log.error("cannot start: %s", "; ".join(e.problems))
        return CONFIG_ERROR  # the launcher does not restart it: it would fail the same way


if __name__ == "__main__":
    raise SystemExit(main())
