"""Prompt datasets in veRL's parquet layout: generators, readers and ``prepare_task_data``.

Built-in generators (see :data:`TASKS`):

- ``arithmetic``: ``"3+5="`` -> ``"8"``, for the CPU demo model.
- ``calculator``: ``"47*29="``, played with tools (``add``/``mul``) by the agent demo.
- ``countdown``: TinyZero's countdown prompts, each solvable by construction.

gsm8k is read, not generated (:mod:`asyncrl.tasks.gsm8k`). This package imports only the
standard library at import time; pyarrow is loaded when files are read or written, so the
reward workers that import the scorers stay light.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.tasks import arithmetic, calculator, countdown, gsm8k
from asyncrl.tasks.schema import TRAIN_SPLIT, VAL_SPLIT, make_row, prompt_text

if TYPE_CHECKING:  # at run time __getattr__ loads them (and pyarrow) on first use
    from asyncrl.tasks.parquet import read_rows, write_rows

logger = logging.getLogger(__name__)

#: A generator takes ``n_train``, ``n_val``, ``seed`` and task options and returns
#: ``(train_rows, val_rows)``.
TaskGenerator = Callable[..., tuple[list[dict[str, Any]], list[dict[str, Any]]]]

TASKS: dict[str, TaskGenerator] = {
    "arithmetic": arithmetic.generate,
    "calculator": calculator.generate,
    "countdown": countdown.generate,
}

__all__ = [
    "TASKS",
    "TRAIN_SPLIT",
    "VAL_SPLIT",
    "TaskGenerator",
    "arithmetic",
    "calculator",
    "countdown",
    "gsm8k",
    "make_row",
    "prepare_task_data",
    "read_rows",
    "write_rows",
]


def __getattr__(name: str) -> Any:
    """Expose ``read_rows``/``write_rows`` without importing pyarrow with the package."""
    if name in ("read_rows", "write_rows"):
        from asyncrl.tasks import parquet

        return getattr(parquet, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _filter_long(
    rows: list[dict[str, Any]],
    count_prompt_tokens: Callable[[list[dict[str, Any]]], int] | None,
    max_prompt_length: int | None,
) -> tuple[list[dict[str, Any]], int]:
    """Drop rows whose prompt is longer than ``max_prompt_length`` tokens; re-index the rest."""
    if max_prompt_length is not None and count_prompt_tokens is not None:
        kept = [r for r in rows if count_prompt_tokens(r["prompt"]) <= max_prompt_length]
    else:
        kept = rows
    # Keep extra_info.index equal to the row's position, as veRL's preprocessing writes it.
    for index, row in enumerate(kept):
        row["extra_info"]["index"] = index
    return kept, len(rows) - len(kept)


def prepare_task_data(
    task: str,
    out_dir: Path,
    *,
    n_train: int | None = None,
    n_val: int | None = None,
    seed: int = 0,
    count_prompt_tokens: Callable[[list[dict[str, Any]]], int] | None = None,
    max_prompt_length: int | None = None,
    **task_kwargs: Any,
) -> dict[str, Any]:
    """Generate a task, drop over-long prompts, and write ``train.parquet`` and ``val.parquet``.

    veRL silently drops prompts longer than ``data.max_prompt_length`` at load time; doing it
    here instead makes the count visible in the report. The same arguments give
    byte-identical files.

    Args:
        task: A key of :data:`TASKS`.
        out_dir: Directory for the two files (created if missing).
        n_train: Training rows before filtering (task default when None).
        n_val: Validation rows before filtering (task default when None).
        seed: Generation seed.
        count_prompt_tokens: Counts the tokens of a prompt's chat messages (e.g. by applying
            the model's chat template). Required when ``max_prompt_length`` is set.
        max_prompt_length: Longest prompt kept, in tokens; None keeps all.
        **task_kwargs: Task options, e.g. ``max_operand=20`` or ``ops=("+", "-")``.

    Returns:
        ``{"task", "seed", "max_prompt_length", "train": {...}, "val": {...}}`` where each
        split reports ``path``, ``written`` and ``filtered`` (dropped as too long).

    Raises:
        KeyError: Unknown task.
        ValueError: Bad task options, or ``max_prompt_length`` without a token counter.
    """
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; known tasks: {sorted(TASKS)}")
    if max_prompt_length is not None and count_prompt_tokens is None:
        raise ValueError("max_prompt_length needs count_prompt_tokens to measure prompts")
    # Imported here so `import asyncrl.tasks` does not load pyarrow.
    from asyncrl.tasks.parquet import infer_schema, write_rows

    train, val = TASKS[task](n_train=n_train, n_val=n_val, seed=seed, **task_kwargs)
    overlap = {prompt_text(r) for r in train} & {prompt_text(r) for r in val}
    if overlap:  # generators guarantee this; a failure here is a bug, not a user error
        raise RuntimeError(f"{task}: {len(overlap)} prompts are in both train and val")
    # One schema for both files, taken before filtering, so an emptied split still writes.
    schema = infer_schema(train + val)
    report: dict[str, Any] = {"task": task, "seed": seed, "max_prompt_length": max_prompt_length}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for name, rows in (("train", train), ("val", val)):
        kept, filtered = _filter_long(rows, count_prompt_tokens, max_prompt_length)
        path = out_dir / f"{name}.parquet"
        built.append((write_rows(kept, out_dir / f".{name}.parquet.new", schema=schema), path))
        report[name] = {"path": str(path), "written": len(kept), "filtered": filtered}
        logger.info(
            "%s %s: wrote %d rows to %s (%d longer than max_prompt_length=%s dropped)",
            task,
            name,
            len(kept),
            path,
            filtered,
            max_prompt_length,
        )
    # Both files appear together, val last (what ``make`` and the benchmarks look for): a
    # build cut short between them left a new train.parquet beside an older val.parquet.
    for new, path in built:
        os.replace(new, path)
    return report
