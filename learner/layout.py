"""How sequences are laid out for the model: packed into one row, or padded rows.

Packing (every sequence of a micro-batch in one row ``[1, S]``, told apart by position ids)
wastes no token on padding, but it only pays where the attention kernel treats the packed
sequences separately (a varlen kernel: flash attention). With SDPA or eager attention,
transformers builds a dense ``S x S`` block-diagonal mask and attends over all of it, so a
packed row costs as much as one sequence of the total length: on the CPU demo's batch (128
sequences of ~26 tokens) a packed step took 0.68 s against 0.156 s padded. Padded rows
``[B, L]`` cost ``B x L``, which stays close to the real token count when the rows of a
micro-batch have similar lengths (:func:`learner.plan.micro_batches` sorts them).

``actor.sequence_layout: auto`` therefore picks packed only for a varlen kernel on CUDA,
and otherwise ``shared``: padded rows, except that a repeated prompt (a GRPO group's) is
computed once for all its samples where that pays (:mod:`learner.shared_prefix`).
``packed``, ``padded`` and ``shared`` force one. Pure, except :func:`resolve_layout`,
which checks the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from learner.collate import MicroBatch, collate
from learner.rollouts import Rollout
from learner.shared_prefix import sharing_works

log = logging.getLogger(__name__)

SEQUENCE_LAYOUTS = ("auto", "packed", "padded", "shared")


def varlen_attention(attn_implementation: str | None) -> bool:
    """Whether an HF ``attn_implementation`` runs packed sequences as separate ones
    (``flash_attention_2``/``_3`` and hub flash kernels) rather than through a dense mask
    (``sdpa``, ``eager``, ``flex_attention`` as transformers drives it for packed rows)."""
    return attn_implementation is not None and "flash" in attn_implementation


def choose_layout(
    requested: str,
    attn_implementation: str | None,
    device: str,
) -> tuple[str, str]:
    """``(layout, reason)``: ``"packed"``, ``"padded"`` or ``"shared"`` for
    ``actor.sequence_layout`` ``requested`` on a model whose attention is
    ``attn_implementation``, on ``device``."""
    if requested not in SEQUENCE_LAYOUTS:
        raise ValueError(f"actor.sequence_layout={requested!r}: use one of {SEQUENCE_LAYOUTS}")
    if requested != "auto":
        return requested, "set by actor.sequence_layout"
    if device == "cuda" and varlen_attention(attn_implementation):
        return "packed", f"auto: {attn_implementation} attends within each packed sequence"
    why = (
        f"auto: {attn_implementation or 'default'} attention on {device} would attend over "
        "a packed row as one long sequence"
    )
    return "shared", why + "; a repeated prompt runs once for its samples"


def probe_atol(device: str) -> float:
    """How far the layout probes let a layout's logprobs stray from the padded ones. On
    CUDA the forward runs in bf16 (the learner's mixed precision): bf16 holds a logit of 15
    to within 0.06, so another reduction order moves logprobs by about that, and at
    float32's 1e-3 a real model would always fall back to padded rows. 0.1 is the bound
    the GPU check (benchmarks/gpu_learner_check.py) holds packed and shared rows to; it
    has not been measured on a real model on a GPU. A layout the model does not take mixes
    sequences, which moves logprobs by far more."""
    return 0.1 if device.startswith("cuda") else 1e-3


def packing_works(forward: Callable[[MicroBatch], torch.Tensor], atol: float = 1e-3) -> bool:
    """Whether the model takes packed sequences (attention kept within each sequence via
    position ids): ``forward`` (micro-batch -> logprobs ``[B, T]``) of two short sequences,
    packed and padded, must agree within ``atol`` (:func:`probe_atol`)."""
    probe = [
        Rollout([1, 2, 3], [4, 5], [0.0, 0.0], 0.0, 0),
        Rollout([6, 7], [8, 9, 10], [0.0, 0.0, 0.0], 0.0, 0),
    ]
    adv = torch.zeros(2)
    with torch.no_grad():
        packed = forward(collate(probe, adv, [0, 1], packed=True))
        padded = forward(collate(probe, adv, [0, 1], packed=False))
    mask = collate(probe, adv, [0, 1]).mask.to(packed.device)
    return bool(torch.allclose(packed[mask], padded[mask], atol=atol))


def sliding_window(config: Any) -> int | None:
    """The window some of a model's attention layers slide over (HF config ``config``), or
    None where every layer attends over the whole sequence: ``sliding_window`` unless
    ``use_sliding_window`` is off (Qwen2) or no layer is a ``sliding_attention`` one."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def resolve_layout(
    requested: str,
    attn_implementation: str | None,
    device: str,
    *,
    forward: Callable[[MicroBatch], torch.Tensor],
    window: int | None = None,
) -> str:
    """:func:`choose_layout`, checked on the model (``forward``: micro-batch -> logprobs
    ``[B, T]``): a model that cannot take packed rows, or shared rows (a 4D mask), gets
    padded rows, and so does one whose layers slide over a ``window``
    (:func:`sliding_window`) where shared rows are asked for. Logged once."""
    layout, why = choose_layout(requested, attn_implementation, device)
    if layout == "shared" and window is not None:
        # transformers takes a 4D mask as it is given and applies no window on top, so
        # past the window every layer attended over the whole context, unlike vLLM; the
        # probe's short sequences fit in any real window and could not tell.
        layout = "padded"
        why = f"the model's attention slides over {window} tokens, which shared rows do not"
        log.warning("%s; using padded micro-batches", why)
    works = {"packed": packing_works, "shared": sharing_works}.get(layout)
    if works is not None and not works(forward, probe_atol(device)):
        layout, why = "padded", f"the model does not support the {layout} layout"
        log.warning("%s; using padded micro-batches", why)
    log.info("sequence layout: %s (%s)", layout, why)
    return layout
