"""Parquet I/O for rows in veRL's layout.

Files we write open in plain ``pandas.read_parquet`` with veRL's column names: ``prompt`` is
a list of ``{role, content}`` structs, ``reward_model`` and ``extra_info`` are structs. Each
file holds one data source, so ``ground_truth`` has one type per file (a string for
arithmetic and gsm8k, a ``{target, numbers}`` struct for countdown).

Reading goes through pyarrow's ``to_pylist``, which yields plain dicts and lists (pandas
would hand back numpy arrays inside the structs), and accepts files written by veRL, by
HuggingFace ``datasets`` or by pandas, keeping any extra fields they carry.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.tasks.schema import REQUIRED_COLUMNS, VERL_COLUMNS

logger = logging.getLogger(__name__)

# pandas stores a non-default index as a column with this prefix; it is not data.
_PANDAS_INDEX_PREFIX = "__index_level_"


def _column_order(names: Sequence[str]) -> list[str]:
    """veRL's columns first, then any others in their original order."""
    known = [c for c in VERL_COLUMNS if c in names]
    return known + [c for c in names if c not in VERL_COLUMNS]


def infer_schema(rows: Sequence[dict[str, Any]]) -> pa.Schema:
    """Return the Arrow schema of ``rows`` with veRL's columns first.

    Raises:
        ValueError: When rows disagree on a column's type (e.g. two data sources whose
            ground truths differ in type were mixed in one file).
    """
    if not rows:
        raise ValueError("cannot infer a parquet schema from zero rows; pass schema=")
    try:
        schema = pa.Table.from_pylist(list(rows)).schema
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(
            f"rows do not share one type per column ({exc}); write one data source per file"
        ) from exc
    return pa.schema([schema.field(name) for name in _column_order(schema.names)])


def write_rows(
    rows: Sequence[dict[str, Any]], path: str | Path, *, schema: pa.Schema | None = None
) -> Path:
    """Write rows to a parquet file, atomically (a reader never sees half a file).

    Args:
        rows: Rows in veRL's layout (see :mod:`asyncrl.tasks.schema`).
        path: Destination file; its directory must exist.
        schema: Arrow schema to use; inferred from ``rows`` when omitted. Needed to write
            zero rows.

    Returns:
        The path written.
    """
    path = Path(path)
    schema = infer_schema(rows) if schema is None else schema
    try:
        table = pa.Table.from_pylist(list(rows), schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(f"rows do not match the parquet schema for {path}: {exc}") from exc
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    logger.debug("wrote %d rows to %s", table.num_rows, path)
    return path


#: Columns that hold the prompt in other datasets' layouts: named as ``data.prompt_key``.
_PROMPT_LIKE = ("messages", "question", "problem", "query", "input", "instruction")


def column_problem(names: Sequence[str], path: str | Path, prompt_key: str) -> str | None:
    """Why a file with columns ``names`` cannot be read as veRL's layout (one line naming
    the fix), or None when it can."""
    required = [prompt_key if c == "prompt" else c for c in REQUIRED_COLUMNS]
    missing = [c for c in required if c not in names]
    if not missing:
        return None
    fix = f"veRL's layout needs {list(VERL_COLUMNS)}"
    if prompt_key in missing and (alike := [c for c in _PROMPT_LIKE if c in names]):
        fix = f"if {alike[0]!r} holds the chat messages, set data.prompt_key={alike[0]}; {fix}"
    columns = ", ".join(repr(c) for c in missing)
    return f"{path}: missing required column {columns} (found {list(names)}); {fix}"


def _check_columns(names: Sequence[str], path: Path, prompt_key: str) -> None:
    if (problem := column_problem(names, path, prompt_key)) is not None:
        raise ValueError(problem)


def row_problem(row: dict[str, Any], number: int, path: str | Path, prompt_key: str) -> str | None:
    """Why row ``number`` of ``path`` is not a task in veRL's layout (one line naming the
    fix), or None when it is."""
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        return (
            f"{path}: row {number}: reward_model must be a struct with 'ground_truth' "
            f"(veRL's layout: {{'ground_truth': ..., 'style': 'rule'}}), got {reward_model!r:.200}"
        )
    prompt = row[prompt_key]
    if not isinstance(prompt, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        return (
            f"{path}: row {number}: {prompt_key!r} must be a list of chat messages "
            f"[{{'role': 'user', 'content': ...}}] (write a plain-text prompt as one user "
            f"message), got {prompt!r:.200}"
        )
    return _extra_info_problem(row.get("extra_info"), number, path)


def _extra_info_problem(extra: Any, number: int, path: str | Path) -> str | None:
    """``extra_info`` must be a struct or a map with text keys (what the scorer gets as its
    ``extra_info`` dict); a JSON string, or a map keyed by numbers (which no server can
    read back), is refused here rather than failing every deal of the row."""
    if extra is None:
        return None
    # A parquet map reads as a list of (key, value) pairs.
    if isinstance(extra, list) and all(isinstance(p, tuple) and len(p) == 2 for p in extra):
        extra = dict(extra)
    if isinstance(extra, dict) and all(isinstance(k, str) for k in extra):
        return None
    what = "a dict with keys that are not text" if isinstance(extra, dict) else type(extra).__name__
    return (
        f"{path}: row {number}: extra_info must be a struct or a map with text keys (veRL's "
        f"layout: {{'split': ..., 'index': ...}}), got {what} {extra!r:.120}; write it as a "
        "struct (json.loads a JSON string before writing the file)"
    )


def read_rows(path: str | Path, *, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Read a parquet file in veRL's layout into plain Python dicts and lists.

    Args:
        path: A parquet file written by :func:`write_rows`, veRL, ``datasets`` or pandas.
        prompt_key: Column holding the chat messages (veRL's ``data.prompt_key``).

    Raises:
        FileNotFoundError: When the file does not exist.
        ValueError: When a required column is missing (the message names it and the file)
            or a row's ``prompt``/``reward_model`` has the wrong shape.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    names = pq.read_schema(path).names
    _check_columns(names, path, prompt_key)
    table = pq.read_table(path)
    keep = [n for n in table.column_names if not n.startswith(_PANDAS_INDEX_PREFIX)]
    rows = table.select(keep).to_pylist()
    for number, row in enumerate(rows):
        if (problem := row_problem(row, number, path, prompt_key)) is not None:
            raise ValueError(problem)
    return rows
