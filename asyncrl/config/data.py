"""The ``data`` group: the prompt files (veRL's parquet schema) and how prompts are cut."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, field_validator

from asyncrl.config.section import Section

#: The demo's files (``make artifacts`` writes them): the defaults of ``data.*_files``.
DEMO_TRAIN_FILES = ("artifacts/data/arithmetic/train.parquet",)
DEMO_VAL_FILES = ("artifacts/data/arithmetic/val.parquet",)


class DataConfig(Section):
    train_files: list[str] = Field(
        default_factory=lambda: list(DEMO_TRAIN_FILES),
        description="Training prompts: parquet files in veRL's schema (a path, a list, or a "
        "pattern of shards such as data/train-*.parquet).",
    )
    val_files: list[str] = Field(
        default_factory=lambda: list(DEMO_VAL_FILES),
        description="Validation prompts: parquet files in veRL's schema (a path, a list, or "
        "a pattern of shards).",
    )
    prompt_key: str = Field(default="prompt", description="Column holding the chat messages.")
    image_key: str = Field(
        default="images",
        description="veRL's column of a row's pictures: prompts here are text, so a file "
        "with pictures in this column in any row is refused at launch.",
    )
    video_key: str = Field(
        default="videos",
        description="veRL's column of a row's videos: refused at launch as data.image_key.",
    )
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
    gen_batch_size: int | None = Field(
        default=None,
        gt=0,
        description="DAPO's generation batch (veRL's key): here only the unit of "
        "algorithm.filter_groups.max_num_gen_batches, as in veRL (prompts are dealt "
        "continuously, not in batches); null: data.train_batch_size.",
    )
    shuffle: bool = Field(default=True, description="Shuffle the training prompts each epoch.")
    seed: int = Field(default=1, description="Seed of the prompt order.")
    filter_overlong_prompts: bool = Field(
        default=False,
        description="Drop a training prompt longer than max_prompt_length at its rollout "
        "server (accounted dropped/prompt_too_long) instead of applying data.truncation; leave such "
        "validation rows out when they are loaded, as veRL does.",
    )
    truncation: Literal["left", "right", "middle", "error"] = Field(
        default="left",
        description="A prompt over max_prompt_length: keep its end (left, the chat header "
        "the model answers after), its start (right), both ends (middle), or fail the task "
        "with an error naming the fix (error, veRL's default; a validation row over the limit is "
        "then refused at start).",
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

    out: list[Any] = []
    for f in files:
        if isinstance(f, str) and glob.has_magic(f) and "://" not in f:
            out.extend(sorted(glob.glob(os.path.expanduser(f))) or [f])
        else:
            out.append(f)
    return out


def val_files_problem(data: DataConfig) -> str | None:
    """Why ``data.val_files`` cannot serve the validation rounds scheduled (one line naming
    the fix), or None. Empty: no round is dealt, nor reported. Left at the demo's while
    training on other files: the scores would be of arithmetic, not of the task trained."""
    off = "trainer.val_before_train=false trainer.test_freq=-1"
    if not data.val_files:
        return f"data.val_files is empty, so validation would never report: add files, or set {off}"
    if _same_files(data.val_files, DEMO_VAL_FILES) and not _same_files(
        data.train_files, DEMO_TRAIN_FILES
    ):
        return (
            f"data.val_files is the demo's arithmetic set ({', '.join(DEMO_VAL_FILES)}) but "
            f"data.train_files is not: set data.val_files, or {off}"
        )
    return None


def _same_files(files: Sequence[str], others: Sequence[str]) -> bool:
    """Whether two lists name the same files (``./a`` and ``a`` alike)."""
    norm = os.path.normpath
    return [norm(os.path.expanduser(f)) for f in files] == [norm(f) for f in others]
