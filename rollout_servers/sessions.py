"""Sessions of the OpenAI-compatible endpoint: what a chat request becomes in tokens, and
what the endpoint answers. Pure: no sockets, no engine.

A *session* is one agent episode, named by its key (the API key the agent's client sends):
``GROUP/MEMBER``. The members of a group answer the same prompt and are compared with each
other (GRPO's group), so a group is complete when ``group_size`` members have a reward. A
key without ``/`` is a group of one, allowed only when ``group_size`` is 1.

A session keeps two views of its conversation: the one the model saw (assistant turns as
sampled, tool calls written inline, as the chat template renders them) in its
:class:`~rollout_servers.agent.Episode`, and the one the agent was shown (tool calls as
OpenAI ``tool_calls``). A request whose messages extend the shown view by new messages
appends only their tokens (:func:`rollout_servers.agent.extend`); a request that rewrites
earlier messages starts a new sample from its own rendering.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncrl.control.messages import Task
from asyncrl.tools.hermes import parse_tool_calls
from rollout_servers.agent import Episode, Piece

#: Roles an agent may add between assistant turns.
INPUT_ROLES = ("system", "user", "tool")


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and one line naming the fix."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self) -> dict[str, Any]:
        """The error body, shaped as the OpenAI API shapes its errors."""
        return {"error": {"message": self.message, "type": self.code, "code": self.status}}


@dataclass
class Session:
    """One agent episode: its tokens (``episode``), the conversation as the agent was
    shown it, and its reward once the agent sends one."""

    key: str
    index: int  # member number within its group, in order of arrival
    task: Task  # its group's external slot
    episode: Episode
    shown: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict] | None = None  # the tool schemas of its first request
    reward: float | None = None
    busy: bool = False  # a completion is running (a session is sequential)


@dataclass
class Group:
    """Sessions that answer the same prompt; one external slot of the admission budget."""

    name: str
    task: Task
    size: int
    sessions: dict[str, Session] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)

    def rewarded(self) -> list[Session]:
        """Members with a reward and at least one turn, in order of arrival."""
        done = [s for s in self.sessions.values() if s.reward is not None and s.episode.turns]
        return sorted(done, key=lambda s: s.index)


def split_key(key: str, group_size: int) -> tuple[str, str]:
    """``(group, member)`` of a session key (see the module docstring)."""
    if not key or len(key) > 256:
        raise RequestError(401, "no session key: send GROUP/MEMBER as the API key", "auth")
    group, sep, member = key.rpartition("/")
    if not sep:
        if group_size > 1:
            raise RequestError(
                400,
                f"session key {key!r} names no group: use GROUP/MEMBER as the API key "
                f"(rollout.openai_endpoint.group_size={group_size} members share a GROUP)",
            )
        return key, ""
    if not group or not member:
        raise RequestError(400, f"session key {key!r}: GROUP and MEMBER must not be empty")
    return group, member


def text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(400, "only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(400, f"message content must be a string, not {type(content).__name__}")


def input_message(msg: Any) -> dict[str, Any]:
    """A system, user or tool message as the chat template gets it (role, text, name)."""
    if not isinstance(msg, dict) or msg.get("role") not in INPUT_ROLES:
        role = msg.get("role") if isinstance(msg, dict) else type(msg).__name__
        raise RequestError(
            400,
            f"message role {role!r} cannot be added by the agent: send the conversation "
            f"so far (assistant turns as this endpoint returned them) plus new "
            f"{'/'.join(INPUT_ROLES)} messages",
        )
    out: dict[str, Any] = {"role": msg["role"], "content": text_of(msg.get("content"))}
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def model_message(msg: Any) -> dict[str, Any]:
    """A message of a rewritten conversation as the model reads it: an assistant turn's
    tool calls written inline (hermes), as the model writes them; others as
    :func:`input_message`."""
    if not isinstance(msg, dict) or msg.get("role") != "assistant":
        return input_message(msg)
    text = text_of(msg.get("content"))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "{}")
        with contextlib.suppress(json.JSONDecodeError):  # else written as sent
            args = json.loads(args) if isinstance(args, str) else args
        block = json.dumps({"name": fn.get("name", ""), "arguments": args})
        text += f"<tool_call>\n{block}\n</tool_call>"
    return {"role": "assistant", "content": text}


def _same(shown: dict[str, Any], sent: Any) -> bool:
    if not isinstance(sent, dict) or sent.get("role") != shown["role"]:
        return False
    return text_of(sent.get("content")).strip() == text_of(shown.get("content")).strip()


def new_messages(session: Session, messages: list[Any]) -> list[dict[str, Any]] | None:
    """The messages the agent added since the session's last turn; None when it rewrote
    the conversation instead (then the request is a new sample of the episode)."""
    shown = session.shown
    if len(messages) <= len(shown) or not all(map(_same, shown, messages)):
        return None
    added = messages[len(shown) :]
    return [input_message(m) for m in added]


def first_piece(prompt_ids: list[int], max_prompt_len: int, version: int) -> Piece:
    """The first sample of a session, or a refusal when its prompt does not fit."""
    if len(prompt_ids) > max_prompt_len:
        raise RequestError(
            400,
            f"prompt of {len(prompt_ids)} tokens exceeds data.max_prompt_length="
            f"{max_prompt_len}: shorten the conversation or raise it",
        )
    return Piece(prompt_ids=prompt_ids, start_version=version)


def assistant_reply(raw: str) -> tuple[dict[str, Any], str]:
    """The assistant message the agent is shown for the sampled text ``raw``, and the
    OpenAI finish reason: hermes ``<tool_call>`` blocks become ``tool_calls``."""
    parsed = parse_tool_calls(raw)
    if not parsed.calls:
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
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def max_tokens_of(body: dict[str, Any], budget: int) -> int:
    """Tokens this turn may sample: the request's ``max_completion_tokens`` or
    ``max_tokens``, within what is left of ``data.max_response_length``."""
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if asked is not None and (not isinstance(asked, int) or asked < 1):
        raise RequestError(400, f"max_tokens must be a positive integer, not {asked!r}")
    if budget < 1:
        raise RequestError(
            400,
            "the session has used its data.max_response_length tokens: end the episode "
            "with POST /rl/reward",
        )
    return min(asked or budget, budget)


def reward_of(body: Any) -> float:
    """The reward of a ``/rl/reward`` body: a finite number."""
    value = body.get("reward") if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(400, f'/rl/reward needs {{"reward": <finite number>}}, got {value!r}')
    return float(value)


ENDED = {
    "length": "the session has no room left in data.max_response_length for another "
    "turn: end the episode with POST /rl/reward",
    "prompt_too_long": "the conversation no longer fits data.max_prompt_length: end the "
    "episode with POST /rl/reward",
}
