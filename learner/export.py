"""The final policy as an HF model directory (``<run dir>/final/``), which transformers
and vLLM load. With LoRA the weights given are the merged ones; the adapter alone is
written by :func:`learner.lora.export_adapter`.

Each export ends with a mark naming the learner step it holds (:data:`EXPORT_MARK`): a run
whose ending was cut short exports again unless the directory holds its own last step, so
an earlier run's, an abandoned branch's or a half-written ``final/`` is never kept."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Files of an HF model directory that are weights (replaced by the export), not metadata.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json")
EXPORT_MARK = "export.json"  # written last: the step an export holds


def exported_step(out_dir: str | Path) -> int | None:
    """The learner step whose weights ``out_dir`` holds, read from its export mark; None
    when it holds no whole export (missing, cut short, or written before marks)."""
    try:
        return int(json.loads((Path(out_dir) / EXPORT_MARK).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_export(out_dir: str | Path, step: int) -> None:
    """Record that ``out_dir`` now holds the whole export of learner step ``step``."""
    (Path(out_dir) / EXPORT_MARK).write_text(json.dumps({"step": step}) + "\n")


def model_files(source: str | Path) -> Path:
    """The directory of ``model.path``'s files: the path itself, or for a hub id the
    snapshot the learner loaded it from (the local cache; nothing is downloaded)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(source), local_files_only=True))


def export_hf(
    out_dir: str | Path,
    state: dict[str, torch.Tensor],
    source: str | Path,
    *,
    step: int,
    config_overrides: dict[str, Any] | None = None,
) -> Path | None:
    """Write an HF model directory that transformers and vLLM load: generation config and
    tokenizer files copied from ``source`` (``model.path``: a directory or a cached hub
    id), the config the learner trained with (``config_overrides`` applied, its dtype
    that of ``state``), and ``state`` (full tensors, e.g. :meth:`Trainer.export_state`)
    as safetensors; then the mark of ``step``.

    Written beside ``out_dir`` and moved in whole. Only rank 0 writes (gather ``state`` on
    every rank first). Returns ``out_dir`` on rank 0.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from learner.checkpoint import fsync_path, fsync_tree

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    out = Path(out_dir)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_files(source).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, tmp / f.name)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    config = AutoConfig.from_pretrained(str(source))
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)  # as the learner loaded it (learner.fsdp)
    floats = [v.dtype for v in tensors.values() if v.is_floating_point()]
    if floats:
        config.dtype = floats[0]  # transformers loads "auto" in the weights' own dtype
    config.save_pretrained(str(tmp))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    mark_export(tmp, step)
    fsync_tree(tmp)  # on disk before it is published: a node's crash leaves no empty files
    # Swapped in by renames: a kill between them leaves no final/ (or one without its mark),
    # which the next start exports again.
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    fsync_path(out.parent)
    shutil.rmtree(old, ignore_errors=True)
    log.info("exported HF model of step %d to %s (%d tensors)", step, out, len(tensors))
    return out


def export_final(cfg: Any, tensors: dict[str, torch.Tensor], out: Path, step: int) -> None:
    """The run's final policy (``tensors``, gathered on every rank) exported to ``out`` in
    HF format from ``cfg.model``'s files and overrides, marked with ``step`` (rank 0
    writes)."""
    m = cfg.model
    export_hf(out, tensors, m.path, step=step, config_overrides=m.override_config)
    log.info("final policy exported to %s (HF format)", out)
    if (note := merged_export_note(cfg)) is not None:
        log.warning("%s", note)


def merged_export_note(cfg: Any) -> str | None:
    """What a LoRA run's ``final/`` lacks when its adapters were served apart from the base
    and the model is 16-bit, or None. The merge is summed in float32 and stored in
    ``model.dtype``: rounded to 16 bits, much of a small adapter update rounds away (a
    review measured 42% of its elements after a few steps at lr 1e-4), while the servers
    sampled, and validation scored, the base with the adapter beside it."""
    m = cfg.model
    if not m.lora_rank or cfg.sync.lora != "adapter" or m.dtype == "float32":
        return None
    return (
        f"final/ holds the adapters merged into the base and rounded to {m.dtype}, where "
        "part of a small adapter update rounds away: the policy the rollout servers served "
        "and validation scored is the base with final_adapter/ beside it (vLLM's "
        "LoRARequest or peft): serve that"
    )
