"""What every key of veRL's trainer config becomes here.

veRL's ``ppo_trainer.yaml`` (the leaves are listed, with their defaults, in
``verl_ppo_trainer_keys.yaml`` beside this file) is the config our users arrive with. Each
of its keys is, here, implemented, mapped, no_effect or refused: one :class:`~asyncrl.
config.verl_key.VerlKey` per key in :data:`VERL_KEYS`, written with the shorthand below
(:mod:`asyncrl.config.verl_key` says what each kind means, and reads a veRL key's prefix
as our group's).

:mod:`asyncrl.config.verl_compat` applies the table when a config loads; ``tests/
test_verl_table.py`` walks every row through the loader, so the table cannot drift from
the code. ``python -m asyncrl.config.verl_doc markdown`` prints it as ``VERL_KEYS.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError

from asyncrl.config.policy import VERL_KL_NAMES
from asyncrl.config.verl_key import VerlKey, lookup, unchanged


def _flag(value: Any) -> Any:
    """A veRL switch as our boolean keys read it (``off``, ``no``, ``0`` are false; null is
    off), or the value itself when it is no switch, for the target's schema to refuse."""
    if value is None:
        return False
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return value


def _switch(on: Any, off: Any) -> Callable[[Any], Any]:
    """A mapped switch's converter: ``on`` or ``off`` as :func:`_flag` reads the value."""

    def convert(value: Any) -> Any:
        flag = _flag(value)
        return flag if not isinstance(flag, bool) else on if flag else off

    return convert


def _impl(note: str = "", example: Any = ..., reads_as=None) -> VerlKey:
    """Our key of the same name; ``reads_as``: how the schema reads veRL's spelling."""
    return VerlKey("implemented", note, convert=reads_as, example=example)


def _map(
    target: str | tuple[str, ...],
    reason: str,
    convert=None,
    example: Any = ...,
    null_target_unset: bool = False,
):
    targets = (target,) if isinstance(target, str) else target
    return VerlKey(
        "mapped",
        reason,
        targets,
        convert or unchanged,
        example=example,
        null_target_unset=null_target_unset,
    )


#: veRL's older global micro-batch keys: veRL divides them by the data-parallel size.
GLOBAL_MICRO = (
    "veRL's older global micro-batch: divided by the learner's ranks (trainer.nproc x "
    "launch.ray.learner_nodes), as veRL does"
)


def _global_micro(target: str) -> VerlKey:
    return VerlKey(
        "mapped",
        GLOBAL_MICRO,
        (target,),
        lambda v: v,
        example=8,
        per_rank=True,
        null_target_unset=True,
    )


def _none(reason: str, example: Any = ...) -> VerlKey:
    return VerlKey("no_effect", reason, example=example)


def _only(reason: str, allowed: Callable[[Any], bool], bad: Any) -> VerlKey:
    """Refused unless ``allowed(value)``."""
    return VerlKey("refused", reason, allowed=lambda v, raw: allowed(v), bad=bad)


def _falsy(v: Any) -> bool:
    return not v


def _get(raw: dict[str, Any], dotted: str, default: Any = None) -> Any:
    found, value = lookup(raw, dotted)
    return value if found else default


def _rollout_dtype_allowed(value: Any, raw: dict[str, Any]) -> bool:
    """veRL's ``rollout.dtype`` is model.dtype's (the engine's) when it says the same, or,
    model.dtype not given, on the CPU, which runs float32 whatever it says (veRL's own
    YAML carries bfloat16: refused there, the fix, model.dtype=bfloat16, was refused too)."""
    if value == _get(raw, "model.dtype", "float32"):
        return True
    return not lookup(raw, "model.dtype")[0] and _get(raw, "trainer.device", "cpu") != "cuda"


def _rollout_dtype_accepted(value: Any, raw: dict[str, Any]) -> str:
    if value == _get(raw, "model.dtype", "float32"):
        return "it is what happens here"
    return "no effect on the CPU, whose engine and learner run float32 (model.dtype)"


def _response_length(raw: dict[str, Any]) -> Any:
    """``data.max_response_length`` as the run will have it: given, else its default."""
    from asyncrl.config.data import DataConfig

    return _get(
        raw, "data.max_response_length", DataConfig.model_fields["max_response_length"].default
    )


# ------------------------------------------------------------------ the reasons, once
KL_NAMES_NOTE = (
    "veRL's kl, mse and low_var_kl are read as k1, k2 and k3 (and kl+, low_var_kl+ as k1+, k3+)"
)
PROFILER = "veRL's profiler hooks are not built; timing/* and perf/* metrics show where time goes"
COMPILE = "the learner runs eagerly; compiling changes speed, not results"
KERNELS = "a kernel choice: the learner computes the same logprobs and entropy without it"
FSDP_TUNING = (
    "FSDP tuning: the learner shards each transformer block with FSDP2 over all its ranks "
    "(speed and memory, not results)"
)
CHECKPOINT = (
    "checkpoints always hold the model, the optimizer and the run's state (exact resume "
    "needs all three); trainer.save_freq says when"
)
ASYNC_SAVE = "checkpoints are written at the step boundary, synchronously"
SP = (
    "Ulysses sequence parallelism is not built: each learner rank holds whole sequences "
    "(memory, not results)"
)
ENTROPY_MEMORY = "a memory saver of the entropy; the learner computes it once per micro-batch"
MEMORY = "a memory saver of the learner (activations or loading), not of results"
SHM = "models and data load from their paths; shared-memory staging only speeds loading"
STRATEGY = "the learner is FSDP2 (fsdp and fsdp2 mean it); megatron is not built"
MEDIA = (
    "multi-modal prompts are not built: the prompt is text, so a data file with pictures or "
    "videos in this column, in any row, is refused at launch"
)
VAL_GREEDY = (
    "veRL validates greedily when do_sample is false whatever the temperature; here "
    "val_kwargs.temperature decides: set it to 0 (greedy) or do_sample=true"
)
LORA_OFF = (
    "the critic has no LoRA (critic.model.lora_rank must be 0); the actor's is model.lora_rank"
)
REMOTE_CODE = (
    "models and tokenizers load without remote code: a model that needs it fails to load "
    "with transformers' own message (nothing changes silently; many scripts set it for "
    "models that need none)"
)
LOSS_MODES = (
    "a parameter of the clip_cov / kl_cov / geo_mean loss modes, which are not built "
    "(actor.policy_loss.loss_mode takes vanilla or gspo)"
)
LOGPROB_PASS = (
    "the micro-batch of the learner's no-grad logprob pass ({which}); unset, the training "
    "micro-batches (actor.ppo_*)"
)
CRITIC_FORWARD = "the critic computes its values in its training micro-batches (critic.ppo_*)"
CRITIC_AS_ACTOR = "the critic is sharded and placed as the actor is (actor.fsdp_config)"
NO_RM = (
    "no reward model runs (reward_model.enable must be false): rewards come from "
    "reward.custom_reward_function, which may call a served model"
)
ENGINE = (
    "engine memory and speed: each rollout server is its own vLLM engine, not sharing the "
    "learner's GPU"
)
WEIGHT_LOADING = (
    "the rollout servers are separate vLLM engines that load the model at start and take "
    "new weights by broadcast (sync.*), not from the learner's process"
)
TEMPLATE = (
    "prompts are rendered with the model's own chat template, as the rollout servers and "
    "asyncrl-prepare do; a different template would change what the model is trained on"
)

TEMPLATE_KWARGS = (
    "prompts are rendered with the model's own chat template, called without extra "
    "arguments (the rollout servers and asyncrl-prepare alike); to get what these arguments "
    "give, edit the template in model.path's tokenizer_config.json (or chat_template.jinja) "
    "to render that way (Qwen3's enable_thinking=false appends an empty "
    "<think></think> block to the generation prompt), or write the prompts already rendered "
    "with them: a prompt whose one message holds the template's markup is used as its text"
)

# ------------------------------------------------------------------ the table
_ACTOR = "actor_rollout_ref.actor."
_REF = "actor_rollout_ref.ref."
_ROLLOUT = "actor_rollout_ref.rollout."
_MODEL = "actor_rollout_ref.model."

_TOOL_CONFIG = (
    "nsys.discrete npu.contents npu.level npu.analysis npu.discrete torch.step_start "
    "torch.step_end torch_memory.trace_alloc_max_entries torch_memory.stack_depth"
)


def _profiler(prefix: str, tool_config: bool) -> dict[str, VerlKey]:
    keys = ["tool", "enable", "all_ranks", "ranks", "save_path"]
    keys += [f"tool_config.{k}" for k in _TOOL_CONFIG.split()] if tool_config else ["tool_config"]
    return {f"{prefix}profiler.{k}": _none(PROFILER) for k in keys}


#: veRL's top-level profiler group, which its roles' profiler keys read their defaults from.
_GLOBAL_PROFILER = (
    "tool steps profile_continuous_steps save_path global_tool_config.nsys.discrete "
    + " ".join(
        f"global_tool_config.nsys.{group}_nsight_options.{k}"
        for group, keys in (
            ("controller", "trace cuda-memory-usage cuda-graph-trace"),
            (
                "worker",
                "trace cuda-memory-usage cuda-graph-trace capture-range capture-range-end kill",
            ),
        )
        for k in keys.split()
    )
    + " global_tool_config.torch_memory.trace_alloc_max_entries "
    "global_tool_config.torch_memory.stack_depth global_tool_config.torch_memory.context "
    "global_tool_config.torch_memory.stacks global_tool_config.torch_memory.kw_args"
)


def _rows(prefix: str, names: str, rule: VerlKey) -> dict[str, VerlKey]:
    """``rule`` for each of the space-separated ``names`` under ``prefix``."""
    return {prefix + n: rule for n in names.split()}


def _implemented(
    prefix: str, names: str, examples: dict[str, Any] | None = None
) -> dict[str, VerlKey]:
    """``_impl()`` for each of ``names``; ``examples``: the value the table's test sets for a
    name whose veRL default is ours too (the test must see the key change something)."""
    examples = examples or {}
    assert set(examples) <= set(names.split()), set(examples) - set(names.split())
    return {prefix + n: _impl(example=examples.get(n, ...)) for n in names.split()}


def _optim(prefix: str, scheduler: str) -> dict[str, VerlKey]:
    return {
        **_implemented(
            prefix,
            "lr weight_decay lr_warmup_steps lr_warmup_steps_ratio",
            {"lr": 2e-5, "weight_decay": 0.05, "lr_warmup_steps": 5, "lr_warmup_steps_ratio": 0.1},
        ),
        prefix + "min_lr_ratio": _impl("null means 0", 0.1, reads_as=lambda v: v or 0.0),
        prefix + "total_training_steps": _none(
            "the schedule's length is trainer.total_training_steps (veRL fills this in too)"
        ),
        prefix + "warmup_style": _map(
            scheduler, "veRL's older name of the schedule (constant, cosine)", example="cosine"
        ),
    }


def _shared_model(prefix: str) -> dict[str, VerlKey]:
    """Model keys the actor's and the critic's model share."""
    return {
        prefix + "external_lib": _only(
            "no module is imported before loading the model: register custom architectures "
            "in an installed package transformers finds",
            _falsy,
            bad="my_models",
        ),
        prefix + "trust_remote_code": _none(REMOTE_CODE, example=True),
        prefix + "use_shm": _none(SHM),
        prefix + "enable_activation_offload": _none(MEMORY),
    }


VERL_KEYS: dict[str, VerlKey] = {
    # ---------------------------------------------------------------- actor
    **_implemented(
        _ACTOR,
        "ppo_mini_batch_size ppo_micro_batch_size_per_gpu use_dynamic_bsz "
        "ppo_max_token_len_per_gpu clip_ratio_low clip_ratio_high policy_loss.loss_mode "
        "clip_ratio_c loss_agg_mode entropy_coeff use_kl_loss kl_loss_coef kl_loss_type "
        "ppo_epochs grad_clip fsdp_config.param_offload fsdp_config.optimizer_offload",
        {
            "ppo_mini_batch_size": 8,
            "ppo_max_token_len_per_gpu": 4096,
            "clip_ratio_low": 0.1,
            "policy_loss.loss_mode": "gspo",
            "clip_ratio_c": 5.0,
            "loss_agg_mode": "seq-mean-token-mean",
            "entropy_coeff": 0.01,
            "use_kl_loss": True,
            "kl_loss_coef": 0.05,
            "ppo_epochs": 2,
            "grad_clip": 0.5,
            "fsdp_config.param_offload": True,
            "fsdp_config.optimizer_offload": True,
        },
    ),
    _ACTOR + "kl_loss_type": _impl(
        KL_NAMES_NOTE, "mse", reads_as=lambda v: VERL_KL_NAMES.get(v, v)
    ),
    _ACTOR + "strategy": _only(STRATEGY, lambda v: v in ("fsdp", "fsdp2"), bad="megatron"),
    _ACTOR + "ppo_micro_batch_size": _global_micro("actor.ppo_micro_batch_size_per_gpu"),
    _ACTOR + "use_token_level_loss": _map(  # veRL's older switch, still in DAPO's scripts
        "actor.loss_agg_mode",
        "token-level loss: token-mean; otherwise seq-mean-token-mean",
        _switch("token-mean", "seq-mean-token-mean"),
        example=False,
    ),
    _ACTOR + "clip_ratio": _map(
        ("actor.clip_ratio_low", "actor.clip_ratio_high"),
        "both ends of the clip range, unless clip_ratio_low / clip_ratio_high are given",
        example=0.3,
        null_target_unset=True,  # veRL: clip_ratio_low if not None else clip_ratio
    ),
    **_rows(
        _ACTOR + "policy_loss.",
        "clip_cov_ratio clip_cov_lb clip_cov_ub kl_cov_ratio ppo_kl_coef",
        _none(LOSS_MODES),
    ),
    _ACTOR + "use_torch_compile": _none(COMPILE),
    _ACTOR + "shuffle": _only(
        "mini-batches are taken in the order the batch was assembled: remove actor.shuffle",
        _falsy,
        bad=True,
    ),
    _ACTOR + "checkpoint.save_contents": _none(CHECKPOINT),
    _ACTOR + "checkpoint.load_contents": _none(CHECKPOINT),
    _ACTOR + "checkpoint.async_save": _none(ASYNC_SAVE),
    **_optim(_ACTOR + "optim.", "actor.optim.lr_scheduler_type"),
    _ACTOR + "optim.num_cycles": _only(
        "the cosine schedule decays once from lr to min_lr_ratio (half a cycle, 0.5)",
        lambda v: float(v) == 0.5,
        bad=1.0,
    ),
    _ACTOR + "use_fused_kernels": _none(KERNELS),
    **_profiler(_ACTOR, tool_config=True),
    _ACTOR + "ulysses_sequence_parallel_size": _none(SP),
    _ACTOR + "entropy_from_logits_with_chunking": _none(ENTROPY_MEMORY),
    _ACTOR + "entropy_checkpointing": _none(ENTROPY_MEMORY),
    _ACTOR + "fsdp_config.wrap_policy.min_num_params": _none(FSDP_TUNING),
    _ACTOR + "fsdp_config.offload_policy": _map(
        ("actor.fsdp_config.param_offload", "actor.fsdp_config.optimizer_offload"),
        "FSDP2's CPU offload policy: parameters, gradients and the optimizer's state on the "
        "CPU (CUDA only)",
        example=True,
    ),
    _ACTOR + "fsdp_config.reshard_after_forward": _none(FSDP_TUNING),
    _ACTOR + "fsdp_config.fsdp_size": _none(FSDP_TUNING),
    _ACTOR + "fsdp_config.forward_prefetch": _none(FSDP_TUNING),
    _ACTOR + "fsdp_config.grad_offload": _none(  # veRL's older name, still in scripts
        "FSDP2 offloads gradients with the parameters (actor.fsdp_config.param_offload)"
    ),
    _ACTOR + "use_remove_padding": _map(
        "actor.sequence_layout",
        "packed sequences: auto packs where a varlen attention kernel makes it exact and "
        "fast (flash attention on CUDA), padded otherwise",
        _switch("auto", "padded"),
    ),
    # ---------------------------------------------------------------- reference
    _REF + "strategy": _only(STRATEGY, lambda v: v in ("fsdp", "fsdp2"), bad="megatron"),
    _REF + "use_torch_compile": _none(COMPILE),
    _REF + "log_prob_micro_batch_size": _global_micro("ref.log_prob_micro_batch_size_per_gpu"),
    **_implemented(
        _REF,
        "log_prob_micro_batch_size_per_gpu log_prob_use_dynamic_bsz log_prob_max_token_len_per_gpu",
        {"log_prob_micro_batch_size_per_gpu": 4},
    ),
    **_profiler(_REF, tool_config=True),
    _REF + "model": _only(
        "the reference is the actor's starting weights (model.path): remove ref.model",
        lambda v: v is None,
        bad={"path": "other-model"},
    ),
    _REF + "fsdp_config.wrap_policy.min_num_params": _none(FSDP_TUNING),
    _REF + "fsdp_config.param_offload": _none(
        "the reference is sharded and offloaded as the actor is (actor.fsdp_config)"
    ),
    _REF + "fsdp_config.reshard_after_forward": _none(FSDP_TUNING),
    _REF + "fsdp_config.forward_prefetch": _none(FSDP_TUNING),
    _REF + "ulysses_sequence_parallel_size": _none(SP),
    _REF + "entropy_from_logits_with_chunking": _none(ENTROPY_MEMORY),
    _REF + "entropy_checkpointing": _none(ENTROPY_MEMORY),
    # ---------------------------------------------------------------- rollout
    _ROLLOUT + "name": _only(
        "the rollout servers run vLLM only (sglang and hf engines are not built): set "
        "rollout.name=vllm or remove it",
        lambda v: str(v).lower() in ("vllm", "???"),
        bad="sglang",
    ),
    _ROLLOUT + "mode": _none("every rollout server is an asynchronous vLLM engine"),
    **_implemented(
        _ROLLOUT,
        "temperature top_k top_p gpu_memory_utilization enforce_eager "
        "tensor_model_parallel_size val_kwargs.top_k val_kwargs.top_p "
        "val_kwargs.temperature val_kwargs.n multi_turn.enable multi_turn.max_assistant_turns "
        "multi_turn.tool_config_path multi_turn.max_user_turns multi_turn.max_parallel_calls "
        "multi_turn.max_tool_response_length multi_turn.tool_response_truncate_side "
        "multi_turn.format log_prob_micro_batch_size_per_gpu log_prob_use_dynamic_bsz "
        "log_prob_max_token_len_per_gpu",
        {
            "temperature": 0.7,
            "gpu_memory_utilization": 0.7,
            "val_kwargs.top_k": 20,
            "val_kwargs.top_p": 0.9,
            "val_kwargs.temperature": 0.6,
            "val_kwargs.n": 2,
            "multi_turn.enable": True,
            "multi_turn.max_assistant_turns": 3,
            "multi_turn.tool_config_path": "tools.yaml",
            "multi_turn.max_user_turns": 2,
            "multi_turn.max_parallel_calls": 2,
            "multi_turn.max_tool_response_length": 128,
            "multi_turn.tool_response_truncate_side": "left",
            "log_prob_micro_batch_size_per_gpu": 4,
        },
    ),
    _ROLLOUT + "n": _impl(example=4),
    _ROLLOUT + "tensor_model_parallel_size": _impl(example=2),
    _ROLLOUT + "prompt_length": _map(
        "data.max_prompt_length", "the prompt limit is data's", example=32
    ),
    _ROLLOUT + "response_length": _map(
        "data.max_response_length", "the response limit is data's", example=4
    ),
    _ROLLOUT + "dtype": VerlKey(
        "refused",
        "the engine runs model.dtype, as the learner does (one dtype keeps their logprobs "
        "comparable): set model.dtype instead (on the CPU, which runs float32, it has no "
        "effect unless model.dtype is given)",
        allowed=_rollout_dtype_allowed,
        accepted=_rollout_dtype_accepted,
        bad="float16",
        bad_with=("trainer.device=cuda",),
        example="float32",
    ),
    _ROLLOUT + "ignore_eos": _only(
        "responses end at EOS: remove rollout.ignore_eos", _falsy, bad=True
    ),
    _ROLLOUT + "cudagraph_capture_sizes": _none(ENGINE),
    _ROLLOUT + "free_cache_engine": _none(ENGINE),
    _ROLLOUT + "max_num_batched_tokens": _none(ENGINE),
    _ROLLOUT + "max_model_len": _none(
        "the engine's length is data.max_prompt_length + data.max_response_length (and the "
        "multi-turn budget)"
    ),
    _ROLLOUT + "max_num_seqs": _map(
        "rollout.max_inflight", "requests a server runs at once", example=64
    ),
    _ROLLOUT + "log_prob_micro_batch_size": _global_micro(
        "rollout.log_prob_micro_batch_size_per_gpu"
    ),
    _ROLLOUT + "disable_log_stats": _none("the servers report their own metrics (rollout/*)"),
    _ROLLOUT + "do_sample": _only(
        "training samples (rollout.temperature > 0): remove rollout.do_sample", bool, bad=False
    ),
    _ROLLOUT + "over_sample_rate": _only(
        "every dealt request runs to its end (none is cut to fill a batch sooner): remove "
        "rollout.over_sample_rate",
        _falsy,
        bad=0.1,
    ),
    _ROLLOUT + "multi_stage_wake_up": _none(ENGINE),
    _ROLLOUT + "engine_kwargs.vllm": _none(ENGINE),
    _ROLLOUT + "engine_kwargs.sglang": _none("the rollout servers run vLLM (rollout.name)"),
    _ROLLOUT + "val_kwargs.do_sample": VerlKey(
        "refused",
        VAL_GREEDY,
        allowed=lambda v, raw: (
            _flag(v) is True or not _get(raw, "rollout.val_kwargs.temperature", 0)
        ),
        bad=False,
        bad_with=("rollout.val_kwargs.temperature=0.6",),
        example=True,
    ),
    _ROLLOUT + "multi_turn.interaction_config_path": _only(
        "simulated-user interactions are not built (tools are): remove it", _falsy, bad="x.yaml"
    ),
    _ROLLOUT + "multi_turn.use_inference_chat_template": _none(
        "the trained tokens are the ones the engine saw and sampled (token in, token out), "
        "so nothing is re-rendered"
    ),
    _ROLLOUT + "multi_turn.tokenization_sanity_check_mode": _none(
        "nothing is re-tokenized: the trained tokens are the engine's own"
    ),
    _ROLLOUT + "calculate_log_probs": _none("the servers always return behaviour logprobs"),
    _ROLLOUT + "agent.num_workers": _none(
        "each server runs its episodes on its own event loop (rollout.max_inflight bounds them)"
    ),
    **{
        _ROLLOUT + k: _only(
            "custom agent loops are not loaded: use rollout.multi_turn (tools) or the "
            "OpenAI endpoint (rollout.openai_endpoint) for your own agent",
            lambda v: v is None,
            bad="my_agent",
        )
        for k in (
            "agent.agent_loop_config_path",
            "agent.custom_async_server.path",
            "agent.custom_async_server.name",
        )
    },
    _ROLLOUT + "update_weights_bucket_megabytes": _map(
        "sync.bucket_mb", "the weight broadcast's bucket size", example=64
    ),
    _ROLLOUT + "trace.backend": _none("tracing is not built; buffer.log_rollouts logs rollouts"),
    _ROLLOUT + "trace.token2text": _none("tracing is not built"),
    _ROLLOUT + "skip_rollout": _only(
        "rollouts are always generated: remove rollout.skip_rollout", _falsy, bad=True
    ),
    _ROLLOUT + "skip_dump_dir": _none("rollout.skip_rollout is not built"),
    **_profiler(_ROLLOUT, tool_config=False),
    _ROLLOUT + "enable_chunked_prefill": _none(ENGINE),
    _ROLLOUT + "load_format": _none(WEIGHT_LOADING),
    _ROLLOUT + "layered_summon": _none(WEIGHT_LOADING),
    "actor_rollout_ref.hybrid_engine": _none(
        "the learner and the rollout servers are separate processes (disaggregated)"
    ),
    "actor_rollout_ref.nccl_timeout": _map(
        "sync.timeout_s", "how long a weight broadcast may take, seconds"
    ),
    # ---------------------------------------------------------------- model
    **_implemented(_MODEL, "path enable_gradient_checkpointing"),
    _MODEL + "path": _impl(example="artifacts/models/other"),
    **_shared_model(_MODEL),
    _MODEL + "override_config": _impl(
        "the learner and the engine load the model with them", example={"attention_dropout": 0.0}
    ),
    _MODEL + "custom_chat_template": _only(TEMPLATE, lambda v: v is None, bad="{{ x }}"),
    _MODEL + "use_remove_padding": _map(
        "actor.sequence_layout",
        "packed sequences: auto packs where a varlen attention kernel makes it exact and "
        "fast (flash attention on CUDA), padded otherwise",
        _switch("auto", "padded"),
    ),
    _MODEL + "lora_rank": _impl(
        "adapters trained on the learner; the servers get the adapters alone (sync.lora: "
        "adapter) or the weights merged (sync.lora: merged)",
        example=8,
    ),
    _MODEL + "lora_alpha": _impl(example=32),
    _MODEL + "target_modules": _impl(example=["q_proj", "v_proj"]),
    _MODEL + "exclude_modules": _only(
        "excluding layers is not built: list the layers to adapt in "
        "actor_rollout_ref.model.target_modules instead",
        lambda v: v is None,
        bad=["o_proj"],
    ),
    _MODEL + "use_liger": _none(KERNELS),
    _MODEL + "use_fused_kernels": _none(KERNELS),
    _MODEL + "fused_kernel_options.impl_backend": _none(KERNELS),
    # ---------------------------------------------------------------- data
    **_implemented(
        "data.",
        "train_files val_files prompt_key max_prompt_length max_response_length "
        "train_batch_size shuffle filter_overlong_prompts truncation",
        {"prompt_key": "question", "shuffle": False, "filter_overlong_prompts": True},
    ),
    "data.train_files": _impl(example="artifacts/data/other/train.parquet"),
    "data.val_files": _impl(example="artifacts/data/other/val.parquet"),
    "data.train_batch_size": _impl(example=32),
    # DAPO's recipe key: the unit of filter_groups.max_num_gen_batches (prompts are dealt
    # continuously, so no generation batch is sized in advance)
    "data.gen_batch_size": _impl(example=48),
    "data.tokenizer": _only(
        "the tokenizer is model.path's (the engine's and the learner's must agree)",
        lambda v: v is None,
        bad="other-tokenizer",
    ),
    "data.use_shm": _none(SHM),
    "data.reward_fn_key": _only(
        "the reward function picks its scorer by the data_source column",
        lambda v: v == "data_source",
        bad="source",
    ),
    "data.val_batch_size": _none("validation scores every prompt of data.val_files at once"),
    "data.return_raw_input_ids": _none("the rollout servers tokenize the chat messages"),
    "data.return_raw_chat": _none("the rollout servers receive the raw chat messages"),
    "data.return_full_prompt": _none("the rollout servers receive the raw chat messages"),
    "data.dataloader_num_workers": _none("the coordinator reads the parquet files itself"),
    "data.validation_shuffle": _none("validation scores every prompt; the order is moot"),
    "data.filter_overlong_prompts_workers": _none("prompts are measured at the servers"),
    "data.image_key": _impl(MEDIA, example="image"),
    "data.video_key": _impl(MEDIA, example="video"),
    "data.return_multi_modal_inputs": _none("multi-modal prompts are not built"),
    "data.trust_remote_code": _none(REMOTE_CODE, example=True),
    **{
        f"data.{k}": _only(
            "custom dataset, sampler and data-generation classes are not loaded: prompts "
            "come from parquet files in veRL's schema, in data.shuffle's order",
            lambda v: v is None,
            bad="my_module",
        )
        for k in (
            "custom_cls.path",
            "custom_cls.name",
            "sampler.class_path",
            "sampler.class_name",
            "datagen.path",
            "datagen.name",
        )
    },
    "data.apply_chat_template_kwargs": _only(
        TEMPLATE_KWARGS, _falsy, bad={"enable_thinking": False}
    ),
    # ---------------------------------------------------------------- critic
    "critic.rollout_n": _none("the critic sees every sample; the group size is rollout.n"),
    "critic.strategy": _only(STRATEGY, lambda v: v in ("fsdp", "fsdp2"), bad="megatron"),
    "critic.enable": _none("the critic runs exactly when algorithm.adv_estimator is gae"),
    **_optim("critic.optim.", "critic.optim.lr_scheduler_type"),
    **_implemented("critic.model.", "path enable_gradient_checkpointing"),
    "critic.model.path": _impl(example="artifacts/models/other"),
    "critic.model.tokenizer_path": _none("the critic reads the actor's tokens"),
    **_shared_model("critic.model."),
    "critic.model.override_config": _only(
        "the critic loads as saved (its value head is new): edit a copy of its config.json",
        _falsy,
        bad={"attention_dropout": 0.1},
    ),
    "critic.model.use_remove_padding": _none(
        "the critic's sequence layout is the actor's (actor.sequence_layout)"
    ),
    **_rows(
        "critic.model.fsdp_config.",
        (
            "param_offload optimizer_offload offload_policy reshard_after_forward "
            "wrap_policy.min_num_params fsdp_size forward_prefetch grad_offload"
        ),
        _none(CRITIC_AS_ACTOR),
    ),
    "critic.model.lora_rank": _only(
        "the critic has no LoRA (the actor's is actor_rollout_ref.model.lora_rank): "
        "remove critic.model.lora_rank",
        _falsy,
        bad=32,
    ),
    "critic.model.lora_alpha": _none(LORA_OFF),
    "critic.model.target_modules": _none(LORA_OFF),
    **_implemented(
        "critic.",
        "ppo_mini_batch_size ppo_micro_batch_size_per_gpu use_dynamic_bsz "
        "ppo_max_token_len_per_gpu ppo_epochs cliprange_value loss_agg_mode grad_clip",
        {"ppo_micro_batch_size_per_gpu": 4, "cliprange_value": 0.2, "grad_clip": 0.5},
    ),
    "critic.ppo_mini_batch_size": _impl(example=8),
    "critic.ppo_micro_batch_size": _global_micro("critic.ppo_micro_batch_size_per_gpu"),
    "critic.forward_max_token_len_per_gpu": _none(CRITIC_FORWARD),
    "critic.forward_micro_batch_size": _none(CRITIC_FORWARD),
    "critic.forward_micro_batch_size_per_gpu": _none(CRITIC_FORWARD),
    "critic.shuffle": _only(
        "mini-batches are taken in the order the batch was assembled: remove critic.shuffle",
        _falsy,
        bad=True,
    ),
    "critic.checkpoint.save_contents": _none(CHECKPOINT),
    "critic.checkpoint.load_contents": _none(CHECKPOINT),
    "critic.checkpoint.async_save": _none(ASYNC_SAVE),
    **_profiler("critic.", tool_config=True),
    "critic.ulysses_sequence_parallel_size": _none(SP),
    # ---------------------------------------------------------------- reward model
    "reward_model.enable": _only(NO_RM, _falsy, bad=True),
    **_rows(
        "reward_model.",
        (
            "strategy model.input_tokenizer model.path model.external_lib "
            "model.trust_remote_code model.use_shm model.use_remove_padding "
            "model.use_fused_kernels model.fsdp_config.wrap_policy.min_num_params "
            "model.fsdp_config.param_offload model.fsdp_config.reshard_after_forward "
            "model.fsdp_config.fsdp_size model.fsdp_config.forward_prefetch micro_batch_size "
            "micro_batch_size_per_gpu max_length use_dynamic_bsz forward_max_token_len_per_gpu "
            "ulysses_sequence_parallel_size"
        ),
        _none(NO_RM),
    ),
    **_profiler("reward_model.", tool_config=False),
    "reward_model.reward_manager": _map(
        "reward.reward_manager",
        "how the custom scorer is called: naive and dapo by keyword; prime by position, a "
        "tuple's or list's first element being the score, as veRL's prime manager reads it "
        "(DAPO's overlong penalty is reward_model.overlong_buffer.*); batch-level managers "
        "are not built",
        example="prime",
    ),
    "reward_model.launch_reward_fn_async": _none(
        "rewards are computed at the rollout servers as each group finishes, off the learner's path"
    ),
    "reward_model.sandbox_fusion.url": _only(
        "sandbox fusion is not wired in: call your sandbox from reward.custom_reward_function",
        lambda v: v is None,
        bad="http://sandbox:8080",
    ),
    "reward_model.sandbox_fusion.max_concurrent": _none("reward_model.sandbox_fusion.url is unset"),
    "reward_model.sandbox_fusion.memory_limit_mb": _none(
        "reward_model.sandbox_fusion.url is unset"
    ),
    # DAPO's recipe keys (veRL keeps them outside ppo_trainer.yaml; its scripts spell them
    # under reward_model or custom_reward_function)
    **{
        f"{where}.{k}": _impl(example=v)
        for where in (
            "custom_reward_function.overlong_buffer",
            "reward_model.overlong_buffer",
            "reward_model.reward_kwargs.overlong_buffer_cfg",
        )
        for k, v in (("enable", True), ("len", 4), ("penalty_factor", 1.0), ("log", True))
    },
    "reward_model.reward_kwargs.max_resp_len": VerlKey(
        "refused",
        "DAPO's overlong penalty counts from data.max_response_length here: give "
        "data.max_response_length the same value (or remove max_resp_len)",
        allowed=lambda v, raw: v is None or v == _response_length(raw),
        bad=12345,
    ),
    **_implemented(
        "custom_reward_function.", "path name", {"path": "my_reward.py", "name": "my_score"}
    ),
    "custom_reward_function.reward_kwargs": _impl(
        "keyword arguments bound to the scoring function", example={"alpha": 2}
    ),
    # ---------------------------------------------------------------- algorithm
    **_implemented(
        "algorithm.",
        "gamma lam adv_estimator norm_adv_by_std_in_grpo use_kl_in_reward "
        "kl_ctrl.type kl_ctrl.kl_coef kl_ctrl.horizon kl_ctrl.target_kl",
        {
            "gamma": 0.99,
            "lam": 0.95,
            "norm_adv_by_std_in_grpo": False,
            "use_kl_in_reward": True,
            "kl_ctrl.type": "adaptive",
            "kl_ctrl.kl_coef": 0.01,
            "kl_ctrl.horizon": 5000,
            "kl_ctrl.target_kl": 0.2,
        },
    ),
    "algorithm.filter_groups.enable": _impl(example=True),
    "algorithm.filter_groups.metric": _impl(example="score"),
    "algorithm.filter_groups.max_num_gen_batches": _impl(example=10),
    "algorithm.kl_penalty": _impl(
        KL_NAMES_NOTE, "low_var_kl", reads_as=lambda v: VERL_KL_NAMES.get(v, v)
    ),
    "algorithm.use_pf_ppo": _only(
        "policy-filtered PPO's resampling is not built: remove algorithm.use_pf_ppo",
        _falsy,
        bad=True,
    ),
    "algorithm.pf_ppo.reweight_method": _none("algorithm.use_pf_ppo must be false"),
    "algorithm.pf_ppo.weight_pow": _none("algorithm.use_pf_ppo must be false"),
    **_rows("global_profiler.", _GLOBAL_PROFILER, _none(PROFILER)),
    # ---------------------------------------------------------------- trainer
    **_implemented(
        "trainer.",
        "total_epochs total_training_steps project_name experiment_name logger save_freq "
        "resume_mode resume_from_path critic_warmup default_local_dir device",
        {"resume_mode": "disable", "resume_from_path": "checkpoints/step_1", "critic_warmup": 2},
    ),
    "trainer.val_before_train": _impl(
        "before a new run's first step only: a resumed run does not validate again at its "
        "start (veRL validates on every start, resumes included; its rounds are kept in "
        "the checkpoint here, and the next one comes at test_freq)",
        example=False,
    ),
    "trainer.test_freq": _impl(
        "one more round here: a run with validation on (val_before_train or test_freq > 0) "
        "also validates its final policy when it ends; veRL's last-step round needs "
        "test_freq > 0. Set val_before_train=false test_freq=-1 for no validation at all",
    ),
    "trainer.logger": _impl(example=["console"]),
    "trainer.device": _impl(example="cuda"),
    "trainer.balance_batch": _none(
        "it spreads sequences over data-parallel ranks for speed; the ranks here take "
        "length-balanced shares (learner.plan.shard), and the update is the same"
    ),
    "trainer.log_val_generations": _none("validation is logged as scores (val/*), not texts"),
    "trainer.rollout_data_dir": _map(
        "buffer.log_rollouts",
        "rollouts are logged to rollouts.jsonl in the run directory (not at this path)",
        lambda v: v is not None,
        example="rollouts",
    ),
    "trainer.validation_data_dir": _none("validation results are metrics in the run directory"),
    "trainer.esi_redundant_time": _none("no preemption deadline is watched here"),
    "trainer.val_only": _only(
        "validation-only runs are not built (a run trains): remove trainer.val_only",
        _falsy,
        bad=True,
    ),
    "trainer.default_hdfs_dir": _none("checkpoints stay in trainer.default_local_dir"),
    "trainer.del_local_ckpt_after_load": _none("checkpoints are kept after a resume"),
    "trainer.max_actor_ckpt_to_keep": _impl(
        "keeps the newest N checkpoints, the critic's with them; null or <= 0: all",
        example=2,
    ),
    "trainer.max_critic_ckpt_to_keep": _none(
        "the critic is saved inside the learner's checkpoints (checkpoints/step_<n>/), "
        "which trainer.max_actor_ckpt_to_keep bounds"
    ),
    "trainer.ray_wait_register_center_timeout": _none(
        "roles start under launch.start_timeout_s (launch.ray.start_timeout_s on Ray)"
    ),
    "trainer.use_legacy_worker_impl": _none("there is one worker implementation"),
    **{
        key: _none(
            "Ray is started by the launcher (launch.backend=ray; launch.ray.address joins a "
            "running cluster), which sizes it from the cluster's resources",
            example=example,
        )
        for key, example in (
            ("ray_init.num_cpus", 8),
            ("ray_init.timeline_json_file", "timeline.json"),
            ("ray_kwargs.ray_init.num_cpus", 8),
            ("ray_kwargs.timeline_json_file", "timeline.json"),
        )
    },
    "trainer.n_gpus_per_node": _map(
        "trainer.nproc",
        "the learner's ranks per node; rollout servers are sized apart (rollout.num_servers "
        "x rollout.tensor_model_parallel_size)",
        example=2,
    ),
    "trainer.nnodes": _map(
        "launch.ray.learner_nodes",
        "the learner's nodes (more than one needs launch.backend=ray); rollout servers are "
        "placed apart",
        example=2,
    ),
}


def unsampled_validation(raw: dict[str, Any], spelled: dict[str, str]) -> str | None:
    """The refusal of a non-zero validation temperature given in veRL's spelling
    (``spelled``: our dotted key -> the user's) without ``val_kwargs.do_sample``, else None.
    veRL's do_sample defaults to false, so veRL validates such a config greedily; the
    explicit ``do_sample=false`` is its table row's. Read before the table's keys are
    taken out of ``raw``."""
    theirs = spelled.get("rollout.val_kwargs.temperature")
    if theirs is None or lookup(raw, "rollout.val_kwargs.do_sample")[0]:
        return None
    temperature = _get(raw, "rollout.val_kwargs.temperature", 0)
    try:
        if float(temperature) == 0:
            return None
    except (TypeError, ValueError):  # not a number: the schema names it
        return None
    return (
        f"{theirs}={temperature!r} without actor_rollout_ref.rollout.val_kwargs.do_sample "
        f"(veRL's default: false) is not supported here: {VAL_GREEDY}"
    )
