"""Checkpoints (torch.distributed.checkpoint); the final HF export is :mod:`learner.export`.

Layout of a run directory::

    <run_dir>/checkpoints/step_<n>/        one complete checkpoint
        .metadata, __*_*.distcp            model + optimizer shards (DCP; any world size),
                                           and the critic's beside them (PPO with GAE)
        trainer_state.json                 step, policy_version, scheduler, extra, and
                                           the critic's schedule and KL coefficient
        rng_rank<r>.pt                     rank r's random state (torch, CUDA, Python):
                                           dropout draws go on as if never stopped
    <run_dir>/checkpoints/step_<n>.tmp/    a checkpoint being written (ignored)
    <run_dir>/checkpoints/step_<n>.old/    the one a re-save of step n replaces (used only
                                           while step_<n> is missing: a save cut short)
    <run_dir>/checkpoints/abandoned_after_step_<k>/
                                           the steps after k of a run rewound to step k
                                           (ignored)

A checkpoint is written under a temporary name and renamed when complete, so a crash
mid-save never leaves a directory that
:func:`~learner.checkpoint_folders.latest_checkpoint` would pick. Sharded
state is saved as DTensors, so a run can resume on a different number of ranks. With
``trainer.max_actor_ckpt_to_keep``, each save then deletes the steps older than the newest
N (:func:`~learner.checkpoint_folders.prune_checkpoints`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Defined beside the launcher's check of trainer.resume_from_path (no torch there); the
# loop and the tests read it from here.
from asyncrl.config.inputs import STATE_FILE as STATE_FILE
from asyncrl.config.inputs import STEP_ENTRY, scan_checkpoints
from learner.checkpoint_fit import CheckpointMisfit, model_misfit
from learner.checkpoint_folders import checkpoint_dir, prune_checkpoints

log = logging.getLogger(__name__)

# step_<n>, and what a save leaves beside it: .tmp (being written), .old (being replaced).
#: The key of ``extra`` holding the KL-in-reward coefficient (:mod:`learner.reward_kl`).
REWARD_KL_KEY = "reward_kl_coef"
#: The KL-in-reward controller's kind (fixed, adaptive) beside it: only an adaptive one moved.
REWARD_KL_KIND = "reward_kl_type"


@dataclass
class CheckpointMeta:
    """What a checkpoint records besides tensors. ``extra`` is opaque to the learner (the
    coordinator's data cursor) and must be JSON-serialisable."""

    step: int
    policy_version: int
    extra: dict[str, Any] = field(default_factory=dict)


#: Each rank's random state, beside the shards (one file per rank: the streams differ).
RNG_FILE = "rng_rank{rank}.pt"


def _rng_state() -> dict[str, Any]:
    """This process's random state: torch's CPU generator, CUDA's when in use, Python's."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(path: Path) -> None:
    """Put back the random state :func:`_rng_state` saved at ``path``. A checkpoint
    without one (saved before they were kept, or by fewer ranks than now) leaves this rank
    seeded from ``trainer.seed``, and says so."""
    if not path.is_file():
        log.info("%s is missing: this rank's random draws start from trainer.seed", path.name)
        return
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _state_dict_options(trained_only: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trained_only)


def _dcp_state(model, optimizer, critic=None, trained_only: bool = True) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # Frozen parameters (the base under LoRA) are reloaded from model.path: a LoRA
    # checkpoint holds the adapter and its optimizer state only.
    options = _state_dict_options(trained_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if frozen and trained_only:  # a tied head is no parameter of its own: the option keeps it
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trained}
    state = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        state["critic_model"], state["critic_optim"] = get_state_dict(
            critic.model, critic.optimizer
        )
    return state


def _pristine(optimizer, critic=None) -> list[str]:
    """The optimizers that never stepped (``actor``; ``critic``): no state yet."""
    out = ["actor"] if not optimizer.state else []
    return out + (["critic"] if critic is not None and not critic.optimizer.state else [])


def _forget(names: list[str], optimizer, critic=None) -> None:
    """Give the optimizers ``names`` back their never-stepped (empty) state.

    torch's ``get_state_dict`` builds a never-stepped optimizer's state by a zero step
    (the actor's during ``trainer.critic_warmup``): Adam's step count then starts at 1 and
    the first real update is smaller than a run that did not save there would take, so
    results would depend on ``save_freq``. Dropped after the save, and after a load of
    such a checkpoint."""
    for name in names:
        if name == "actor":
            optimizer.state.clear()
        elif critic is not None:
            critic.optimizer.state.clear()


def save_checkpoint(
    run_dir: str | Path,
    model,
    optimizer,
    scheduler,
    *,
    step: int,
    policy_version: int,
    extra: dict[str, Any] | None = None,
    critic=None,
    keep: int | None = None,
) -> Path:
    """Save model, optimizer, scheduler, step, policy version and ``extra`` as
    ``<run_dir>/checkpoints/step_<step>/``; every rank calls it. Returns the directory.
    ``critic`` (a :class:`learner.critic.Critic`): its model and optimizer are saved with
    the actor's, its ``state_dict()`` in the state file. ``keep``
    (``trainer.max_actor_ckpt_to_keep``): once the new one is complete, rank 0 deletes the
    checkpoints older than the newest ``keep`` (None or <= 0: keeps all).

    Re-saving a step replaces the old directory only once the new one is complete.
    """
    # dcp.save, from the module that defines it (torch does not mark the re-export public)
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    final = checkpoint_dir(run_dir) / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    pristine = _pristine(optimizer, critic)
    state_json = json.dumps(
        {
            "step": step,
            "policy_version": policy_version,
            "scheduler": scheduler.state_dict(),
            "extra": extra or {},
            **({"critic": critic.state_dict()} if critic is not None else {}),
            "never_stepped": pristine,
        },
        indent=1,
    )  # serialise first: a bad ``extra`` fails before anything is written
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-save
        tmp.mkdir(parents=True)
    _barrier()
    # Before the collective save: rank 0 renames the folder only once every rank is past it.
    rng_file = tmp / RNG_FILE.format(rank=_rank())
    torch.save(_rng_state(), rng_file)
    fsync_path(rng_file)
    dcp_save(_dcp_state(model, optimizer, critic), checkpoint_id=str(tmp))  # fsyncs its files
    _forget(pristine, optimizer, critic)
    if _rank() == 0:
        # On disk before the rename: after a node's crash (not a kill) a complete-looking
        # step_N with empty files would be the one auto-resume picked, and refused.
        (tmp / STATE_FILE).write_text(state_json)
        fsync_path(tmp / STATE_FILE)
        fsync_path(tmp)
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
            # A re-save cut short between its renames left step N's previous copy, which
            # latest_checkpoint used while step N was missing: this one replaces it.
            shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
        fsync_path(final.parent)  # the rename, before older checkpoints are pruned
        log.info("checkpoint saved: %s (policy version %d)", final, policy_version)
        prune_checkpoints(final, keep)
    _barrier()
    return final


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries) to disk. A file system that cannot
    sync a folder (some network mounts) is let be: the rename still orders the writes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        log.debug("could not fsync %s (%s)", path, e)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder``, then its folders' entries: call it before the
    rename that publishes ``folder``, so that after a node's crash the published name
    never holds empty files."""
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):  # files first
        fsync_path(path)
    fsync_path(folder)


def load_checkpoint(path: str | Path, model, optimizer, scheduler, critic=None) -> CheckpointMeta:
    """Restore model, optimizer and scheduler (and ``critic``'s) in place from a checkpoint
    directory (any world size); every rank calls it. Returns step, policy version and
    ``extra``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load  # dcp.load

    path = Path(path)
    meta = json.loads((path / STATE_FILE).read_text())
    if critic is not None and "critic" not in meta:
        raise CheckpointMisfit("it holds no critic: it was saved by a run without one")
    state = _dcp_state(model, optimizer, critic)
    if (misfit := model_misfit(path, state["model"])) is not None:
        raise CheckpointMisfit(misfit)
    if critic is not None and (
        misfit := model_misfit(path, state["critic_model"], "critic_model.")
    ):
        raise CheckpointMisfit(f"its critic: {misfit}")  # a changed critic.model.path
    dcp_load(state, checkpoint_id=str(path))
    # What the checkpoint leaves out (a tied head under LoRA) keeps its loaded value.
    model_sd = _dcp_state(model, optimizer, trained_only=False)["model"] | state["model"]
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=state["optim"],
        options=_state_dict_options(trained_only=False),
    )
    scheduler.load_state_dict(meta["scheduler"])
    if critic is not None:
        set_state_dict(
            critic.model,
            critic.optimizer,
            model_state_dict=state["critic_model"],
            optim_state_dict=state["critic_optim"],
        )
        critic.load_state_dict(meta["critic"])
    _forget(meta.get("never_stepped", []), optimizer, critic)
    _restore_rng(path / RNG_FILE.format(rank=_rank()))
    log.info("checkpoint loaded: %s (step %d)", path, meta["step"])
    extra = meta.get("extra", {})
    if "kl_coef" in meta.get("critic", {}):  # saved before the trainer held it
        extra.setdefault(REWARD_KL_KEY, meta["critic"]["kl_coef"])
    return CheckpointMeta(meta["step"], meta["policy_version"], extra)


def unloadable_line(path: Path, error: BaseException) -> str:
    """One line for a checkpoint the learner cannot load (a damaged file, a checkpoint of
    another model or config), naming the one before it to resume from instead."""
    found, _ = scan_checkpoints(path.parent)
    step = int(m.group(1)) if (m := STEP_ENTRY.match(path.name)) else None
    earlier = sorted(s for s in found if step is None or s < step)
    fix = (
        f"resume from an earlier one (trainer.resume_mode=resume_path "
        f"trainer.resume_from_path={found[earlier[-1]]}), or move it aside"
        if earlier
        else "move it aside, or give the config it was saved with"
    )
    detail = str(error).splitlines()[0][:300] if str(error) else ""
    return (
        f"checkpoint {path} cannot be loaded ({type(error).__name__}: {detail}): it is "
        f"damaged, or of another model or config; {fix}"
    )
