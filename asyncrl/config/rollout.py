"""The ``rollout`` group: the rollout servers' engines, sampling and multi-turn episodes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.logprob import LogProbPass
from asyncrl.config.section import Section


class MultiTurnConfig(Section):
    """Multi-turn, tool-using episodes (veRL's ``actor_rollout_ref.rollout.multi_turn``
    names). Rows whose ``agent_name`` is ``tool_agent`` run as episodes; others stay single
    turn."""

    enable: bool = Field(default=False, description="Run tool_agent rows as multi-turn episodes.")
    max_assistant_turns: int | None = Field(
        default=None, gt=0, description="Assistant turns per episode at most (None: until done)."
    )
    max_user_turns: int | None = Field(
        default=None, gt=0, description="Tool/user turns per episode at most (None: no limit)."
    )
    max_parallel_calls: int = Field(
        default=1, gt=0, description="Tool calls of one assistant turn that are run."
    )
    max_tool_response_length: int = Field(
        default=256, gt=0, description="Characters of a tool's answer kept."
    )
    tool_response_truncate_side: Literal["left", "middle", "right"] = Field(
        default="middle", description="Which part of a long tool answer is kept."
    )
    tool_config_path: str | None = Field(
        default=None, description="YAML naming the tools (veRL's tool config format)."
    )
    format: Literal["hermes"] = Field(
        default="hermes", description="How tool calls are written: <tool_call>{json}</tool_call>."
    )
    tool_timeout_s: float = Field(
        default=10.0, gt=0, description="A tool call running longer is killed (an env error)."
    )
    tool_workers: int = Field(default=2, gt=0, description="Tool processes per rollout server.")
    tool_max_memory_mb: int = Field(
        default=8192,
        ge=0,
        description="Memory each tool process may take, in MiB; 0: no cap. A call that runs "
        "out of memory under it is an out_of_memory error (the model reads it) and its "
        "process is replaced; counted as reward.max_memory_mb counts.",
    )
    tool_startup_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A tool worker that has not imported and built its tools by then stops "
        "the server before its engine (exit 2); raise it for tools that load much on import.",
    )
    episode_timeout_s: float = Field(
        default=600.0, gt=0, description="An episode running longer ends where it is."
    )


class OpenAIEndpointConfig(Section):
    """An OpenAI-compatible ``/v1/chat/completions`` on every rollout server, for agents
    that run outside the run: each session's tokens, logprobs and versions are recorded, and
    a group of sessions trains once each has its reward (``POST /rl/reward``)."""

    enable: bool = Field(default=False, description="Serve /v1/chat/completions and /rl/reward.")
    host: str = Field(
        default="127.0.0.1",
        description="Bind address; a non-loopback one also needs endpoints.insecure=true "
        "(anyone who reaches it adds training data).",
    )
    port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Port (0: a free one, the same again when the server restarts); each "
        "server writes its base URL to <run dir>/openai_endpoints/<server id>.json.",
    )
    group_size: int | None = Field(
        default=None, gt=0, description="Sessions per group (None: rollout.n)."
    )
    group_idle_s: float = Field(
        default=60.0,
        gt=0,
        description="A group with no request, reward or finished turn this long is closed: "
        "its rewarded sessions train when they form a baseline, else its budget slot is given "
        "back (raise it for agents whose tools think longer).",
    )
    max_groups: int = Field(
        default=64, gt=0, description="Open groups per server at once (429 beyond)."
    )
    slot_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="A new group's first request is held this long while no training slot "
        "is free (the staleness budget is full, or max_groups are open) before its 429: "
        "OpenAI clients retry only twice by default (0: refuse at once).",
    )
    take_tasks: bool = Field(
        default=True,
        description="Also generate the dataset's tasks (false: serve only the endpoint).",
    )
    reward_range: tuple[float, float] | None = Field(
        default=None,
        description="[low, high]: a /rl/reward outside it is refused with 400 (None: any "
        "finite reward).",
    )


class ValKwargs(Section):
    temperature: float = Field(
        default=0.0, ge=0, description="Validation temperature (0 = greedy)."
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Validation nucleus sampling.")
    top_k: int = Field(
        default=-1, ge=-1, description="Validation top-k (-1 or 0 = off, as vLLM reads them)."
    )
    n: int = Field(default=1, gt=0, description="Validation samples per prompt.")


class RolloutConfig(LogProbPass):
    """The rollout servers; the ``log_prob_*`` keys (veRL's) size the learner's proximal
    logprob pass."""

    num_servers: int = Field(default=2, gt=0, description="Rollout servers (one vLLM engine each).")
    n: int = Field(default=8, gt=0, description="Samples per prompt (the GRPO group size).")
    temperature: float = Field(
        default=1.0, gt=0, description="Training sampling temperature; the learner uses the same."
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="Must stay 1 for training (see rules)."
    )
    top_k: int = Field(default=-1, description="Must stay off (-1 or 0) for training (see rules).")
    max_inflight: int = Field(
        default=128, gt=0, description="Concurrent sequences per rollout server."
    )
    tensor_model_parallel_size: int = Field(default=1, gt=0, description="vLLM tensor parallelism.")
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="vLLM memory share on GPU (ignored on CPU)."
    )
    cpu_kvcache_space_gb: int = Field(
        default=1,
        ge=1,
        description="vLLM KV cache size in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE).",
    )
    enforce_eager: bool | Literal["auto"] = Field(
        default="auto",
        description="Skip vLLM's compilation and CUDA graph capture: auto skips them on CPU "
        "(no graphs there, and compiling a small model costs more start-up than it saves) "
        "and for runs under 100 learner steps; false always compiles.",
    )
    inline_engine: bool | Literal["auto"] = Field(
        default="auto",
        description="Run vLLM's engine core inside the rollout server's process, stepped by "
        "a thread, instead of a child process: no per-step hand-over of outputs between "
        "processes. auto: on CPU with one worker and sync_mode keep; needs sync_mode keep.",
    )
    sync_mode: Literal["keep", "abort"] = Field(
        default="keep",
        description="At a weight push: keep in-flight requests running under the new "
        "weights, or abort and re-submit them with their generated prefix.",
    )
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    openai_endpoint: OpenAIEndpointConfig = Field(default_factory=OpenAIEndpointConfig)
