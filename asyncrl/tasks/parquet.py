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

import datetime
import decimal
import functools
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


#: A prompt in veRL's layout, for the messages that name it.
_CHAT = "[{'role': 'user', 'content': ...}]"


def row_problem(row: dict[str, Any], number: int, path: str | Path, prompt_key: str) -> str | None:
    """Why row ``number`` of ``path`` is not a task in veRL's layout (one line naming the
    fix), or None when it is. The launch check and the learner's read both ask this, so a
    bad row is named the same way, before any role starts."""
    reward_model = row["reward_model"]
    if reward_model is None:  # one row's gap, not the file's layout: that row is the fix
        return (
            f"drop or mend row {number} of {path}: its reward_model is null (veRL's layout: "
            "{'ground_truth': ..., 'style': 'rule'})"
        )
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        return (
            f"{path}: row {number}: reward_model must be a struct with 'ground_truth' "
            f"(veRL's layout: {{'ground_truth': ..., 'style': 'rule'}}), got {reward_model!r:.200}"
        )
    if (found := _textual_value(reward_model["ground_truth"])) is not None:
        return _textual_problem("reward_model['ground_truth']", found, number, path)
    if (problem := _prompt_problem(row[prompt_key], number, path, prompt_key)) is not None:
        return problem
    if "data_source" in row and row["data_source"] is None:  # it was dealt as 'None'
        return f"drop or mend row {number} of {path}: its data_source is null"
    from asyncrl.wire.types import MAX_SHORT_STR  # a trajectory's limit: each push failed

    if len(str(row.get("data_source", ""))) > MAX_SHORT_STR:
        return (
            f"drop or mend row {number} of {path}: its data_source "
            f"{str(row['data_source'])!r:.60}... is over {MAX_SHORT_STR} characters"
        )
    if (problem := _agent_name_problem(row.get("agent_name"), number, path)) is not None:
        return problem
    return _extra_info_problem(row.get("extra_info"), number, path)


@functools.cache
def agent_name_limit() -> int:
    """The longest ``agent_name`` a task message carries (the wire's own limit: a longer
    one fails to decode at the rollout server, which then stops)."""
    import msgspec

    from asyncrl.control.messages import Task

    info = msgspec.inspect.type_info(Task)
    assert isinstance(info, msgspec.inspect.StructType)
    field = next(f for f in info.fields if f.name == "agent_name")
    assert isinstance(field.type, msgspec.inspect.StrType) and field.type.max_length
    return field.type.max_length


def _agent_name_problem(agent: Any, number: int, path: str | Path) -> str | None:
    """veRL's per-row agent (null: ``single_turn``) must be a name the task message
    carries."""
    if agent is None or (isinstance(agent, str) and len(agent) <= agent_name_limit()):
        return None
    return (
        f"drop or mend row {number} of {path}: its agent_name {agent!r:.80} is not a name "
        f"of at most {agent_name_limit()} characters ('single_turn', 'tool_agent')"
    )


def _prompt_problem(prompt: Any, number: int, path: str | Path, key: str) -> str | None:
    """Why a row's prompt is no conversation a chat template renders, or None. An empty
    list or a message without text reached the tokenizer at a rollout server, which
    failed on every retry in a traceback naming neither the file nor the row."""
    mend = f"drop or mend row {number} of {path}"
    if prompt is None:
        return f"{mend}: its {key!r} is null (veRL's layout: a list of chat messages {_CHAT})"
    if not isinstance(prompt, list):  # the file's layout: every row is written this way
        return (
            f"{path}: row {number}: {key!r} must be a list of chat messages {_CHAT} (write a "
            f"plain-text prompt as one user message), got {prompt!r:.200}"
        )
    if not prompt:
        return (
            f"{mend}: its {key!r} is an empty list (a prompt needs at least one chat message, "
            f"e.g. {_CHAT})"
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return (
                f"{path}: row {number}: {key!r} must be a list of chat messages {_CHAT}, but "
                f"its message {i} is {message!r:.200}: write every message with the keys "
                "'role' and 'content'"
            )
        if (what := _message_problem(message)) is not None:
            return f"{mend}: message {i} of its {key!r} {what}"
    return None


def _message_problem(message: dict[str, Any]) -> str | None:
    """What is wrong with one chat message's role or content (None: nothing). Content is
    text, or a list of text parts (``{'type': 'text', 'text': ...}``, which some chat
    templates render); an assistant message that calls tools may carry none, as in
    OpenAI's format."""
    role, content = message["role"], message["content"]
    if not isinstance(role, str):
        return f"has role {role!r:.80} (a role is text: 'system', 'user', 'assistant', ...)"
    if isinstance(content, str) or (content is None and message.get("tool_calls")):
        return None
    if isinstance(content, list) and all(_is_text_part(part) for part in content):
        return None
    what = "null" if content is None else f"{type(content).__name__} {content!r:.120}"
    return (
        f"has content {what} (content is text, or a list of {{'type': 'text', 'text': ...}} parts)"
    )


def _is_text_part(part: Any) -> bool:
    return (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
    )


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
        if (found := _textual_value(extra)) is not None:
            return _textual_problem("extra_info", found, number, path)
        return _tools_kwargs_problem(extra.get("tools_kwargs"), number, path)
    what = "a dict with keys that are not text" if isinstance(extra, dict) else type(extra).__name__
    return (
        f"{path}: row {number}: extra_info must be a struct or a map with text keys (veRL's "
        f"layout: {{'split': ..., 'index': ...}}), got {what} {extra!r:.120}; write it as a "
        "struct (json.loads a JSON string before writing the file)"
    )


#: What parquet's timestamp, date, time, duration and decimal columns read as: the task
#: message (msgpack) carries them as text, so a scorer written for veRL, which gets the
#: objects themselves, would compare a string without a word.
_TEXT_ON_THE_WIRE = (datetime.date, datetime.time, datetime.timedelta, decimal.Decimal)


def _textual_value(value: Any, where: str = "") -> tuple[str, Any] | None:
    """The first value under ``value`` (a row's ground truth or ``extra_info``, nested
    structs, maps and lists included) of a type in :data:`_TEXT_ON_THE_WIRE`, as
    ``(where, value)``."""
    if isinstance(value, _TEXT_ON_THE_WIRE):
        return where, value
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for key, item in items:
        if (found := _textual_value(item, where + key)) is not None:
            return found
    return None


def _textual_problem(column: str, found: tuple[str, Any], number: int, path: str | Path) -> str:
    """The line refusing row ``number`` for a value of ``column`` (at ``found``'s place
    under it) that the task message would turn into text: the ground truth and
    ``extra_info`` reach a scorer written for veRL, which expects the objects."""
    where, value = found
    return (
        f"drop or mend row {number} of {path}: its {column}{where} is a "
        f"{type(value).__name__} ({value!r:.60}), which would reach the scorer as text "
        "(the task message carries no such type); write it as text or a number "
        "(an ISO date string, a Unix time, a float) when writing the file"
    )


def _as_map(value: Any) -> dict[str, Any] | None:
    """``value`` as a dict when it is a struct or a map with text keys (read as ``(key,
    value)`` pairs), else None."""
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value
    ):
        return dict(value)
    return None


def _tools_kwargs_problem(tools_kwargs: Any, number: int, path: str | Path) -> str | None:
    """``extra_info.tools_kwargs`` must map tool names to ``{'create_kwargs': {...}}``
    (veRL's layout; a tool or a ``create_kwargs`` left null is none): a JSON string, or a
    ``create_kwargs`` that is no mapping, failed the row's first tool call on every deal."""
    if tools_kwargs is None:
        return None
    by_name = _as_map(tools_kwargs)
    found = ("", tools_kwargs) if by_name is None else _bad_tool_entry(by_name)
    if found is None:
        return None
    where, bad = found
    return (
        f"drop or mend row {number} of {path}: its extra_info.tools_kwargs{where} is a "
        f"{type(bad).__name__} {bad!r:.80}, not a mapping (veRL's layout: {{'<tool name>': "
        "{'create_kwargs': {...}}}); write it as a struct (json.loads a JSON string before "
        "writing the file)"
    )


def _bad_tool_entry(by_name: dict[str, Any]) -> tuple[str, Any] | None:
    """The first tool entry of ``tools_kwargs`` (or its ``create_kwargs``) that is no
    mapping, as (where, value); None when all are."""
    for name, entry in by_name.items():
        if entry is None:
            continue
        fields = _as_map(entry)
        if fields is None:
            return f"[{name!r}]", entry
        given = fields.get("create_kwargs")
        if given is not None and _as_map(given) is None:
            return f"[{name!r}]['create_kwargs']", given
    return None


def read_rows(path: str | Path, *, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Read a parquet file in veRL's layout into plain Python dicts and lists; a message
    whose content is a list of text parts gets them as one string (see
    :func:`_joined_text_parts`).

    Args:
        path: A parquet file written by :func:`write_rows`, veRL, ``datasets`` or pandas.
        prompt_key: Column holding the chat messages (veRL's ``data.prompt_key``).

    Raises:
        FileNotFoundError: When the file does not exist.
        ValueError: When a required column is missing (the message names it and the file)
            or a row's ``prompt``/``reward_model`` has the wrong shape.
    """
    path = Path(path).expanduser()  # as the launch check finds it
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
        row[prompt_key] = _joined_text_parts(row[prompt_key])
    return rows


def _joined_text_parts(prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with content given as text parts (``[{'type': 'text', 'text': ...}]``,
    OpenAI's form) made one string, the parts joined by newlines as vLLM's chat parser
    joins them: a chat template that adds content to strings (Qwen's, this repository's)
    fails on a list, and a tokenizer without one would read the list's repr."""
    return [
        {**m, "content": "\n".join(part["text"] for part in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in prompt
    ]
