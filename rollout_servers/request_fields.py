"""What the OpenAI endpoint takes from a request body, checked: the token limits, stop
strings, what would constrain sampling (refused), the request's fingerprint (a client's
resend of it), and a reward. Pure: each returns the value or raises
:class:`~rollout_servers.sessions.RequestError` with one line naming the fix.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeGuard

from asyncrl.wire.types import usable_reward
from rollout_servers.sessions import RequestError, context_exceeded


def asked_tokens(body: dict[str, Any]) -> int | None:
    """The request's ``max_completion_tokens`` or ``max_tokens`` (None: not asked), else a
    400; checked before a turn is prepared."""
    asked = body.get("max_completion_tokens")
    if asked is None:  # not ``or``: a 0 is refused, never read as "not asked"
        asked = body.get("max_tokens")
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise RequestError(400, f"max_tokens must be a positive integer, not {asked!r}")
    return asked


def max_tokens_of(body: dict[str, Any], budget: int, limit: int) -> int:
    """Tokens this turn may sample: the request's ``max_completion_tokens`` or
    ``max_tokens``, within what is left (``budget``) of ``data.max_response_length``
    (``limit``, named when nothing is left)."""
    asked = asked_tokens(body)
    if budget < 1:
        raise context_exceeded(
            limit,
            "the session has used its data.max_response_length tokens: end the "
            "episode with POST /rl/reward",
        )
    return min(asked or budget, budget)


#: Stop strings one request may give, and the longest one: each is searched for in the
#: turn's text on the server's event loop (OpenAI allows 4; a review measured about 1 s a
#: check for 20,000 short ones on a 30,000-character turn, the loop's other sessions and
#: weight syncs held meanwhile, and a 4 MiB body holds many more).
MAX_STOPS, MAX_STOP_CHARS = 32, 512


def stop_strings(body: dict[str, Any]) -> list[str]:
    """The request's ``stop``: none, a string, or a list of at most :data:`MAX_STOPS`
    strings of at most :data:`MAX_STOP_CHARS` characters; else a 400."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        shown = repr(stop) if len(repr(stop)) <= 200 else repr(stop)[:200] + "..."
        raise RequestError(400, f"stop must be a non-empty string or a list of them, not {shown}")
    if len(stops) > MAX_STOPS or max(map(len, stops), default=0) > MAX_STOP_CHARS:
        raise RequestError(
            400,
            f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters "
            f"(got {len(stops)}, the longest {max(map(len, stops))})",
        )
    return stops


def wants_logprobs(body: dict[str, Any]) -> bool:
    """The request's ``logprobs`` flag; ``top_logprobs`` above 0 is a 400 (the engine keeps
    only the sampled token's logprob)."""
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise RequestError(
            400,
            f"top_logprobs={top!r} is not supported: only the sampled tokens' logprobs are "
            "kept; ask with logprobs=true alone",
        )
    return bool(body.get("logprobs"))


def unconstrained(body: dict[str, Any]) -> None:
    """Refuse what would constrain sampling (a forced tool call, a JSON format): the turn
    must come from the policy's full distribution for the learner's logprobs to match the
    behaviour's. ``tool_choice: auto``/``none`` and a text format are what happens."""
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(
            400,
            f"tool_choice={json.dumps(choice)} is not supported: a forced call constrains "
            "sampling, and training needs the policy's own distribution; send auto",
        )
    if body.get("parallel_tool_calls") is False:
        raise RequestError(
            400,
            "parallel_tool_calls=false is not supported: limiting a turn to one call "
            "constrains sampling; leave it unset and run the calls the turn makes",
        )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise RequestError(
            400,
            f"response_format {kind!r} is not supported: constrained decoding would change "
            "the distribution training needs; ask for the format in the prompt and parse it",
        )


_TEMPLATE = (
    "the model's own chat template renders every prompt, as it rendered the training data; "
    "to change how prompts read, change the template in the model's tokenizer_config.json "
    "for the whole run"
)
_CONSTRAINED = (
    "constrained decoding would change the distribution training needs; ask for the format "
    "in the prompt and parse the text"
)

#: vLLM's own chat fields that would change the prompt from the model's template rendering
#: of the messages, or constrain sampling: (the value that changes nothing, why another is
#: refused).
VLLM_FIELDS: dict[str, tuple[Any, str]] = {
    "continue_final_message": (False, "a trailing assistant message is closed, not continued"),
    "add_generation_prompt": (True, "every turn opens with the template's generation prompt"),
    "chat_template": (None, _TEMPLATE),
    "chat_template_kwargs": (None, _TEMPLATE),
    "documents": (None, _TEMPLATE),
    "guided_json": (None, _CONSTRAINED),
    "guided_regex": (None, _CONSTRAINED),
    "guided_choice": (None, _CONSTRAINED),
    "guided_grammar": (None, _CONSTRAINED),
    "structured_outputs": (None, _CONSTRAINED),
    "bad_words": (None, _CONSTRAINED),
    "allowed_token_ids": (None, _CONSTRAINED),
    "min_tokens": (0, "a turn ends where the policy ends it"),
}


def vllm_defaults(body: dict[str, Any], chat: bool = True) -> None:
    """Refuse vLLM's extensions (:data:`VLLM_FIELDS`) at other than their no-op values:
    ignored, they would give the agent another prompt or another distribution than it asked
    for without a word. Empty values count as unset. ``chat`` False (``/v1/completions``):
    only those that constrain sampling, as a raw prompt is rendered by no template."""
    for name, (same, why) in VLLM_FIELDS.items():
        if not chat and name in TEMPLATE_FIELDS:
            continue
        value = body.get(name)
        if value is None or value == same or (same is None and value in ({}, [], "")):
            continue
        shown = json.dumps(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RequestError(400, f"{name}={shown} is not supported: {why}; leave it out")


#: :data:`VLLM_FIELDS` that shape a chat prompt from its messages (none in a raw prompt).
TEMPLATE_FIELDS = frozenset(
    {
        "continue_final_message",
        "add_generation_prompt",
        "chat_template",
        "chat_template_kwargs",
        "documents",
    }
)


def raw_fields(body: dict[str, Any]) -> None:
    """Refuse what would constrain a raw completion's sampling (a JSON format, vLLM's
    guided decoding, ``min_tokens``...), as a chat request's is refused."""
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        unconstrained({"response_format": fmt})
    vllm_defaults(body, chat=False)


def chat_messages(body: dict[str, Any]) -> list[Any]:
    """A chat request's messages, once its sampling fields are checked; else a 400."""
    unconstrained(body)
    vllm_defaults(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list")
    return messages


def fingerprint(body: dict[str, Any]) -> str:
    """What makes two requests the same one (a client resending it): the messages (or a
    completion's prompt), tools and limits."""
    keys = ("messages", "prompt", "tools", "max_tokens", "max_completion_tokens", "stop")
    keys += ("logprobs", "top_logprobs")  # a reply without them would not do
    same = json.dumps({k: body.get(k) for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(same.encode()).hexdigest()


def reward_of(body: Any, reward_range: tuple[float, float] | None = None) -> float:
    """The reward of a ``/rl/reward`` body: a finite number, within ``reward_range`` when
    one is set (``rollout.openai_endpoint.reward_range``): one stray value would otherwise
    dominate its group's advantages."""
    value = body.get("reward") if isinstance(body, dict) else None
    if not _finite(value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise RequestError(400, f'/rl/reward needs {{"reward": <finite number>}}, got {shown}')
    if reward_range is not None and not reward_range[0] <= value <= reward_range[1]:
        low, high = reward_range
        raise RequestError(
            400,
            f"reward {value!r} is outside rollout.openai_endpoint.reward_range [{low:g}, "
            f"{high:g}]: send a reward in that range (or widen the range in the run's config)",
        )
    return float(value)


def _finite(value: Any) -> TypeGuard[int | float]:
    """``value`` is a number the learner's float32 holds: JSON's integers have no bound,
    and one past :data:`~asyncrl.wire.types.MAX_ABS_REWARD` is as unusable a reward as inf
    (``float`` raises on an int past float64's)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return usable_reward(float(value))
    except OverflowError:
        return False
