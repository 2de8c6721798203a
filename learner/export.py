"""The final policy as an HF model directory (``<run dir>/final/``), which transformers
and vLLM load. With LoRA the weights given are the merged ones; the adapter alone is
written by :func:`learner.lora.export_adapter`."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Files of an HF model directory that are weights (replaced by the export), not metadata.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json")


def export_hf(
    out_dir: str | Path,
    state: dict[str, torch.Tensor],
    source_dir: str | Path,
) -> Path | None:
    """Write an HF model directory that transformers and vLLM load: config, generation
    config and tokenizer files copied from ``source_dir`` (the model trained from), and
    ``state`` (full tensors, e.g. :meth:`Trainer.full_state_for_push`) as safetensors.

    Only rank 0 writes (gather ``state`` on every rank first). Returns ``out_dir`` on rank 0.
    """
    from safetensors.torch import save_file

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in Path(source_dir).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, tmp / f.name)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("exported HF model to %s (%d tensors)", out, len(tensors))
    return out
