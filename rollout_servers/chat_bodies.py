"""What the OpenAI-compatible endpoint answers a chat request: the assistant message the
agent is shown (hermes tool calls as OpenAI ``tool_calls``), the ``chat.completion`` body,
its ``usage`` and ``logprobs``, and the chunks a streaming client reads. Pure."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from asyncrl.tools.hermes import parse_tool_calls

if TYPE_CHECKING:
    from rollout_servers.protocols import Tokenizer


def assistant_reply(raw: str, tools: bool = True) -> tuple[dict[str, Any], str]:
    """The assistant message the agent is shown for the sampled text ``raw``, and the
    OpenAI finish reason: hermes ``<tool_call>`` blocks become ``tool_calls`` (``tools``
    False, as ``tool_choice: none`` asks: the text stays the message's content)."""
    parsed = parse_tool_calls(raw) if tools else None
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": raw}, "stop"
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in parsed.calls
    ]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, "tool_calls"


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
