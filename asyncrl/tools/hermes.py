"""Parse hermes-style tool calls out of an assistant's text (Qwen2.5/Qwen3, NousHermes).

A call is a block::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

``arguments`` may also be a JSON string holding the object. Pure functions: the caller
decides what a malformed block costs the model (usually an error message in the next turn).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """Each closed ``<tool_call>`` block of ``text`` in order: its start, its end and its
    inside (from an open tag to the first close tag after it). One pass over ``text``: a
    regular expression's lazy match scanned to the end from every open tag never closed,
    seconds on the server's event loop for a response that repeats the tag."""
    pos = 0
    while (start := text.find(OPEN_TAG, pos)) >= 0:
        inside = start + len(OPEN_TAG)
        if (close := text.find(CLOSE_TAG, inside)) < 0:
            return  # no later open tag is closed either
        pos = close + len(CLOSE_TAG)
        yield start, pos, text[inside:close]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a tool name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedToolCalls:
    """What :func:`parse_tool_calls` found in one assistant message.

    Attributes:
        content: The text before the first ``<tool_call>`` (all of it when there is none).
        calls: The well-formed calls, in order.
        errors: One line per malformed block, naming the block (``"tool call 2: ..."``).
        order: Per block, in order, whether it is a call (True) or malformed (False):
            hermes answers carry no ids, so the model matches them to its calls by position.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    order: list[bool] = field(default_factory=list)


#: The deepest call a tool gets: JSON the parser reads a few hundred levels deep still
#: fails on its way to the sandbox's worker, whose pipe's encoder recurses twice per level.
MAX_JSON_DEPTH = 64


def _json_problem(text: str) -> tuple[Any, str | None]:
    """``text`` parsed as JSON, or None and what is wrong with it. Beyond bad syntax, a
    sampled text can nest too deeply for the parser (RecursionError) or for the worker's
    pipe (past :data:`MAX_JSON_DEPTH`), or hold a number too long to convert
    (ValueError): the model's malformed call, not the episode's end."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as exc:
        return None, str(exc)[:120]
    if _deeper_than(data, MAX_JSON_DEPTH):
        return None, f"nested too deeply (more than {MAX_JSON_DEPTH} levels)"
    return data, None


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests objects and arrays more than ``limit`` levels deep
    (walked without recursion: it may be deeper than Python's stack)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _decode_arguments(raw: Any) -> dict[str, Any] | str:
    """The arguments as a dict, or a description of what is wrong with them."""
    if raw is None:
        return {}  # a tool without parameters
    if isinstance(raw, str):
        raw, problem = _json_problem(raw)
        if problem is not None:
            return f"'arguments' is a string but not valid JSON ({problem})"
    if not isinstance(raw, dict):
        return f"'arguments' must be a JSON object, got {type(raw).__name__}"
    return raw


def parse_block(body: str) -> ToolCall | str:
    """Parse the inside of one ``<tool_call>`` block: a call, or what is wrong with it."""
    data, problem = _json_problem(body)
    if problem is not None:
        return f"not valid JSON ({problem})"
    if not isinstance(data, dict):
        return f"expected a JSON object with 'name' and 'arguments', got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return "missing 'name' (a non-empty string)"
    arguments = _decode_arguments(data.get("arguments"))
    if isinstance(arguments, str):
        return arguments
    return ToolCall(name.strip(), arguments)


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Find every ``<tool_call>`` block in ``text``, in order.

    A ``<tool_call>`` left open at the end (the response was cut off) counts as a malformed
    block, so the caller can tell "no call" from "a call that never finished".
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    order: list[bool] = []
    end = 0
    for number, (_, block_end, inside) in enumerate(blocks(text), start=1):
        parsed = parse_block(inside)
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(f"tool call {number}: {parsed}")
        order.append(isinstance(parsed, ToolCall))
        end = block_end
    if OPEN_TAG in text[end:]:
        errors.append(f"tool call {len(calls) + len(errors) + 1}: {OPEN_TAG} without {CLOSE_TAG}")
        order.append(False)
    first = text.find(OPEN_TAG)
    content = text if first < 0 else text[:first]
    return ParsedToolCalls(content, calls, errors, order)


def in_block_order(parsed: ParsedToolCalls, texts: list[str]) -> list[dict[str, Any]]:
    """The tool messages answering one assistant message, in the order of its blocks:
    each call's answer (``texts``, in call order; calls past ``max_parallel_calls`` get
    none) and each malformed block's error where the block was. Hermes answers carry no
    ids: the model matches them to its calls by position."""
    answers, calls, errors = [], iter(texts), iter(parsed.errors)
    for is_call in parsed.order:
        text = next(calls, None) if is_call else f"Error: {next(errors)}"
        if text is not None:
            answers.append({"role": "tool", "content": text})
    return answers
