"""What the OpenAI-compatible endpoint answers a chat request: the assistant message the
agent is shown (hermes tool calls as OpenAI ``tool_calls``), the ``chat.completion`` body,
its ``usage`` and ``logprobs``, and the chunks a streaming client reads. Pure."""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from asyncrl.tools.hermes import OPEN_TAG, ToolCall, blocks, parse_block

if TYPE_CHECKING:
    from rollout_servers.protocols import Tokenizer

#: The name shown for a malformed block whose tool name cannot be read: no tool has it, so
#: the agent answers the call with its error, in the call's place.
MALFORMED_CALL = "malformed_tool_call"
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]+)"')  # a malformed block's readable tool name


def assistant_reply(raw: str, tools: bool = True) -> tuple[dict[str, Any], str]:
    """The assistant message the agent is shown for the sampled text ``raw``, and the
    OpenAI finish reason: hermes ``<tool_call>`` blocks become ``tool_calls`` (``tools``
    False, as ``tool_choice: none`` asks: the text stays the message's content).

    Every block is a call, in the order written, malformed ones too (their raw text as
    ``arguments``, which the API lets be other than JSON): the agent answers the calls by
    position and the model reads the answers by position, as the server's own agent loop
    answers a malformed block with an error where it was
    (:func:`asyncrl.tools.hermes.in_block_order`). Dropping one would put the next call's
    answer in its place. Text with no readable call at all stays content."""
    outside, bodies = _split_blocks(raw) if tools else ([raw], [])
    calls = [_call(body) for body in bodies]
    if not any(name for name, _ in calls):
        return {"role": "assistant", "content": raw}, "stop"
    shown = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name or MALFORMED_CALL, "arguments": arguments},
        }
        for name, arguments in calls
    ]
    # The text around the blocks, the first part (before any call) as written and what
    # the model wrote between or after them where it said something.
    content = outside[0] + "".join(t for t in outside[1:] if t.strip())
    return {"role": "assistant", "content": content, "tool_calls": shown}, "tool_calls"


def _split_blocks(raw: str) -> tuple[list[str], list[str]]:
    """The text outside ``<tool_call>`` blocks (one part more than blocks) and the blocks'
    insides, as :func:`asyncrl.tools.hermes.parse_tool_calls` finds them: a block left
    open at the end (the response was cut off) is one too."""
    outside, bodies, end = [], [], 0
    for start, block_end, inside in blocks(raw):
        outside.append(raw[end:start])
        bodies.append(inside)
        end = block_end
    if (left_open := raw.find(OPEN_TAG, end)) >= 0:
        outside.append(raw[end:left_open])
        bodies.append(raw[left_open + len(OPEN_TAG) :])
        end = len(raw)
    outside.append(raw[end:])
    return outside, bodies


def _call(body: str) -> tuple[str, str]:
    """A block's tool name and ``arguments``: a well-formed call's JSON arguments, or a
    malformed one's raw text with the name it reads as ("" when none is readable)."""
    parsed = parse_block(body)
    if isinstance(parsed, ToolCall):
        return parsed.name, json.dumps(parsed.arguments)
    named = _NAME.search(body)
    return (named.group(1).strip() if named else ""), body.strip()


def completion_body(
    message: dict[str, Any], finish: str, model: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A ``chat.completion`` object as the OpenAI API returns it."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A reply's ``usage``, as the OpenAI API counts tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_logprobs(ids: list[int], logprobs: list[float], tok: Tokenizer) -> dict[str, Any]:
    """A choice's ``logprobs`` as the API returns them: one entry per sampled token (its
    text, behaviour logprob and UTF-8 bytes); no alternatives (``top_logprobs`` empty)."""
    content = []
    for token, lp in zip(ids, logprobs, strict=True):
        text = tok.decode([token])
        content.append(
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        )
    return {"content": content, "refusal": None}


def completion_chunks(body: dict[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A finished ``chat.completion`` as the ``chat.completion.chunk`` objects a streaming
    client reads: the whole message in one delta (tool calls with their ``index``), the
    finish reason, and the usage when the request's ``stream_options.include_usage`` asks.
    The turn is sampled whole first: a stream here only carries it."""
    choice = body["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = [
        head
        | {
            "choices": [
                {"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"]}
            ]
        },
        head | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
    ]
    if usage:
        chunks.append(head | {"choices": [], "usage": body["usage"]})
    return chunks
