"""The policy's weights in and out of FSDP2 shards, for :class:`learner.trainer.Trainer`:
the policy and its frozen KL reference loaded sharded (:func:`load_policy`,
:func:`load_reference`), and the whole weights gathered for a push to the rollout servers
or the final export (:func:`gathered_state`: the full weights, or with LoRA the adapters
alone or merged into the weights). Gathering is a collective: every rank calls it."""

from __future__ import annotations

import torch

from asyncrl.config import Config
from asyncrl.config.schema import ModelConfig
from learner import fsdp, lora

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_policy(cfg: Config, mesh, model_path: str) -> fsdp.ShardedModel:
    """The trained policy at ``model_path``, sharded over ``mesh`` (with LoRA adapters when
    ``model.lora_rank`` asks for them)."""
    return fsdp.load_sharded_model(
        model_path,
        mesh,
        device=cfg.trainer.device,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        attn_implementation=cfg.model.attn_implementation,
        offload=fsdp.offload_wanted(cfg),
        config_overrides=cfg.model.override_config,
        lora=lora.spec(cfg.model),
    )


def load_reference(cfg: Config, mesh, model_path: str) -> fsdp.ShardedModel:
    """The frozen reference for the KL penalty: the initial weights at ``model_path``,
    sharded the same way as the policy, never trained."""
    return fsdp.load_sharded_model(
        model_path,
        mesh,
        device=cfg.trainer.device,
        trainable=False,
        attn_implementation=cfg.model.attn_implementation,
        offload=fsdp.offload_wanted(cfg),
        config_overrides=cfg.model.override_config,
    )


def gathered_state(
    model: torch.nn.Module, m: ModelConfig, *, adapter_only: bool, keep: bool
) -> dict[str, torch.Tensor]:
    """The whole weights of ``model``, named as in the HF checkpoint and cast to
    ``model.dtype``; with LoRA the adapters alone (``adapter_only``) or merged into the
    weights. A collective: call it on every rank; only the ranks that ``keep`` get them,
    the others ``{}``."""
    dtype = DTYPES[m.dtype]
    if not m.lora_rank:
        return fsdp.full_state(model, dtype, keep=keep)
    scaling = m.lora_alpha / m.lora_rank
    # The adapter first: alone, all a push of it needs (a few percent of the model).
    adapters = fsdp.full_state(model, only=lora.is_adapter_key, keep=keep)
    if adapter_only:
        return lora.for_push(adapters, scaling, dtype, adapter_only=True)
    # Merged into each base tensor as it is gathered, then cast: the whole model held
    # in float32 beside its merged copy ran the final export out of GPU memory where a
    # full fine-tune's fits.
    return fsdp.full_state(
        model,
        dtype,
        only=lambda name: not lora.is_adapter_key(name),
        keep=keep,
        transform=lora.merger(adapters, scaling),
    )
