"""What ``asyncrl-launch --ray`` places where: the placement group's bundles, each role's
bundle and GPUs, and the learner split over several nodes. Pure: no Ray, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config import Config
from asyncrl.launch.supervise import Role


@dataclass(frozen=True)
class Placement:
    """Bundles of the run's placement group, and each role's bundle and GPUs."""

    bundles: list[dict[str, float]]
    bundle_of: dict[str, int]
    gpus_of: dict[str, float]

    @property
    def kinds(self) -> list[str]:
        """Each bundle's kind, ``learner`` (the buffer's and the learner nodes') or
        ``rollout``: the ``launch.ray.*`` keys that sized it."""
        learner = {b for r, b in self.bundle_of.items() if r == "buffer" or r.startswith("learner")}
        return ["learner" if i in learner else "rollout" for i in range(len(self.bundles))]


def drop_local_pins(cfg: Config) -> list[str]:
    """Clear ``launch.cpus`` and ``launch.gpus`` in ``cfg``, one line each for those set:
    they pin roles to one machine's core and GPU ids (``CUDA_VISIBLE_DEVICES``), which
    under Ray would override the GPUs Ray gave each role's bundle, or name ids its node
    lacks."""
    out = []
    for kind in ("cpus", "gpus"):
        if getattr(cfg.launch, kind):
            out.append(
                f"launch.{kind} pins roles to one machine's ids; under Ray each role has the "
                f"CPUs and GPUs Ray gave its bundle (launch.ray.*), so launch.{kind} is not "
                "applied"
            )
            setattr(cfg.launch, kind, None)
    return out


def learner_roles(cfg: Config, roles: list[Role], host: str) -> list[Role]:
    """``roles`` with the learner split over ``launch.ray.learner_nodes`` nodes: one
    ``torchrun`` per node (``trainer.nproc`` ranks each) meeting at ``host``; the extra
    nodes' roles are named ``learner-<k>`` and come before ``learner`` (node 0, the last
    role: its exit 0 ends the run)."""
    nodes = cfg.launch.ray.learner_nodes
    if nodes == 1:
        return roles
    *others, learner = roles
    py = learner.cmd[0]
    config_path = learner.cmd[-1]

    def torchrun(rank: int) -> list[str]:
        return [
            py,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            f"--node-rank={rank}",
            f"--nproc-per-node={cfg.trainer.nproc}",
            f"--master-addr={host}",
            f"--master-port={cfg.launch.ray.rdzv_port}",
            "-m",
            "learner.main",
            config_path,
        ]

    def role(name: str, rank: int) -> Role:
        return Role(
            name, torchrun(rank), learner.env, learner.cpus, restart_args=learner.restart_args
        )

    return [*others, *(role(f"learner-{k}", k) for k in range(1, nodes)), role("learner", 0)]


def plan_placement(cfg: Config, roles: list[Role]) -> Placement:
    """Bundle 0: the buffer and learner node 0; bundles 1..L-1: the other learner nodes;
    then one bundle per rollout server. GPUs only where the roles compute on CUDA."""
    ray_cfg = cfg.launch.ray
    cuda = cfg.trainer.device == "cuda"
    learner_gpus = float(cfg.trainer.nproc) if cuda else 0.0
    rollout_gpus = float(cfg.rollout.tensor_model_parallel_size) if cuda else 0.0

    def bundle(cpus: float, gpus: float, kind: str) -> dict[str, float]:
        out = {"CPU": cpus, "GPU": gpus, **ray_cfg.resources.get(kind, {})}
        return {k: float(v) for k, v in out.items() if v > 0}

    bundles = [
        bundle(ray_cfg.learner_cpus, learner_gpus, "learner") for _ in range(ray_cfg.learner_nodes)
    ]
    bundle_of: dict[str, int] = {}
    gpus_of: dict[str, float] = {}
    for role in roles:
        if role.name == "buffer":
            bundle_of[role.name], gpus_of[role.name] = 0, 0.0
        elif role.name == "learner":
            bundle_of[role.name], gpus_of[role.name] = 0, learner_gpus
        elif role.name.startswith("learner-"):
            bundle_of[role.name] = int(role.name.split("-")[1])
            gpus_of[role.name] = learner_gpus
        else:  # a rollout server
            bundle_of[role.name], gpus_of[role.name] = len(bundles), rollout_gpus
            bundles.append(bundle(ray_cfg.rollout_cpus, rollout_gpus, "rollout"))
    return Placement(bundles, bundle_of, gpus_of)


def unshared_learner_problem(role: str, placement: Placement, shared: bool) -> str | None:
    """Why ``role``, started on a node that does (``shared``) or does not share the
    launcher's run directory, cannot run (None: it can). A learner over several nodes
    saves each checkpoint from every node's ranks into one folder that rank 0 renames
    whole, so only a run directory on a shared file system puts it together; a node
    without one would write shards nobody can resume from."""
    learners = [name for name in placement.bundle_of if name.startswith("learner")]
    if shared or len(learners) < 2 or role not in learners:
        return None
    return (
        f"{role} runs on a node that does not share the launcher's run directory; a learner "
        f"over {len(learners)} nodes saves every checkpoint from all of them into one "
        "folder: put trainer.default_local_dir on a file system the nodes share, or set "
        "launch.ray.learner_nodes=1"
    )
