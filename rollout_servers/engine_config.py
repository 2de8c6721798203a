"""How a rollout server's vLLM engine is configured (:func:`engine_args`): logprobs of what
was actually sampled, the weight-sync worker extension, LoRA when adapters are pushed, and
the CPU's per-step token budget that keeps seeded sampling safe
(:func:`cpu_token_budget`). The running engine is :mod:`rollout_servers.engine`.

Importing this module loads no vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

#: The vLLM worker extension that receives pushed weights (rollout_servers/worker_ext.py).
EXTENSION = "rollout_servers.worker_ext.WeightSyncExtension"


# On CPU, vLLM cannot rewind a seeded request's generator after a partial (chunked)
# prefill ("CPU Generator does not use offset"): a step budget that holds every sequence's
# whole context avoids partial prefills, also when a sync makes requests recompute.
CPU_SEEDED_TOKEN_BUDGET = 65536


def cpu_token_budget(max_num_seqs: int, max_model_len: int) -> int | None:
    """The per-step token budget that keeps seeded sampling safe on CPU, or None when it
    would be too large (then requests go unseeded on CPU)."""
    need = max(max_num_seqs * max_model_len, 2048)
    return need if need <= CPU_SEEDED_TOKEN_BUDGET else None


def engine_args(
    model_path: str,
    *,
    dtype: str = "float32",
    max_model_len: int = 512,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.5,
    enforce_eager: bool = True,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int | None = None,
    hf_overrides: dict[str, Any] | None = None,
    max_lora_rank: int = 0,
    max_loras: int = 1,
) -> AsyncEngineArgs:
    """vLLM engine arguments for a rollout server: logprobs after temperature (what was
    actually sampled from) and the weight-sync worker extension. ``max_lora_rank`` > 0
    turns on vLLM's LoRA support, ``max_loras`` adapters in one batch (pushed adapters,
    ``sync.lora: adapter``)."""
    lora: dict[str, Any] = {}
    if max_lora_rank:
        lora = {
            "enable_lora": True,
            "max_lora_rank": max_lora_rank,
            "max_loras": max_loras,
            "max_cpu_loras": max_loras,
        }
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=model_path,
        dtype=cast(Any, dtype),  # a config string; vLLM refuses an unknown one
        max_model_len=max_model_len,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        # Its own worker processes, never Ray's executor: under `asyncrl-launch --ray` a
        # server must not join (or start) a Ray instance of its own.
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        logprobs_mode="processed_logprobs",
        # model.override_config: the HF config attributes the learner loads the model with
        hf_overrides=cast(Any, dict(hf_overrides or {})),
        worker_extension_cls=EXTENSION,
        disable_log_stats=True,
        **lora,
    )
