"""The token layout of a multi-turn conversation, shared by the rollout server's episodes
and the supervised warm start (so a model is warm-started on exactly the tokens it will
see): the prompt rendered by the chat template, each assistant turn as sampled, and between
turns the template's tokens for the new messages, found by rendering the history without
and with them."""

from __future__ import annotations

from typing import Any


def continuation(held: list[int], before: list[int], after: list[int]) -> list[int] | None:
    """The tokens to append to ``held`` (the episode's tokens so far) so that it reads as
    ``after`` (the history with the new messages and the next generation prompt), given
    ``before`` (the history without them): the template's markup closing the last turn,
    then the new messages. None when the template does not keep the earlier tokens as a
    prefix (``held`` of ``before``, ``before`` of ``after``): the sample must be split."""
    if after[: len(before)] != before or before[: len(held)] != held:
        return None
    return after[len(held) :]


def render(
    tok: Any, messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool
) -> list[int]:
    """Token ids of ``messages`` under the model's chat template (``gen``: with the
    assistant's generation prompt at the end)."""
    text = tok.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=gen, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)
