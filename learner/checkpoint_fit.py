"""Whether a checkpoint's trained weights fit the model a resume loads them into, read from
the checkpoint's metadata before the load (:func:`model_misfit`).

torch's loader fails on a tensor the checkpoint lacks or holds in another shape with an
exception that is no ``Exception`` (a traceback, and a launcher restarting the learner into
the same failure), and ignores a saved tensor the model no longer has: a narrowed
``model.target_modules`` would drop trained adapters without a word. A changed
``model.lora_rank`` or targets, LoRA switched on or off, or another model are refused here
by name instead (:func:`learner.restore.misfit_line` says which settings changed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class CheckpointMisfit(ValueError):
    """A checkpoint whose trained weights are not the model's: other names or shapes (a
    changed ``model.lora_rank`` or ``model.target_modules``, LoRA switched on or off,
    another model)."""


def model_misfit(path: Path, model_sd: dict[str, Any], prefix: str = "model.") -> str | None:
    """How the trained weights saved in ``path`` differ from ``model_sd`` (this model's, as
    a load asks for them), or None when they fit. Read from the checkpoint's metadata
    before the load: torch's loader fails on a missing or reshaped tensor with an exception
    that is no ``Exception``, and ignores a saved one the model no longer has (a narrowed
    ``model.target_modules`` would drop trained adapters without a word). ``prefix``: the
    saved model's keys (``critic_model.`` for the critic's)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {
        k.removeprefix(prefix): tuple(getattr(v, "size", ()))
        for k, v in meta.items()
        if k.startswith(prefix)
    }
    here = {k: tuple(v.shape) for k, v in model_sd.items() if hasattr(v, "shape")}
    parts = []
    if unknown := sorted(set(saved) - set(here)):
        parts.append(f"{len(unknown)} saved weights this model lacks (e.g. {unknown[0]})")
    if unsaved := sorted(set(here) - set(saved)):
        parts.append(f"{len(unsaved)} trained weights it did not save (e.g. {unsaved[0]})")
    reshaped = sorted(k for k in set(saved) & set(here) if saved[k] != here[k])
    if reshaped:
        k = reshaped[0]
        parts.append(
            f"{len(reshaped)} of other shapes (e.g. {k}: saved {list(saved[k])}, "
            f"here {list(here[k])})"
        )
    return "; ".join(parts) or None
