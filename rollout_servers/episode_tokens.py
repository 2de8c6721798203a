"""How messages appended to an episode become its tokens (:func:`extend`), and how many of a
rendered conversation's last tokens the new messages take (:func:`inserted_len`,
:func:`added_len`): the agent's tool turns and the OpenAI endpoint's sessions share them.

The server never re-tokenizes what the model sampled: after new messages it renders the
conversation without and with them and appends the difference. Where the chat template
does not keep the earlier tokens as a prefix (Qwen3 drops past ``<think>`` blocks), the
episode's current sample closes and a new one starts from the re-rendered history.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncrl.tools.tokens import continuation, render
from rollout_servers.episodes import Episode, Piece

if TYPE_CHECKING:
    from rollout_servers.protocols import Tokenizer


def extend(
    ep: Episode,
    new: list[dict[str, Any]],
    tok: Tokenizer,
    schemas: list[dict] | None,
    max_prompt_len: int,
    max_response_len: int,
) -> str:
    """Append the tokens of the ``new`` messages (tool or user turns) to the episode's
    current sample, or split: close it and start a new sample from the re-rendered history.
    The messages join the episode's conversation only when their tokens do.

    Returns "" when appended, ``split`` when a new sample started (its ``start_version`` is
    the caller's to set), or why the episode cannot go on: ``length`` (no room left in the
    episode's ``max_response_len`` to answer, as veRL ends it) or ``prompt_too_long`` (the
    re-rendered history does not fit).
    """
    piece = ep.pieces[-1]
    used = ep.response_len()
    before = render(tok, ep.messages, schemas, gen=False)
    after = render(tok, ep.messages + new, schemas, gen=True)
    tail = continuation(piece.prompt_ids + piece.token_ids, before, after)
    if tail is not None:
        if used + len(tail) >= max_response_len:
            return "length"
        piece.add_inserted(tail)
        ended = ""
    elif len(after) > max_prompt_len:
        return "prompt_too_long"
    else:
        # The new sample's prompt ends with the new messages. They are the episode's
        # response as appended ones are (counted, scored), though this sample trains none.
        lead = inserted_len(tok, before, after, new, schemas)
        if used + lead >= max_response_len:
            return "length"
        ep.splits += 1
        ep.pieces.append(Piece(prompt_ids=after, lead=lead))
        ended = "split"
    ep.messages.extend(new)
    return ended


def shared_len(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` start with alike."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def inserted_len(
    tok: Tokenizer,
    before: list[int],
    after: list[int],
    new: list[dict[str, Any]],
    schemas: list[dict] | None,
) -> int:
    """How many of ``after``'s last tokens render the messages ``new`` (with the generation
    prompt), when ``after`` does not extend ``before``. What follows the prefix the two
    share is that at least, but more where the new messages change how the history renders
    (Qwen3's template drops past ``<think>`` blocks once a user turn follows): the
    messages rendered alone end as ``after`` does, and their common end is the new
    messages, give or take the markup token before them. The lesser of the two."""
    by_prefix = len(after) - shared_len(before, after)
    by_suffix = tail_len(tok, after, new, schemas)
    return by_prefix if by_suffix is None else min(by_prefix, by_suffix)


def tail_len(
    tok: Tokenizer, after: list[int], new: list[dict[str, Any]], schemas: list[dict] | None
) -> int | None:
    """How many of ``after``'s last tokens render the messages ``new`` that end it (with
    the generation prompt), as their own rendering ends; None when the template refuses a
    conversation that opens with them."""
    try:
        alone = render(tok, new, schemas, gen=True)
    except Exception:  # a template that requires a user turn first, say
        return None
    n = min(len(after), len(alone))
    return next((i for i in range(n) if after[-1 - i] != alone[-1 - i]), n)


def added_len(
    tok: Tokenizer,
    prompt: list[int],
    history: list[dict[str, Any]],
    start: int,
    schemas: list[dict] | None,
) -> int:
    """Of a conversation the agent rewrote (``history``, rendered as ``prompt``), how many
    last tokens render its messages from ``start`` on (what it added since the model's last
    turn: tool answers, a user turn): the session's response, as the same messages
    appended without a rewrite would be. 0 when nothing before ``start`` is known."""
    added = history[start:]
    if start <= 0 or not added:
        return 0
    try:
        before = render(tok, history[:start], schemas, gen=False)
    except Exception:  # a template that refuses to end there: by the messages alone
        return tail_len(tok, prompt, added, schemas) or 0
    return inserted_len(tok, before, prompt, added, schemas)
