"""The ``reward`` group: how the rollout servers score responses (veRL's
``custom_reward_function`` and ``reward_model.reward_manager``), in killable processes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from asyncrl.config.recipes import OverlongBufferConfig
from asyncrl.config.section import Section


class CustomRewardConfig(Section):
    path: str | None = Field(default=None, description="Python file with the scorer (veRL's).")
    name: str = Field(default="compute_score", description="Function name in that file.")
    reward_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More keyword arguments of that function, given on every call (veRL's).",
    )

    @field_validator("reward_kwargs", mode="before")
    @classmethod
    def _null_is_none_given(cls, v: object) -> object:
        return {} if v is None else v


class RewardConfig(Section):
    custom_reward_function: CustomRewardConfig = Field(default_factory=CustomRewardConfig)
    reward_manager: Literal["naive", "prime", "dapo"] = Field(
        default="naive",
        description="How the custom scorer is called (veRL's reward_model.reward_manager): "
        "naive and dapo by keyword; prime by position, a tuple's or list's first element "
        "being the score, as veRL's prime manager reads it.",
    )
    timeout_s: float = Field(default=5.0, gt=0, description="A scorer running longer scores 0.")

    num_workers: int = Field(default=2, gt=0, description="Scorer processes per rollout server.")
    max_memory_mb: int = Field(
        default=8192,
        ge=0,
        description="Memory each scorer process may take, in MiB; 0: no cap. A sample whose "
        "scorer runs out of memory under it scores 0 (a reward error) and its process is "
        "replaced. It caps writable mappings (RLIMIT_DATA), which can exceed what is touched: "
        "thread stacks, numpy's BLAS buffers (about 40 MB per core it uses: the default leaves "
        "room for 128 cores). Processes a scorer starts get their own cap.",
    )
    startup_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest a scorer process may take to start and import the scorer's "
        "module; a slower one stops its rollout server before the engine starts.",
    )
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)

    @field_validator("reward_manager", mode="before")
    @classmethod
    def _per_sample(cls, v: object) -> object:
        if v == "batch":  # veRL's batch manager hands the scorer lists
            raise ValueError(
                "batch-level managers are not built here: write a per-sample scorer "
                "(compute_score(data_source, solution_str, ground_truth, extra_info=None)) "
                "and use naive"
            )
        return v
