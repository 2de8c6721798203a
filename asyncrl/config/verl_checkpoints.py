"""veRL's checkpoints, recognised so that a veRL user is told what becomes of them.

veRL saves ``<default_local_dir>/global_step_<n>/actor/`` (FSDP shards
``model_world_size_<w>_rank_<r>.pt``, the optimizer's and a ``huggingface/`` folder with the
config and tokenizer; Megatron's in ``dist_ckpt/``), and ``latest_checkpointed_iteration.txt`` beside them. This project's
checkpoints are ``<run dir>/checkpoints/step_<n>/`` and cannot read veRL's shards. With
veRL's ``default_local_dir`` the run directory is that same folder, so ``resume_mode=auto``
would start over from ``model.path`` beside a veRL run's checkpoints without a word; a
``resume_from_path`` naming one was refused as "not a checkpoint". Both name veRL's own
conversion instead: its model merger writes the actor as a Hugging Face model, which a run
here starts from (the optimizer state and the data position are not carried over).
"""

from __future__ import annotations

import re
from pathlib import Path

_STEP = re.compile(r"^global_step_(\d+)$")


def _is_step(p: Path) -> bool:
    """A veRL checkpoint: named ``global_step_<n>``, holding its ``actor`` folder (a folder
    of another tool that happens to have the name is not one)."""
    return bool(_STEP.match(p.name)) and (p / "actor").is_dir()


def verl_step(path: Path) -> Path | None:
    """The veRL checkpoint ``path`` is, or is in (its ``actor`` folder, a file there), or
    None. No further up: this project's own folders inside a ``global_step_<n>`` are not."""
    return next((p for p in (path, *path.parents[:2]) if _is_step(p)), None)


def latest_verl_step(folder: Path) -> Path | None:
    """The veRL checkpoint with the highest step directly in ``folder``, or None."""
    if not folder.is_dir():
        return None
    steps = {int(m.group(1)): p for p in folder.iterdir() if (m := _STEP.match(p.name))}
    steps = {n: p for n, p in steps.items() if _is_step(p)}
    return steps[max(steps)] if steps else None


def conversion(step: Path) -> str:
    """How to start a run here from veRL checkpoint ``step``, in one clause (a checkpoint
    of veRL's Megatron workers holds ``actor/dist_ckpt``; its FSDP workers' shards)."""
    target = step.parent / f"{step.name}_hf"
    backend = "megatron" if (step / "actor" / "dist_ckpt").is_dir() else "fsdp"
    return (
        "merge its actor into a Hugging Face model with veRL's model merger (python -m "
        f"verl.model_merger merge --backend {backend} --local_dir {step / 'actor'} --target_dir "
        f"{target}) and start from it with actor_rollout_ref.model.path={target} (the "
        "optimizer state and the data position are not carried over)"
    )


def resume_path_line(path: str, step: Path) -> str:
    """The refusal of ``trainer.resume_from_path`` naming veRL checkpoint ``step``."""
    return (
        f"trainer.resume_from_path={path} is a veRL checkpoint ({step.name}), whose sharded "
        f"format this project cannot resume: {conversion(step)}"
    )


def auto_line(run_dir: Path, step: Path) -> str:
    """The warning of ``resume_mode=auto`` finding veRL's checkpoints and none of its own."""
    return (
        f"{run_dir} holds veRL checkpoints (latest {step.name}) and none of this project's "
        f"(checkpoints/step_N): the run starts from actor_rollout_ref.model.path, not from "
        f"{step.name}. To go on from it, {conversion(step)}"
    )
