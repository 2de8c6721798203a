"""FSDP2 plumbing: process group and mesh, model loading and sharding, optimizer and
learning-rate schedule, gathering full weights and per-sequence results.

On CPU: gloo and float32 everywhere. On GPU: NCCL (with gloo beside it for the CPU tensors
the learner shares), float32 master weights with a bf16 mixed-precision policy (gradients
reduced in float32).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.config.critic import OptimConfig
from asyncrl.config.schema import Config

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    class ShardedModel(FSDPModule, PreTrainedModel):
        """What ``fully_shard`` makes of an HF model: an instance of a new class derived
        from FSDPModule and the model's own class (a type for the checker only)."""


log = logging.getLogger(__name__)


def process_group_backend(device: str) -> str:
    """The backend of the learner's process group when training on ``device``.

    The learner sends CPU tensors over its group as well as device ones: rank 0 shares each
    buffer batch (bytes) and each pushed version with the other ranks, and object
    collectives and barriers travel on the CPU. A plain ``"nccl"`` group has no CPU backend
    and fails those ("No backend type associated with device type cpu"), so on CUDA gloo
    runs beside NCCL: CPU tensors take gloo, CUDA tensors (FSDP, reductions) NCCL.
    """
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def init_distributed(device: str = "cpu"):
    """The data-parallel :class:`DeviceMesh` of this learner (1-D, every rank).

    Uses the default process group when one exists (it must have a CPU backend, see
    :func:`process_group_backend`); otherwise starts one from torchrun's environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``) or, with no such environment, a
    single-rank group in this process.
    """
    from torch.distributed.device_mesh import init_device_mesh

    backend = process_group_backend(device)
    if device == "cuda":
        # Before the group exists, so NCCL binds each rank to its own GPU.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            # torch documents dist.HashStore but re-exports it without marking it public
            store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    elif "cpu" not in _device_backends(dist.get_backend_config()):
        # Fail here, naming the fix, rather than at the first batch rank 0 shares.
        raise RuntimeError(
            f"the default process group ({dist.get_backend_config()}) has no CPU backend, "
            f"which the learner needs; create it with backend={backend!r}"
        )
    return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("dp",))


def _device_backends(backend: str) -> dict[str, dist.Backend]:
    """Device type -> backend of a backend string (``"nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    # Backend(...) returns a plain (lower-case) str, which BackendConfig takes, though
    # torch annotates the parameter as Backend.
    return dist.BackendConfig(cast(dist.Backend, dist.Backend(backend))).get_device_backend_map()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks to shard one by one: modules whose class the HF model lists
    in ``_no_split_modules`` (``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class to shard")
    return layers


def offload_wanted(cfg: Config) -> bool:
    """``actor.fsdp_config.param_offload`` (or ``optimizer_offload``) on a CUDA learner; on
    the CPU everything is in CPU memory already, which is said once."""
    global _offload_said
    wanted = cfg.actor.fsdp_config.offload
    if wanted and cfg.trainer.device != "cuda" and not _offload_said:
        _offload_said = True  # asked for the actor, the reference and the critic
        log.info("actor.fsdp_config offload has no effect on the CPU: the weights are there")
    return wanted and cfg.trainer.device == "cuda"


_offload_said = False


def load_sharded_model(
    path: str,
    mesh,
    *,
    device: str = "cpu",
    gradient_checkpointing: bool = False,
    trainable: bool = True,
    attn_implementation: str | None = None,
    offload: bool = False,
    config_overrides: dict[str, Any] | None = None,
    lora: tuple[int, float, str | list[str]] | None = None,
) -> ShardedModel:
    """Load an HF causal LM in float32 and shard it: ``fully_shard`` per decoder layer,
    then the root (embeddings, final norm, head; tied weights stay one parameter).

    Every rank reads the whole checkpoint on CPU first; ``fully_shard`` then keeps each
    rank's shard and moves it to ``device``. ``config_overrides`` (``model.override_config``)
    set HF config attributes as the model loads (the engine gets the same ones). ``lora``
    (rank, alpha, target modules): freeze the model and add adapters before sharding (every
    rank draws the same initial adapters from the seeded generator).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if config_overrides:
        # Set as attributes, so a key the config class lacks is kept too, as vLLM's
        # hf_overrides does on the engine's side.
        config = AutoConfig.from_pretrained(path)
        for key, value in config_overrides.items():
            setattr(config, key, value)
        kwargs["config"] = config
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    if lora is not None:
        from learner.lora import inject

        inject(model, *lora)
    return shard_model(
        model,
        mesh,
        device=device,
        gradient_checkpointing=gradient_checkpointing,
        trainable=trainable,
        offload=offload,
    )


def shard_model(
    model: PreTrainedModel,
    mesh,
    *,
    device: str = "cpu",
    gradient_checkpointing: bool = False,
    trainable: bool = True,
    offload: bool = False,
) -> ShardedModel:
    """Shard a loaded HF model (any head) as :func:`load_sharded_model` does. ``offload``
    (CUDA only; ``actor.fsdp_config.param_offload``): the shards, their gradients and the
    optimizer step stay in CPU memory, and each layer is gathered onto the GPU for its
    forward and backward only."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # Packed sequences need the plain causal mask path; no KV cache in training.
    model.config.use_cache = False
    if gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if device == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    policy = CPUOffloadPolicy() if offload and device == "cuda" else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return cast("ShardedModel", model)  # fully_shard swapped its class: see ShardedModel


def reshard(model: nn.Module) -> None:
    """Free the full parameters a no-grad forward leaves gathered. FSDP2 keeps the root's
    (embeddings, final norm, head) gathered after a forward, for the backward that usually
    follows; after a pass with no backward (the reference's logprobs, the proximal pass,
    the layout probe) they would stay on the device until the next backward, which for the
    reference never comes, and in device memory even with CPU offload."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def gather_sequences(local: dict[int, torch.Tensor], world_size: int) -> dict[int, torch.Tensor]:
    """Every rank's per-sequence tensors (CPU, ``[T_i]``, keyed by index into the global
    batch) on every rank: a collective when ``world_size > 1``. Each rank computes the
    sequences of its micro-batches; whole-batch quantities (GAE's whitening, the KL in the
    reward) need them all."""
    if world_size == 1:
        return local
    parts: list[dict[int, torch.Tensor]] = [{} for _ in range(world_size)]
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def full_state(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    only: Callable[[str], bool] | None = None,
    keep: bool = True,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of every parameter, named as the HF checkpoint names them
    (``only``: of the parameters whose names it accepts; every rank passes the same).
    ``transform(name, tensor)``, on the keeping rank, changes each one as it is gathered,
    before the cast (a LoRA merge in float32, one tensor at a time).
    ``keep=False``: this rank takes part in each gather and drops the result at once, and
    gets ``{}``: the ranks that neither push nor write hold one full parameter at a time,
    not the whole model (a 7B model's full bf16 copy is 14 GB on every GPU otherwise).

    A collective: every rank must call it, in the same order. Tied weights appear once
    (``named_parameters`` de-duplicates), as in the HF checkpoint, which vLLM's loader
    expects. ``dtype`` casts (e.g. to the rollout's bf16).

    The tensors never share memory with the parameters: the learner keeps the last pushed
    weights for catch-ups, which must not move with later optimizer steps. A gather or a
    cast already makes a copy; only on one rank without a cast (the full tensor is then the
    parameter's own memory) is one made here.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if only is not None and not only(name):
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        t = p.full_tensor() if isinstance(p, DTensor) else p
        if not keep:
            continue  # the gather is a collective: every rank joins it, one rank keeps it
        t = t.detach()
        if transform is not None:
            t = transform(name, t)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        elif t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            t = t.clone()
        out[name] = t
    return out


def build_optimizer(model: nn.Module, optim_cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the (sharded) parameters from ``actor.optim``.

    ``foreach``: one multi-tensor kernel per update term instead of a loop over parameters
    (torch picks it by default only for CUDA tensors). Over FSDP's DTensor parameters the
    per-parameter loop paid DTensor's dispatch a dozen times per parameter: on the CPU
    demo's model it took 8.5 ms of a 0.13 s step."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim_cfg.lr,
        betas=optim_cfg.betas,
        weight_decay=optim_cfg.weight_decay,
        foreach=True,
    )


def lr_factor(
    step: int, *, warmup: int, total: int | None, kind: str, min_ratio: float = 0.0
) -> float:
    """Multiplier of the base learning rate at learner step ``step`` (0-based).

    Linear warmup over ``warmup`` steps (the first step already uses ``1 / warmup``, not
    0), then ``constant``, or ``cosine``/``linear`` decay to ``min_ratio`` at ``total``.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    if total is None:
        raise ValueError(f"lr_scheduler_type={kind} needs trainer.total_training_steps")
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if kind == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return 1.0 - (1 - min_ratio) * progress
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")


def schedule_factor(optim_cfg: OptimConfig, total_steps: int | None) -> Callable[[int], float]:
    """The multiplier of ``optim_cfg.lr`` at each schedule step (0-based; :func:`lr_factor`
    with the config's warmup, kind and floor). Raises ValueError for a decay with no total."""
    lr_factor(0, warmup=0, total=total_steps, kind=optim_cfg.lr_scheduler_type)  # validate now
    warmup = optim_cfg.warmup_steps(total_steps)

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup=warmup,
            total=total_steps,
            kind=optim_cfg.lr_scheduler_type,
            min_ratio=optim_cfg.min_lr_ratio,
        )

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig, total_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepped once per learner step (:func:`schedule_factor`)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_factor(optim_cfg, total_steps))


def schedule_text(optim_cfg: OptimConfig, total_steps: int | None) -> str:
    """What the schedule does, in words for a log line: ``warms up over 2 steps, then
    decays (cosine) to 0 after step 12``."""
    lr, kind = optim_cfg.lr, optim_cfg.lr_scheduler_type
    warmup = optim_cfg.warmup_steps(total_steps)
    if kind == "constant":
        after = f"stays at {lr:.3g}"
    else:
        start = "" if warmup > 0 else f" from {lr:.3g}"
        floor = lr * optim_cfg.min_lr_ratio
        after = f"decays ({kind}){start} to {floor:.3g} after step {total_steps}"
    return f"warms up over {warmup} steps, then {after}" if warmup > 0 else after


def reapply_optim_config(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    optim_cfg: OptimConfig,
    prefix: str,
) -> list[str]:
    """Set the config's ``lr``, ``weight_decay`` and ``betas`` on an optimizer and its
    schedule restored from a checkpoint, which carry the values the checkpoint was saved
    with (a resume with a new learning rate trained on at the old one, silently). Returns
    one line per value changed (``prefix``: the config group, e.g. ``actor.optim``)."""
    changes = []
    betas = tuple(optim_cfg.betas)
    wanted: dict[str, object] = {"lr": optim_cfg.lr, "weight_decay": optim_cfg.weight_decay}
    wanted["betas"] = betas
    for i, group in enumerate(optimizer.param_groups):
        saved: dict[str, object] = {"lr": scheduler.base_lrs[i], "betas": tuple(group["betas"])}
        saved["weight_decay"] = group["weight_decay"]
        for key, value in wanted.items():
            if saved[key] != value and i == 0:
                changes.append(f"{prefix}.{key}={value} (the checkpoint's was {saved[key]})")
        scheduler.base_lrs[i] = group["initial_lr"] = optim_cfg.lr
        group["weight_decay"], group["betas"] = optim_cfg.weight_decay, betas
        # The rate of the step the schedule is at, from the new base and under the new
        # schedule (a raised trainer.total_training_steps moves a decay's rate here).
        group["lr"] = optim_cfg.lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
    # The rates a save keeps as the schedule's own (a resume compares them with its config's):
    # these, not the checkpoint's, until the next step sets them.
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changes


def grad_norm_and_clip(model: nn.Module, max_norm: float) -> float:
    """Global gradient norm (all ranks agree on it) and clip to ``max_norm``.

    Non-finite norms are returned as they are; the caller then skips the update.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def step_if_finite(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    finite: bool,
    *,
    world_size: int,
    device: torch.device,
) -> tuple[float, bool]:
    """Clip the gradient and step ``optimizer`` unless the loss (``finite`` False) or the
    gradient norm is not finite on some rank; zero the gradients either way. Every rank
    takes the same decision (one all-reduce), or the shards would diverge. Returns the
    gradient norm and whether the step was taken."""
    gnorm = grad_norm_and_clip(model, max_norm)
    flag = torch.tensor([0.0 if finite and math.isfinite(gnorm) else 1.0], device=device)
    if world_size > 1:
        dist.all_reduce(flag)
    ok = flag.item() == 0
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return gnorm, ok
