"""veRL keys with no key of the same name here: each is mapped to ours, accepted with the
reason it has no effect in this system, or refused with what to use instead.

:func:`apply_verl_keys` runs on the raw config (YAML and overrides, veRL's
``actor_rollout_ref.*`` prefixes already moved to our groups) before validation. The keys
veRL and this schema share (same name, same meaning) need no entry: the schema takes them.
Names follow veRL's ``ppo_trainer.yaml`` as of its 0.5 and 0.6 releases (older names such
as ``ppo_micro_batch_size`` are listed where scripts still use them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

_LOGPROB_PASSES = (
    "the learner computes its no-grad logprobs (proximal and reference) in the training "
    "micro-batches (actor.ppo_micro_batch_size_per_gpu, actor.ppo_max_token_len_per_gpu); "
    "the behaviour logprobs come from vLLM with each response"
)
_WEIGHT_LOADING = (
    "the rollout servers are separate vLLM engines that load the model at start and take "
    "new weights by broadcast (sync.*), not from the learner's process"
)
_LEARNER_SIZE = (
    "the learner's ranks are trainer.nproc and the rollout servers rollout.num_servers "
    "(x rollout.tensor_model_parallel_size); launch.cpus / launch.gpus place them"
)


@dataclass(frozen=True)
class VerlKey:
    """What one veRL key becomes here."""

    kind: Literal["mapped", "no_effect", "refused"]
    reason: str
    target: str = ""  # mapped: our dotted key
    convert: Callable[[Any], Any] | None = None  # mapped: veRL's value -> ours
    allowed: Callable[[Any], bool] | None = None  # refused unless this holds (then no effect)
    allowed_note: str = ""  # refused-unless: what the allowed value means here


def _no_effect(reason: str) -> VerlKey:
    return VerlKey("no_effect", reason)


VERL_KEYS: dict[str, VerlKey] = {
    "model.use_remove_padding": VerlKey(
        "mapped",
        "packed sequences: actor.sequence_layout auto packs where a varlen attention kernel "
        "makes it exact and fast (flash attention on CUDA), padded otherwise",
        target="actor.sequence_layout",
        convert=lambda v: "auto" if v else "padded",
    ),
    "rollout.name": VerlKey(
        "refused",
        "the rollout servers run vLLM only (sglang and hf engines are not built): "
        "remove rollout.name or set it to vllm",
        allowed=lambda v: str(v).lower() == "vllm",
        allowed_note="the rollout servers are vLLM engines",
    ),
    "rollout.mode": _no_effect("every rollout server is an asynchronous vLLM engine"),
    "rollout.load_format": _no_effect(_WEIGHT_LOADING),
    "rollout.layered_summon": _no_effect(_WEIGHT_LOADING),
    "rollout.log_prob_micro_batch_size": _no_effect(_LOGPROB_PASSES),
    "rollout.log_prob_micro_batch_size_per_gpu": _no_effect(_LOGPROB_PASSES),
    "rollout.log_prob_use_dynamic_bsz": _no_effect(_LOGPROB_PASSES),
    "rollout.log_prob_max_token_len_per_gpu": _no_effect(_LOGPROB_PASSES),
    "ref.log_prob_micro_batch_size": _no_effect(_LOGPROB_PASSES),
    "ref.log_prob_micro_batch_size_per_gpu": _no_effect(_LOGPROB_PASSES),
    "ref.log_prob_use_dynamic_bsz": _no_effect(_LOGPROB_PASSES),
    "ref.log_prob_max_token_len_per_gpu": _no_effect(_LOGPROB_PASSES),
    "ref.fsdp_config.param_offload": _no_effect(
        "the reference is sharded with the actor's settings and offloaded with it "
        "(actor.fsdp_config.param_offload)"
    ),
    "actor.ppo_micro_batch_size": VerlKey(
        "mapped",
        "veRL's older global micro-batch: per rank here",
        target="actor.ppo_micro_batch_size_per_gpu",
        convert=int,
    ),
    "actor.fsdp_config.grad_offload": _no_effect(
        "FSDP2 offloads gradients with the parameters (actor.fsdp_config.param_offload)"
    ),
    "trainer.n_gpus_per_node": _no_effect(_LEARNER_SIZE),
    "trainer.nnodes": _no_effect(_LEARNER_SIZE),
    "model.lora_rank": VerlKey(
        "refused",
        "LoRA is not built yet: remove actor_rollout_ref.model.lora_rank (or set it to 0) to "
        "train every weight",
        allowed=lambda v: not v,
        allowed_note="0: every weight is trained",
    ),
    "model.lora_alpha": _no_effect("LoRA is not built yet (model.lora_rank must be 0)"),
    "model.target_modules": _no_effect("LoRA is not built yet (model.lora_rank must be 0)"),
}


def pop_dotted(raw: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """Remove ``raw[a][b]...`` for ``dotted`` (and the groups it empties); (found, value)."""
    parts = dotted.split(".")
    nodes = [raw]
    for part in parts[:-1]:
        child = nodes[-1].get(part)
        if not isinstance(child, dict):
            return False, None
        nodes.append(child)
    if parts[-1] not in nodes[-1]:
        return False, None
    value = nodes[-1].pop(parts[-1])
    for depth in range(len(parts) - 1, 0, -1):  # drop groups left empty
        if not nodes[depth]:
            del nodes[depth - 1][parts[depth - 1]]
    return True, value


def _has(raw: dict[str, Any], dotted: str) -> bool:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def apply_verl_keys(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Take every key of :data:`VERL_KEYS` out of ``raw``: set what it maps to (unless our
    own key is given too: ours wins), and return ``(notes, problems)``: one line per key
    accepted with no effect or mapped, one per key refused."""
    notes: list[str] = []
    problems: list[str] = []
    for key, rule in VERL_KEYS.items():
        found, value = pop_dotted(raw, key)
        if not found:
            continue
        if rule.kind == "refused":
            if not (rule.allowed and rule.allowed(value)):
                problems.append(f"{key}={value!r} is not supported here: {rule.reason}")
            else:
                notes.append(f"veRL's {key}={value!r} is accepted: {rule.allowed_note}")
        elif rule.kind == "mapped":
            if _has(raw, rule.target):
                notes.append(f"veRL's {key}={value!r} ignored: {rule.target} is given too")
            else:
                assert rule.convert is not None
                _set(raw, rule.target, rule.convert(value))
                notes.append(f"veRL's {key}={value!r} -> {rule.target} ({rule.reason})")
        else:
            notes.append(f"veRL's {key}={value!r} has no effect here: {rule.reason}")
    return notes, problems
