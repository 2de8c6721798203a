"""How messages appended to an episode become its tokens (:func:`extend`), and how many of a
rendered conversation's last tokens the new messages take (:func:`inserted_len`,
:func:`added_len`): the agent's tool turns and the OpenAI endpoint's sessions share them.

The server never re-tokenizes what the model sampled: after new messages it renders the
conversation without and with them and appends the difference. Where the chat template
does not keep the earlier tokens as a prefix (Qwen3 drops past ``<think>`` blocks), the
episode's current sample closes and a new one starts from the re-rendered history.

A first prompt that ``data.truncation`` cut is compared as rendered (:meth:`Piece.rendered`),
and a split's history leaves out the very tokens of it that the cut left out
(:func:`cut_alike`), so a cut episode goes on as any other.
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
    re-rendered history and the budget left do not fit the engine's context).
    """
    piece = ep.pieces[-1]
    before = render(tok, ep.messages, schemas, gen=False)
    after = render(tok, ep.messages + new, schemas, gen=True)
    tail = continuation(piece.rendered(), before, after)
    if tail is None:
        ended = split(ep, tok, (before, after), new, schemas, max_prompt_len, max_response_len)
    elif ep.response_len() + len(tail) >= max_response_len:
        ended = "length"
    else:
        piece.add_inserted(tail)
        ended = ""
    if ended in ("", "split"):
        ep.messages.extend(new)
    return ended


def split(
    ep: Episode,
    tok: Tokenizer,
    renders: tuple[list[int], list[int]],
    new: list[dict[str, Any]],
    schemas: list[dict] | None,
    max_prompt_len: int,
    max_response_len: int,
) -> str:
    """Start a new sample of the episode from the history rendered with the ``new``
    messages (``renders``: the history without and with them); ``split``, or why the episode
    ends (see :func:`extend`).

    The new sample's prompt ends with the new messages: they are the episode's response as
    appended ones are (counted, scored), though this sample trains none. Its prompt may pass
    ``max_prompt_len`` as :func:`new_sample` allows.
    """
    before, after = renders
    lead = inserted_len(tok, before, after, new, schemas)
    prompt = cut_alike(ep.pieces[0], after)
    uncut = None if prompt is after else after
    ended = new_sample(ep, prompt, lead, max_prompt_len, max_response_len, uncut)
    if ended:
        return ended
    ep.splits += 1
    return "split"


def new_sample(
    ep: Episode,
    prompt: list[int],
    lead: int,
    max_prompt_len: int,
    max_response_len: int,
    uncut: list[int] | None = None,
) -> str:
    """Start a new sample of the episode from ``prompt`` (a history, re-rendered by a split
    or rewritten by the OpenAI endpoint's agent), whose last ``lead`` tokens are the
    episode's response; "" when started (its ``start_version`` is the caller's to set),
    else why not: ``length`` or ``prompt_too_long`` (see :func:`extend`).

    The prompt may pass ``max_prompt_len`` (the history grew there): the engine's context
    is the prompt limit and the response limit together, and the response budget left
    shrinks as the history grows, so a sample never asks the engine for more (vLLM refuses
    a longer one). Its tokens past the limit are its ``overflow`` (:meth:`Piece.wire`).
    """
    used = ep.response_len()
    if used + lead >= max_response_len:
        return "length"
    left = max_response_len - used - lead
    if len(prompt) + left > max_prompt_len + max_response_len:
        return "prompt_too_long"
    overflow = max(0, len(prompt) - max_prompt_len)
    ep.pieces.append(Piece(prompt_ids=prompt, lead=lead, uncut=uncut, overflow=overflow))
    return ""


def cut_alike(first: Piece, history: list[int]) -> list[int]:
    """``history`` (the re-rendered conversation) without the tokens ``data.truncation``
    left out of the episode's first prompt, so the model reads the same start on every
    sample; ``history`` itself when nothing was cut.

    The first prompt kept its first ``kept`` tokens and its last ones (``left`` keeps none
    of the first, ``right`` none of the last, ``middle`` some of each), whatever the mode.
    Of the tokens cut, those the history renders alike leave it: all of them, but where the
    template renders the first prompt's end otherwise in a history (a generation prompt
    unlike a past assistant turn's header, which ``right`` cut) or its start (then nothing
    leaves, and a history too long for the engine ends the episode)."""
    if first.uncut is None:
        return history
    kept = shared_len(first.uncut, first.prompt_ids)
    removed = len(first.uncut) - len(first.prompt_ids)
    end = min(kept + removed, shared_len(first.uncut, history))
    return history[:kept] + history[end:] if end > kept else history


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
