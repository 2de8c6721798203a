"""What the machine a role starts on must offer it: the model's files (or, offline, the
hub's cache), the cores ``launch.cpus`` pins roles to, and the learner's device. Each
check returns one line naming the fix, or None; :func:`asyncrl.config.inputs.input_problems`
gathers them before anything starts.

A model path shaped like a hub id (``name`` or ``org/name``) that is not a local directory
is looked up in the local HF cache only, never on the network: with ``HF_HUB_OFFLINE`` (or
``TRANSFORMERS_OFFLINE``) set, a model missing from the cache is a config error; otherwise
the roles download it (a machine that reaches a hub), and a warning says so: a relative
folder mistyped as ``models/tiny`` reads as a hub id too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from asyncrl.config.schema import Config

log = logging.getLogger(__name__)

#: What a model directory's weights are saved as (one of them must be there).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


def looks_like_hub_id(path: str) -> bool:
    """``Qwen/Qwen2.5-0.5B`` or ``gpt2``: no leading ``/ . ~`` and at most one ``/``."""
    return not path.startswith(("/", ".", "~")) and path.count("/") <= 1


def model_problem(path: str, key: str = "model.path") -> str | None:
    """Why ``path`` (the value of config ``key``) cannot be loaded as a local HF model
    directory (None if it can, or if it names a hub model)."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            return (
                f"{key}={path} is a directory without config.json: point it at an HF "
                "model directory (asyncrl-prepare model --out DIR builds a small one)"
            )
        if not any(next(local.glob(pattern), None) for pattern in WEIGHT_FILES):
            return (
                f"{key}={path} holds no weights (no *.safetensors, pytorch_model*.bin or "
                "their index): copy the model's weight files there, or point it at a complete "
                "HF model directory"
            )
        return None
    if local.exists():
        return (
            f"{key}={path} is a file: point it at the HF model directory (the folder "
            "holding config.json and the weights)"
        )
    if looks_like_hub_id(path):
        return _hub_problem(path, key)
    build = make_target(path) or f"`asyncrl-prepare model --name tiny --out {path}`"
    return (
        f"{key}={path} does not exist: build a model there with {build}, or give an "
        "existing HF model directory"
    )


#: The repository's own artifacts and the make target that builds each (the demos' models
#: are trained to a start GRPO can learn from: see the README's "Models" section).
MADE_BY = {
    "artifacts/models/tiny": "make artifacts",
    "artifacts/models/tiny-demo": "make demo-artifacts",
    "artifacts/models/tiny-agent": "make agent-artifacts",
    "artifacts/data/arithmetic": "make demo-artifacts",
    "artifacts/data/calculator": "make agent-artifacts",
    "artifacts/models/tiny-study": "make study-artifacts",
    "artifacts/data/arithmetic19": "make study-artifacts",
}


def make_target(path: str) -> str | None:
    """```make <target>``` when ``path`` (a model folder, or a data file or its folder) is
    one of the repository's artifacts (:data:`MADE_BY`), else None."""
    rel = Path(path).as_posix().removeprefix("./")
    for made, target in MADE_BY.items():
        if rel == made or rel.startswith(made + "/"):
            return f"`{target}`"
    return None


def cores_problem(cfg: Config) -> str | None:
    """Why ``launch.cpus`` cannot pin its roles on this machine: a core it names is not
    one this process may run on (a role's start would fail in a traceback)."""
    named = {
        core
        for ids in (cfg.launch.cpus or {}).values()
        for x in ids
        for core in (x if isinstance(x, list) else [x])
    }
    have = os.sched_getaffinity(0)
    if missing := sorted(named - have):
        return (
            f"launch.cpus names core(s) {missing}, which this machine does not give this "
            f"launch (it has {sorted(have)}): name cores among those"
        )
    return None


def device_problem(cfg: Config) -> str | None:
    """Why the learner cannot use ``trainer.device`` here: CUDA asked for, none found."""
    if not cfg.trainer.device.startswith("cuda"):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"trainer.device={cfg.trainer.device} but PyTorch finds no CUDA device on this machine "
        "(torch.cuda.is_available() is False): set trainer.device=cpu, or run where a GPU is"
    )


def gpu_sharing_problem(cfg: Config, gpus_here: int | None = None) -> str | None:
    """Why the learner's CUDA ranks and a rollout server would share a GPU under this
    machine's launcher: the weight push is an NCCL broadcast, and NCCL puts no two ranks
    of one group on one GPU (the first push fails, "Duplicate GPU detected", and the
    learner's restarts fail the same way). Unset ``launch.gpus`` starts every role on GPU 0.

    ``gpus_here``: the GPUs this machine shows; None counts them (the launcher calls this
    beside :func:`device_problem`, which loads torch too). A layout needing more is told
    to shrink, not given GPU ids the machine lacks."""
    if cfg.trainer.device != "cuda":
        return None
    gpus = cfg.launch.gpus
    if gpus is None:
        return _unset_gpus_line(cfg, _gpu_count() if gpus_here is None else gpus_here)
    # A role launch.gpus leaves out sees every GPU: the learner's rank r takes GPU r, a
    # server's tensor-parallel ranks take GPUs 0, 1, ...
    nproc, tp = cfg.trainer.nproc, cfg.rollout.tensor_model_parallel_size
    learner = set(gpus.get("learner") or range(nproc))
    rollout = gpus.get("rollout") or [list(range(tp))] * cfg.rollout.num_servers
    for i, ids in enumerate(rollout):
        shared = sorted(learner & set(ids if isinstance(ids, list) else [ids]))
        if shared:
            return (
                f"launch.gpus.rollout[{i}]={ids} shares GPU {shared} with launch.gpus.learner="
                f"{sorted(learner)}: NCCL cannot push weights between two processes on one "
                "GPU; give each role GPUs of its own"
                + (
                    ""
                    if {"learner", "rollout"} <= set(gpus)
                    else " (a role launch.gpus leaves out sees every GPU, from GPU 0)"
                )
            )
    return None


def _unset_gpus_line(cfg: Config, gpus_here: int) -> str:
    """The problem of ``launch.gpus`` left unset on CUDA: the mapping to write, when this
    machine has the GPUs for it (or their count is unknown, 0); else what to shrink.
    ``trainer.n_gpus_per_node`` (veRL's) counts the learner's GPUs alone here: the rollout
    servers' come on top, where veRL's share the learner's."""
    nproc, tp, n = (
        cfg.trainer.nproc,
        cfg.rollout.tensor_model_parallel_size,
        cfg.rollout.num_servers,
    )
    needed = nproc + n * tp
    head = (
        "trainer.device=cuda with launch.gpus unset: every role would start on GPU 0, and "
        "NCCL cannot push weights between two processes on one GPU; "
    )
    apart = (
        f"rollout GPUs come on top of the learner's here: trainer.nproc={nproc} (veRL's "
        "trainer.n_gpus_per_node) counts the learner's alone, and the rollout servers take "
        f"rollout.num_servers x rollout.tensor_model_parallel_size = {n} x {tp} more, "
        f"{needed} in all"
    )
    shrink = (
        "lower trainer.n_gpus_per_node, or rollout.num_servers or "
        "rollout.tensor_model_parallel_size"
    )
    if 0 < gpus_here < needed:
        return (
            f"{head}{apart}, and this machine has {gpus_here}: {shrink} to fit {gpus_here}, "
            "then give each role its own in launch.gpus"
        )
    servers = [list(range(nproc + i * tp, nproc + (i + 1) * tp)) for i in range(n)]
    return (
        f"{head}give each role its own: launch.gpus={{learner: {list(range(nproc))}, "
        f"rollout: {servers}}}; {apart} (for fewer, {shrink})"
    )


def _gpu_count() -> int:
    """The CUDA devices torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count()


def _hub_offline() -> str | None:
    """The variable that puts this machine's HF libraries offline, if one does."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return name
    return None


def _hub_cache() -> Path:
    """Where ``huggingface_hub`` keeps downloaded models, read from the environment now (its
    own constant is read once, at import)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _hub_problem(repo_id: str, key: str = "model.path") -> str | None:
    """Why hub model ``repo_id`` cannot load on this machine: offline with no cached copy.
    Online, or cached, it is left to the roles (no network call here)."""
    offline = _hub_offline()
    # A cached snapshot holds the model's config.json (models--org--name/snapshots/<rev>/).
    snapshots = _hub_cache() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if any(snapshots.glob("*/config.json")):
        return None
    if offline is None:  # the roles download it: said, as a mistyped folder reads alike
        log.warning(
            "%s=%s is no folder here and not in the HF cache: read as a hub id, which "
            "every role downloads at its start. A local folder is written ./%s; a machine "
            "without network needs HF_HUB_OFFLINE=1 and a downloaded copy",
            key,
            repo_id,
            repo_id,
        )
        return None
    return (
        f"{key}={repo_id} is no local directory and not in the HF cache ({_hub_cache()}),"
        f" and {offline} is set, so no role can download it: download it on a machine that "
        f"reaches the hub (`huggingface-cli download {repo_id} --local-dir DIR`) and give "
        f"{key}=DIR"
    )


def data_hint(path: str) -> str:
    """How to make a missing data file: the make target of the repository's own, the
    prepare command for a file it writes in a folder naming its task
    (``.../countdown/train.parquet``), else the schema to give (a veRL user's
    ``~/data/gsm8k/test.parquet`` was told to write the arithmetic task there)."""
    if (target := make_target(path)) is not None:
        return f"build it with {target}"
    folder = Path(path).parent
    task = next((t for t in PREPARED_TASKS if folder.name.startswith(t)), None)
    if task is None or Path(path).name not in ("train.parquet", "val.parquet"):
        return (
            "give an existing parquet file in veRL's schema (data_source, prompt, "
            "reward_model.ground_truth), or write a demo task's with asyncrl-prepare data"
        )
    return (
        f"write the task's files with `asyncrl-prepare data --task {task} --out {folder}` (or "
        "convert your data to veRL's parquet schema)"
    )


#: The tasks ``asyncrl-prepare data --task`` writes.
PREPARED_TASKS = ("arithmetic", "calculator", "countdown")
