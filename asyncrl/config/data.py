"""The ``data`` group: the prompt files (veRL's parquet schema) and how prompts are cut."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from asyncrl.config.section import Section


class DataConfig(Section):
    train_files: list[str] = Field(
        default_factory=lambda: ["artifacts/data/arithmetic/train.parquet"],
        description="Training prompts: parquet files in veRL's schema (a path, a list, or a "
        "pattern of shards such as data/train-*.parquet).",
    )
    val_files: list[str] = Field(
        default_factory=lambda: ["artifacts/data/arithmetic/val.parquet"],
        description="Validation prompts: parquet files in veRL's schema (a path, a list, or "
        "a pattern of shards).",
    )
    prompt_key: str = Field(default="prompt", description="Column holding the chat messages.")
    max_prompt_length: int = Field(
        default=64,
        gt=0,
        description="Prompt token limit; a longer prompt is cut (data.truncation) or dropped "
        "(data.filter_overlong_prompts).",
    )
    max_response_length: int = Field(
        default=8, gt=0, description="Generated tokens per response, at most."
    )
    train_batch_size: int = Field(
        default=16, gt=0, description="Prompts (GRPO groups) per learner step, as in veRL."
    )
    shuffle: bool = Field(default=True, description="Shuffle the training prompts each epoch.")
    seed: int = Field(default=1, description="Seed of the prompt order.")
    filter_overlong_prompts: bool = Field(
        default=False,
        description="Drop a prompt longer than max_prompt_length at its rollout server "
        "(counted as dropped/filtered) instead of applying data.truncation.",
    )
    truncation: Literal["left", "right", "middle", "error"] = Field(
        default="left",
        description="A prompt over max_prompt_length: keep its end (left, the chat header "
        "the model answers after), its start (right), both ends (middle), or fail the task "
        "with an error naming the fix (error, veRL's default).",
    )

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        # veRL users write a single path as often as a list, and shards as a pattern
        # (``train-*.parquet``, which veRL's dataset loader expands).
        files = [v] if isinstance(v, str) else v
        return _expand_patterns(files) if isinstance(files, list) else files


def _expand_patterns(files: list[Any]) -> list[Any]:
    """Each path with a glob pattern (``*``, ``?``, ``[``) replaced by the files it matches,
    sorted; a pattern that matches nothing stays, for the launch check to name."""
    import glob
    import os

    out: list[Any] = []
    for f in files:
        if isinstance(f, str) and glob.has_magic(f) and "://" not in f:
            out.extend(sorted(glob.glob(os.path.expanduser(f))) or [f])
        else:
            out.append(f)
    return out
