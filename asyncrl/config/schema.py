"""The run configuration: one typed schema for every role.

Each field is documented once, here, in its ``description``; ``--help`` of every role
command prints these texts. Group and key names follow veRL where the concept is the same
(docs/DESIGN.md section 9); our own concepts (staleness, sync, control, endpoints, launch) get
their own groups. The policy update's groups (actor, algorithm) live in
:mod:`asyncrl.config.policy`, the critic's in :mod:`asyncrl.config.critic`, the scorers' in
:mod:`asyncrl.config.reward`; cross-field rules in :mod:`asyncrl.config.rules`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from asyncrl.config.critic import CriticConfig
from asyncrl.config.data import DataConfig
from asyncrl.config.health import HealthConfig
from asyncrl.config.logprob import RefConfig
from asyncrl.config.policy import ActorConfig, AlgorithmConfig
from asyncrl.config.reward import RewardConfig
from asyncrl.config.rollout import RolloutConfig
from asyncrl.config.section import Section


# --------------------------------------------------------------------------- model
class ModelConfig(Section):
    path: str = Field(
        default="artifacts/models/tiny",
        description="HF model directory (or hub id on machines that can reach one). "
        "The default is the tiny model built by `asyncrl-prepare model`.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Parameter dtype for vLLM and the learner (bf16 on GPU)."
    )
    enable_gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward to save memory."
    )
    override_config: dict[str, Any] = Field(
        default_factory=dict,
        description="HF config attributes set when the model loads, in the learner and the "
        "engine alike (veRL's; e.g. attention_dropout: 0.0).",
    )
    attn_implementation: str | None = Field(
        default=None,
        description="The learner's attention (transformers' attn_implementation: sdpa, "
        "eager, flash_attention_2, ...); default: transformers' choice. With a flash kernel "
        "on CUDA, actor.sequence_layout: auto packs sequences.",
    )
    lora_rank: int = Field(
        default=0,
        ge=0,
        description="LoRA rank (veRL's name): 0 trains every weight; above 0 freezes the "
        "model and trains low-rank adapters on model.target_modules.",
    )
    lora_alpha: float = Field(
        default=16, gt=0, description="LoRA scale numerator: the update is (alpha / rank) B A."
    )
    target_modules: str | list[str] = Field(
        default="all-linear",
        description="Linear layers LoRA adapts: all-linear (every one but the output head) "
        "or names such as [q_proj, v_proj].",
    )


# --------------------------------------------------------------------------- ours
class StalenessConfig(Section):
    max_policy_lag: int = Field(
        default=1,
        ge=0,
        description="Oldest data the learner trains on, in policy versions (0 = synchronous).",
    )
    sync_every: int = Field(default=1, gt=0, description="Learner steps per weight push (version).")
    lag_retries: int = Field(
        default=1,
        ge=0,
        description="Times a training prompt dropped for lag (or for a buffer full of "
        "incomplete groups) is dealt again (0: drop it).",
    )
    controller: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="fixed: admit up to max_policy_lag; adaptive: set the admission lag "
        "each step within [min_policy_lag, max_policy_lag] from the measured ESS, mismatch "
        "KL, lag drops and learner wait (staleness/lag_limit).",
    )
    pace_servers: bool = Field(
        default=True,
        description="Deal fewer groups at once to a server whose groups go stale before "
        "they are trained (asyncrl.control.pacing): a slow server's work is not wasted.",
    )
    deal_at_send: bool = Field(
        default=False,
        description="Open the next version's admission window when a push is sent, not "
        "when every server has reported it loaded; tasks dealt meanwhile wait at their "
        "server for the new weights. Faster when generation waits on the window (CPU demo "
        "2-13% in three pairs), at the price of more lag drops where one server is much "
        "slower.",
    )
    min_policy_lag: int = Field(
        default=0, ge=0, description="adaptive: the narrowest admission lag (its start)."
    )


class SyncConfig(Section):
    bucket_mb: float = Field(
        default=32.0,
        gt=0,
        description="Weight broadcast bucket size, MB (packing overlaps sending).",
    )
    timeout_s: float = Field(default=120.0, gt=0, description="Timeout of every sync collective.")
    catchup_backoff_s: float = Field(
        default=5.0,
        gt=0,
        description="Wait before retrying a failed catch-up; doubles per failure.",
    )
    catchup_backoff_max_s: float = Field(
        default=120.0, gt=0, description="Longest wait between catch-up retries to one server."
    )
    overlap_push: bool = Field(
        default=True,
        description="Send each new version while the learner trains the next step (it "
        "waits only for the previous push); false waits until every push is sent (the "
        "servers' reports still come while it trains).",
    )
    lora: Literal["adapter", "merged"] = Field(
        default="adapter",
        description="With model.lora_rank > 0: adapter pushes the adapters only and the "
        "servers serve each version with vLLM's LoRA support (a request finishes on the "
        "adapter it started with, or, once that one is older than max_policy_lag + 1 "
        "versions, on the current one); merged pushes the whole model with the adapters "
        "merged.",
    )


class ControlConfig(Section):
    heartbeat_s: float = Field(default=2.0, gt=0, description="Rollout server heartbeat period.")
    dead_after_s: float = Field(
        default=20.0, gt=0, description="Silence after which a server is declared dead."
    )
    tasks_per_request: int = Field(default=4, gt=0, description="Tasks a server asks for at once.")
    min_servers_to_start: int = Field(
        default=1, gt=0, description="Deal no task until this many rollout servers have registered."
    )
    task_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="A task outstanding this long at a live server is reclaimed and dealt again.",
    )
    task_retries: int = Field(
        default=3,
        ge=0,
        description="Times a failed or reclaimed task is dealt again before given up.",
    )
    max_message_mb: float = Field(
        default=4.0,
        gt=0,
        description="Largest request the coordinator and the buffer's batch socket read (a "
        "larger frame is never read: zmq drops the sender's connection), and largest task "
        "grant: fewer tasks per grant, and a task larger than this is dropped (oversize).",
    )


class BufferConfig(Section):
    capacity_groups: int = Field(default=1024, gt=0, description="Groups held at most.")
    policy: Literal["fifo", "uniform"] = Field(
        default="fifo", description="fifo: oldest first, once; uniform: replay up to max_reuse."
    )
    max_reuse: int = Field(default=1, gt=0, description="Times a group may be trained on.")
    log_rollouts: bool = Field(default=False, description="Write every trajectory to parquet.")
    group_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Incomplete groups expire after (counted while the buffer reads: not "
        "while it is full and its producers wait).",
    )
    max_message_mb: float = Field(
        default=64.0,
        gt=0,
        description="Largest trajectory message (one group) the buffer reads; a larger frame "
        "is never read (zmq drops the sender's connection).",
    )
    queued_messages: int = Field(
        default=1000,
        gt=0,
        description="Trajectory messages queued per rollout server while the buffer is full "
        "(zmq's receive high-water mark): beyond capacity_groups, the buffer's memory may hold "
        "this many times max_message_mb per server; then the servers' sends wait.",
    )


class EndpointsConfig(Section):
    host: str = Field(
        default="127.0.0.1", description="Address the coordinator and buffer bind and peers dial."
    )
    tasks: int = Field(default=5551, gt=0, lt=65536, description="Coordinator task port.")
    trajectories: int = Field(default=5552, gt=0, lt=65536, description="Buffer trajectory port.")
    batches: int = Field(default=5553, gt=0, lt=65536, description="Buffer batch port.")
    control: int = Field(default=5554, gt=0, lt=65536, description="Coordinator control port.")
    sync_store: int = Field(default=5555, gt=0, lt=65536, description="Weight-sync TCPStore port.")
    auth: Literal["none", "curve"] = Field(
        default="none",
        description="curve: every socket authenticated with the run's keys (ZeroMQ CURVE); "
        "required to listen on a network address unless endpoints.insecure.",
    )
    keys_dir: str | None = Field(
        default=None, description="The run's keys (asyncrl-prepare keys --out DIR), on every node."
    )
    insecure: bool = Field(
        default=False,
        description="Listen on a network address without authentication (a private network "
        "you trust).",
    )


class TrainerConfig(Section):
    total_training_steps: int | None = Field(
        default=60, gt=0, description="Learner steps; null = total_epochs over the data."
    )
    total_epochs: int = Field(default=1000, gt=0, description="Epochs cap over the training data.")
    save_freq: int = Field(
        default=20, description="Checkpoint every N steps (-1: only at the end)."
    )
    max_actor_ckpt_to_keep: int | None = Field(
        default=None,
        description="Keep the newest N checkpoints (each holds the critic too), deleting "
        "older ones after each save; null (or <= 0, as in veRL): keep all.",
    )
    test_freq: int = Field(
        default=10,
        description="Validate every N learner steps (-1: not during training). With validation on "
        "(this > 0 or val_before_train) the final policy is validated as the run ends.",
    )
    val_before_train: bool = Field(default=True, description="Validate before the first step.")
    logger: list[Literal["console", "jsonl", "wandb"]] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="Metric sinks (<run dir>/metrics.jsonl is written either way).",
    )
    project_name: str = Field(
        default="asyncrl", min_length=1, description="wandb project; run dir component."
    )
    experiment_name: str = Field(
        default="demo", min_length=1, description="wandb run name; run dir component."
    )
    default_local_dir: str = Field(
        default="runs",
        description="Run directory root: <this>/<project_name>/<experiment_name> (this "
        "itself when it already ends so, as veRL's default does).",
    )
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        default="auto", description="auto: continue from the latest checkpoint if any."
    )
    resume_from_path: str | None = Field(default=None, description="Checkpoint for resume_path.")
    seed: int = Field(default=1, description="Seed of the learner and the sampling seeds.")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="Where the roles compute.")
    nproc: int = Field(default=1, gt=0, description="Learner ranks (torchrun).")
    health: HealthConfig = Field(default_factory=HealthConfig)
    critic_warmup: int = Field(
        default=0,
        ge=0,
        description="The step the actor first trains at (gae; veRL's count): the steps "
        "before it train only the critic.",
    )

    @field_validator("logger", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v

    @field_validator("max_actor_ckpt_to_keep", mode="before")
    @classmethod
    def _a_count(cls, v: object) -> object:
        if isinstance(v, bool):  # pydantic would read true as 1
            raise ValueError("give a number of checkpoints to keep, or null to keep them all")
        return v


class RayLaunchConfig(Section):
    address: str = Field(
        default="auto",
        description="Ray cluster to join (ray.init address); auto: RAY_ADDRESS's, or the "
        "one `ray start` started here, else a local Ray instance started for the run.",
    )
    strategy: Literal["PACK", "SPREAD"] = Field(
        default="PACK", description="Placement group strategy for the run's bundles."
    )
    learner_cpus: float = Field(
        default=1.0, gt=0, description="Ray CPUs of bundle 0 (the learner ranks and the buffer)."
    )
    rollout_cpus: float = Field(
        default=1.0, gt=0, description="Ray CPUs of each rollout server's bundle."
    )
    resources: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="Custom Ray resources per bundle kind, e.g. {learner: {trainer_node: 1}, "
        "rollout: {gen_node: 1}}: ties roles to the nodes that offer them.",
    )
    learner_nodes: int = Field(
        default=1,
        ge=1,
        description="Learner nodes: one torchrun per node (trainer.nproc ranks each), meeting "
        "at bundle 0's node on rdzv_port.",
    )
    rdzv_port: int = Field(
        default=29400, gt=0, lt=65536, description="torchrun rendezvous port (learner_nodes > 1)."
    )
    start_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long a role's bundle may wait for a node with room (a lost node's "
        "bundles wait for a new one).",
    )


class LaunchConfig(Section):
    backend: Literal["local", "ray"] = Field(
        default="local",
        description="local: every role a child of asyncrl-launch on this machine; ray: "
        "placed on a Ray cluster (asyncrl-launch --ray).",
    )
    ray: RayLaunchConfig = Field(default_factory=RayLaunchConfig)
    cpus: dict[str, list[int] | list[list[int]]] | None = Field(
        default=None, description="Cores per role, e.g. {learner: [0], rollout: [[1]]}."
    )
    gpus: dict[str, list[int] | list[list[int]]] | None = Field(
        default=None, description="GPUs per role, same shape as cpus."
    )
    nice: dict[str, int | list[int]] | None = Field(
        default=None,
        description="CPU priority per role as Linux niceness, 0 (default) to 19 (lowest), "
        "e.g. {rollout: [19, 0]}: rollout takes one value per server or one for all. "
        "Lower a rollout server that shares a core with the learner, so the learner's step "
        "runs at full speed and the server takes the cycles it leaves. Local launcher only.",
    )
    start_timeout_s: float = Field(
        default=300.0, gt=0, description="How long roles wait for peers."
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Restarts per role in a row (none running restart_window_s) before the run "
        "fails.",
    )
    restart_window_s: float = Field(
        default=600.0,
        gt=0,
        description="A restarted role that runs this long before dying again starts its count "
        "of restarts over.",
    )
    restart_backoff_s: float = Field(
        default=2.0,
        ge=0,
        description="First wait before a restart; doubles per restart in a row, at most half "
        "of restart_window_s.",
    )


class Config(Section):
    """A whole run. Every role reads the groups it needs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    endpoints: EndpointsConfig = Field(default_factory=EndpointsConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
