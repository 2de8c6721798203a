"""LoRA adapters as files: peft's format, which vLLM's ``LoRARequest`` and peft load.

The learner writes its final adapter with it; a rollout server's worker writes each pushed
adapter version with it before vLLM loads that version. Tensors are named as the model's
linear layers are in the HF checkpoint (``model.layers.0.self_attn.q_proj.lora_A.weight``);
the file prefixes them with ``base_model.model.``, as peft does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_key(name: str) -> bool:
    """Whether ``name`` is an adapter tensor (``...lora_A.weight`` or ``...lora_B.weight``)."""
    return name.endswith(LORA_SUFFIXES)


def layer_names(tensors: Mapping[str, Any], full: bool = False) -> list[str]:
    """The last name part of every adapted layer (``q_proj``, ``down_proj``), sorted; with
    ``full``, the layers' whole names (``model.layers.0.self_attn.q_proj``)."""
    layers = {k.rsplit(".", 2)[0] for k in tensors if is_adapter_key(k)}
    return sorted(layers if full else {name.rsplit(".", 1)[-1] for name in layers})


def save_peft_adapter(
    out_dir: str | Path,
    tensors: Mapping[str, Any],
    *,
    rank: int,
    alpha: float,
    base_model: str = "",
    full_names: bool = False,
) -> Path:
    """Write ``out_dir/adapter_config.json`` and ``adapter_model.safetensors`` from the
    adapter tensors of ``tensors`` (other names are left out). Returns ``out_dir``.
    ``full_names``: the config's ``target_modules`` names each adapted layer whole, for
    adapters on some layers of a name only (peft would otherwise wrap every layer of that
    name, adding adapters the learner never trained)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = {
        PEFT_PREFIX + k: v.detach().cpu().contiguous()
        for k, v in tensors.items()
        if is_adapter_key(k)
    }
    if not adapter:
        raise ValueError("no adapter tensor (names ending in .lora_A.weight or .lora_B.weight)")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": layer_names(tensors, full=full_names),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model,
    }
    save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out
