"""The start of ``asyncrl-launch --ray`` (:func:`main_ray`; what it does is described in
:mod:`asyncrl.launch.ray_launcher`): hold the run directory, join the cluster at
``launch.ray.address``, reserve the run's bundles (:mod:`asyncrl.launch.ray_reserve`:
exit 130 / 143 on Ctrl-C / SIGTERM meanwhile), find bundle 0's node, hand every role the
launcher's variables of :mod:`asyncrl.launch.ray_env`, then drive the
:class:`~asyncrl.launch.ray_launcher.RaySupervisor` to the run's end.

A run directory held by another live launch is refused in one line, before anything is
written there, as by the local launcher. A cluster address that nothing answers is refused
in one line before ``ray.init``, which would otherwise retry for minutes with only Ray's
own warnings; ``auto`` with no cluster running starts a local Ray instance for the run.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.launch.departures import Departures
from asyncrl.launch.ports import hold_run_dir
from asyncrl.launch.ray_env import forward_env
from asyncrl.launch.ray_launcher import RaySupervisor
from asyncrl.launch.ray_plan import drop_local_pins, learner_roles, plan_placement
from asyncrl.launch.ray_reserve import Stopped, reserve
from asyncrl.launch.supervise import RestartPolicy

log = logging.getLogger("asyncrl.launch")

PROBE_TIMEOUT_S = 5.0  # a cluster's GCS answers a TCP connection at once; a dead one never


def cluster_problem(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """One line when nothing accepts a TCP connection at ``address`` (``host:port`` of a
    cluster's GCS, or ``ray://host:port`` of its client server) within ``timeout_s``;
    None when something does, or for ``auto``/``local``, which Ray resolves itself."""
    if address in ("auto", "local"):
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return None  # not host:port: Ray's own error says what is wrong with it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return (
            f"no Ray cluster at {address}: start one with `ray start --head`, or use "
            "launch.ray.address=auto"
        )
    return None


def connect(address: str) -> None:
    """Join the cluster at ``address``. ``auto``: the cluster ``ray start`` started on this
    machine (or ``RAY_ADDRESS``'s), and with none a local Ray instance for this run. Not
    any Ray instance found running: Ray's own ``auto`` falls back to one, which may be
    another launch's private instance, whose end (``ray.shutdown()``) would take this run's
    actors with it."""
    import ray

    quiet: dict = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address != "auto":
        ray.init(address=address, **quiet)
        return
    # Ray's default address (none given): RAY_ADDRESS, else the last `ray start`'s
    # cluster, else a new local instance; never another driver's, which "auto" would join.
    ray.init(include_dashboard=False, **quiet)


def main_ray(cfg: Config) -> int:
    """Run the job on the Ray cluster (see the module docstring); the launcher's exit code."""
    import ray

    from asyncrl.config import run_dir as run_dir_of
    from asyncrl.config import write_resolved
    from asyncrl.launch.roles import commands_text, drive, plan_roles
    from asyncrl.net.security import exposure_problem

    for line in drop_local_pins(cfg):
        log.warning("%s", line)
    # Absolute, so that every node resolves the run directory alike.
    cfg.trainer.default_local_dir = str(Path(cfg.trainer.default_local_dir).resolve())
    run_dir = run_dir_of(cfg)
    ray_cfg = cfg.launch.ray
    try:  # before anything is written there; the ports are claimed on bundle 0's node, which
        # the claims file on this machine does not see: a taken port fails its role there
        held = hold_run_dir(run_dir)  # noqa: F841 - locked while this launcher lives
    except ConfigError as e:
        sys.stderr.write(f"asyncrl-launch: {e}\n")
        return 2
    if (missing := cluster_problem(ray_cfg.address)) is not None:
        sys.stderr.write(f"asyncrl-launch: {missing}\n")
        return 2
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    connect(ray_cfg.address)
    try:
        names = learner_roles(cfg, plan_roles(cfg, run_dir / "config.yaml"), "")
        placement = plan_placement(cfg, names)
        try:
            pg = reserve(placement, ray_cfg.strategy, ray_cfg.start_timeout_s)
        except Stopped as e:  # Ctrl-C / SIGTERM while waiting: the group is removed
            return e.code
        if pg is None:
            return 1
        policy = RestartPolicy.from_config(cfg.launch)
        sup = RaySupervisor(names, run_dir, policy, placement, pg, {}, ray_cfg.start_timeout_s)
        # Bundle 0's node is where the coordinator and the buffer listen.
        host = sup._call(sup.agent(names[0]), "where", timeout_s=ray_cfg.start_timeout_s)["ip"]
        cfg.endpoints.host = sup.host = host
        if (why := exposure_problem(cfg.endpoints)) is not None:  # now a network address
            log.error("%s", why)
            return 2
        config_path = write_resolved(cfg)
        sup.roles = learner_roles(cfg, plan_roles(cfg, config_path), host)
        sup.departures = Departures.from_config(cfg)  # dials the coordinator at ``host``
        sup.files = {str(config_path.relative_to(run_dir)): config_path.read_text()}
        (run_dir / "commands.txt").write_text(commands_text(sup.roles, placement.bundle_of))
        # After commands.txt, which must not hold the keys among them.
        if forwarded := forward_env(sup.roles, os.environ):
            log.info("the roles get the launcher's %s", " ".join(forwarded))
        log.info("run directory %s; roles meet at %s; bundles %s", run_dir, host, placement.bundles)
        return drive(sup, run_dir, cfg)
    finally:
        ray.shutdown()
