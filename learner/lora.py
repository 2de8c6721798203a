"""LoRA on the learner: low-rank adapters beside frozen linear layers (``model.lora_rank``).

A module of our own rather than peft's: the adapted layer stays an ``nn.Linear`` that keeps
its ``weight`` and ``bias`` under their HF names and gains two children, ``lora_A`` and
``lora_B``, so

- FSDP2 shards it like any layer (``fully_shard`` per decoder layer takes the frozen base
  and the trainable adapter in one group; only the adapter gets gradients and optimizer
  state);
- DCP checkpoints name the adapter ``<layer>.lora_A.weight``, and ``ignore_frozen_params``
  leaves the base out (it is reloaded from ``model.path``);
- the peft adapter file (:mod:`asyncrl.sync.adapter`) is the same names under
  ``base_model.model.``, which vLLM and peft load.

The adapted layer computes ``W x + b + (alpha / r) * B (A x)`` with ``A`` ``[r, in]``
(Kaiming-uniform, as peft) and ``B`` ``[out, r]`` (zeros): the model starts exactly as the
base. Merging (:func:`merged`) adds ``(alpha / r) * B @ A`` to ``W`` in float32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.config import ConfigError
from asyncrl.sync.adapter import is_adapter_key, save_peft_adapter

log = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a frozen weight (and bias) and a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        nn.Module.__init__(self)  # not nn.Linear's: the weight is the base's own
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scaling = alpha / rank
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=dev, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=dev, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.adapter_on = True  # off inside :func:`adapters_off` (the KL reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]``."""
        base = F.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return base
        return base + self.lora_B(self.lora_A(x)) * self.scaling


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its frozen base inside the block: every :class:`LoRALinear` skips
    its adapter. The base never trains, so this is the model the run started from, the
    KL reference, without a second copy of the base in memory (veRL does the same)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapter_on = False
    try:
        yield
    finally:
        for m in layers:
            m.adapter_on = True


def targets(model: nn.Module, target_modules: str | list[str]) -> list[str]:
    """Names of the linear layers to adapt: ``all-linear`` is every ``nn.Linear`` but the
    output head (as peft reads it); a list names layers by their last name part
    (``q_proj``) or a longer suffix (``self_attn.q_proj``)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if target_modules == ALL_LINEAR or any(
            name == t or name.endswith("." + t) for t in target_modules
        ):
            found.append(name)
    return found


def inject(model: nn.Module, rank: int, alpha: float, target_modules: str | list[str]) -> int:
    """Freeze every parameter of ``model`` and put a :class:`LoRALinear` in place of each
    target layer (before sharding). Returns the number of layers adapted; a list of
    targets that matches nothing is an error naming the layers there are."""
    names = targets(model, target_modules)
    # Each name must match: a misspelt one beside a right one trained only the right one.
    unmatched = (
        []
        if target_modules == ALL_LINEAR
        else [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    )
    if not names or unmatched:
        linear = sorted({n.rsplit(".", 1)[-1] for n in targets(model, ALL_LINEAR)})
        # A config error (exit 2): the launcher would restart a learner that fails the
        # same way each time, reloading the model for nothing.
        raise ConfigError(
            [
                f"model.target_modules={target_modules!r}: {unmatched or target_modules} match "
                f"no linear layer of the model but its output head (never adapted); its "
                f"linear layers are named {linear} (or use {ALL_LINEAR!r})"
            ]
        )
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha))
    log.info("LoRA rank %d, alpha %g on %d linear layers", rank, alpha, len(names))
    return len(names)


def merged(
    state: dict[str, torch.Tensor], scaling: float, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The base model's tensors from a full state with adapters: each adapted ``W`` plus
    ``scaling * B @ A``, computed in float32, then cast to ``dtype`` (default: ``W``'s);
    the adapter tensors themselves left out. Names are the HF checkpoint's."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if is_adapter_key(name):
            continue
        prefix = name.removesuffix(".weight")
        a, b = state.get(prefix + ".lora_A.weight"), state.get(prefix + ".lora_B.weight")
        if a is not None and b is not None:
            w = t.float() + scaling * (b.float() @ a.float())
            t = w.to(dtype or t.dtype)
        elif dtype is not None:
            t = t.to(dtype)
        out[name] = t
    return out


def merger(
    adapters: dict[str, torch.Tensor], scaling: float
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """:func:`merged`'s sum for one base tensor at a time (``W`` plus ``scaling * B @ A``
    from ``adapters``, in float32; a tensor without an adapter as it is), for
    :func:`learner.fsdp.full_state`'s ``transform``: the whole model is then never held in
    float32 beside its merged copy (6 bytes a parameter on rank 0, not 2)."""

    def merge(name: str, w: torch.Tensor) -> torch.Tensor:
        prefix = name.removesuffix(".weight")
        a, b = adapters.get(prefix + ".lora_A.weight"), adapters.get(prefix + ".lora_B.weight")
        if a is None or b is None:
            return w
        return w.float() + scaling * (b.float() @ a.float())

    return merge


def spec(model_cfg: Any) -> tuple[int, float, str | list[str]] | None:
    """``(rank, alpha, target modules)`` of a ``model`` config group with ``lora_rank`` on,
    else None."""
    m = model_cfg
    return (m.lora_rank, m.lora_alpha, m.target_modules) if m.lora_rank else None


def for_push(
    state: dict[str, torch.Tensor],
    scaling: float,
    dtype: torch.dtype | None,
    adapter_only: bool,
) -> dict[str, torch.Tensor]:
    """What the rollout servers get of a full state with adapters: the adapter tensors
    alone (``sync.lora: adapter``; vLLM serves them beside its base weights), or the
    weights with the adapters merged (``merged``). Cast to ``dtype``."""
    if not adapter_only:
        return merged(state, scaling, dtype)
    return {k: v if dtype is None else v.to(dtype) for k, v in state.items() if is_adapter_key(k)}


def export_adapter(
    state: dict[str, torch.Tensor], model_cfg: Any, out: str | Path, step: int | None = None
) -> Path:
    """Write the adapter of a gathered full ``state`` in peft's format to ``out`` (call it
    on one rank); with ``step``, then the export's mark (:func:`learner.export.mark_export`),
    taken away first so that a write cut short leaves none."""
    from learner.checkpoint import fsync_path, fsync_tree
    from learner.export import EXPORT_MARK, mark_export

    m = model_cfg
    (Path(out) / EXPORT_MARK).unlink(missing_ok=True)
    # Targets named by a longer suffix (layers.0.self_attn.q_proj) adapt some layers of a
    # short name only: the config then names each adapted layer whole.
    full = m.target_modules != ALL_LINEAR and any("." in t for t in m.target_modules)
    path = save_peft_adapter(
        out, state, rank=m.lora_rank, alpha=m.lora_alpha, base_model=m.path, full_names=full
    )
    if step is not None:
        fsync_tree(Path(path))  # the adapter on disk before the mark that vouches for it
        mark_export(path, step)
        fsync_path(Path(path) / EXPORT_MARK)
    return path
