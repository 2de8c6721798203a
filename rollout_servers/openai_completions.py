"""``POST /v1/completions``: the legacy completions API, for agents that build their prompt
text themselves (ReAct loops over a raw transcript, frameworks with their own templates).

- The prompt is tokenized as it comes, with no chat template: a string (or a list holding
  one), tokenized with the tokenizer's special tokens as vLLM's completions API adds them,
  or a list of token ids, taken as they are.
- Every request is a new sample of its session, trained with the session's reward like
  any other: its tokens are the prompt the model read and what it sampled. A prompt that
  repeats the previous request's prompt and completion is not matched against them (text
  does not re-tokenize to the same ids), so each sample carries its whole prompt.
- ``max_tokens`` is 16 when the request leaves it out, as in the API and vLLM; ``stop``
  cuts the sample as in chat; ``logprobs=0`` returns the behaviour logprobs of the sampled
  tokens (``top_logprobs`` are not computed: a larger value is a 400).
- Refused with a 400 naming why: ``n`` or ``best_of`` above 1 (one session per sample),
  ``echo`` (prompt logprobs are not computed), ``suffix`` (no insertion mode).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from rollout_servers.chat_bodies import usage
from rollout_servers.request_fields import raw_fields
from rollout_servers.sessions import Draft, RequestError, Session, next_piece

if TYPE_CHECKING:
    from rollout_servers.protocols import Tokenizer

#: The completions API's ``max_tokens`` when a request leaves it out.
DEFAULT_MAX_TOKENS = 16
#: What a session shows after a raw completion: no chat message matches it, so a chat
#: request after one starts a new sample instead of continuing the raw one.
RAW = {"role": "completion", "content": ""}


def raw_prompt(body: dict[str, Any], tok: Tokenizer) -> str | list[int]:
    """The request's prompt, checked: a text (tokenized by :func:`prompt_ids`, in its turn:
    a large one takes seconds, not to be spent on the server's loop) or token ids (see the
    module docstring); else a 400."""
    raw_fields(body)
    for key, why in (
        ("echo", "the prompt's logprobs are not computed"),
        ("suffix", "there is no insertion mode"),
    ):
        if body.get(key):
            raise RequestError(400, f"{key} is not supported: {why}")
    if (body.get("best_of") or 1) != 1:
        raise RequestError(400, "best_of must be 1: open one session per sample")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp != 0):
        raise RequestError(
            400,
            f"logprobs={lp!r}: only 0 is served (the sampled tokens' behaviour logprobs); "
            "alternatives are not computed",
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(_token_id(t) for t in prompt):
        size = _vocab_size(tok)
        if size is not None and max(prompt) >= size:
            raise RequestError(
                400,
                f"prompt token id {max(prompt)} is not in the tokenizer's vocabulary of {size}",
            )
        return [int(t) for t in prompt]
    raise RequestError(
        400, "prompt must be a non-empty string (or a list of one) or a list of token ids"
    )


def prompt_ids(prompt: str | list[int], tok: Tokenizer) -> list[int]:
    """The token ids of a checked prompt (:func:`raw_prompt`): a text tokenized with the
    tokenizer's special tokens, as vLLM's completions API adds them."""
    if isinstance(prompt, str):
        return list(tok.encode(prompt, add_special_tokens=True))
    return prompt


def _vocab_size(tok: Any) -> int | None:
    """How many token ids the tokenizer knows (None when it cannot say)."""
    sizes = [getattr(tok, "vocab_size", None)]
    if hasattr(tok, "__len__"):
        sizes.append(len(tok))
    known = [n for n in sizes if isinstance(n, int)]
    return max(known) if known else None


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def raw_draft(
    session: Session,
    prompt_ids: list[int],
    max_prompt_len: int,
    max_response_len: int,
    version: int,
) -> Draft:
    """A draft whose new sample starts with ``prompt_ids`` (the session is not touched);
    a later sample of the session may pass ``data.max_prompt_length`` as a rewritten chat
    conversation may (:func:`~rollout_servers.sessions.next_piece`)."""
    ep = session.episode
    draft = Draft(ep.draft(), [RAW], None)
    next_piece(
        draft.episode,
        prompt_ids,
        0,
        max_prompt_len=max_prompt_len,
        max_response_len=max_response_len,
        version=version,
    )
    draft.counted = "raw_samples"
    return draft


def raw_max_tokens(body: dict[str, Any]) -> dict[str, Any]:
    """The body with the API's default ``max_tokens`` when it has none."""
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        return body | {"max_tokens": DEFAULT_MAX_TOKENS}
    return body


def text_logprobs(ids: list[int], logprobs: list[float], tok: Tokenizer) -> dict[str, Any]:
    """A completion choice's ``logprobs``: each sampled token's text, behaviour logprob and
    offset in the completion's text; no alternatives."""
    tokens, offsets, at = [], [], 0
    for token in ids:
        text = str(tok.decode([token]))
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def text_completion_body(
    text: str, finish: str, model: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A ``text_completion`` object as the API returns it."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def text_chunks(body: dict[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A finished ``text_completion`` as a stream's chunks: the text, then the finish
    reason, then the usage when asked (the sample is finished first, as in chat)."""
    choice = body["choices"][0]
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    chunks = [
        head | {"choices": [choice | {"finish_reason": None}]},
        head
        | {
            "choices": [
                {"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None}
            ]
        },
    ]
    if usage:
        chunks.append(head | {"choices": [], "usage": body["usage"]})
    return chunks
