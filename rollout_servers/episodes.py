"""What one multi-turn episode holds: its samples (pieces), each a prompt then sampled and
inserted tokens, and the conversation. Pure: no engine, no tools.

``data.max_response_length`` bounds an episode's response as a whole, as veRL's agent loop
bounds its ``response_length``: every token after the first prompt counts, the sampled
ones and the inserted ones (tool answers and the template's markup around them), whether
they were appended to a sample or opened a new sample after a split
(:meth:`Episode.response_len`). So the samples of an episode that split together never
exceed the limit, and the reward function reads the whole episode as the model saw it
(:meth:`Episode.text`), whether or not the chat template rewrites history.

A sample the engine runs is at most ``data.max_prompt_length + data.max_response_length``
tokens (the engine's context), its prompt and the response budget it has left together. A
split's prompt, the history re-rendered, may be longer than ``data.max_prompt_length``: on
the wire its tokens past that limit lead the response, masked (:meth:`Piece.wire`), since
the buffer holds prompts and responses to those limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_servers.samples import add_span

if TYPE_CHECKING:
    from rollout_servers.protocols import Tokenizer
    from rollout_servers.samples import Sample


@dataclass
class Piece:
    """One training sample of an episode: a prompt, then sampled and inserted tokens.

    ``masked_spans`` are the ``(start, length)`` runs of inserted tokens (tool answers and
    the template's markup around them); they carry logprob 0 and the version of the last
    sampled token before them, so versions never go backwards. A sample that a split opened
    ends its prompt with the messages inserted there: its last ``lead`` prompt tokens, part of
    the episode's response (counted and scored) though not trained (they are prompt).

    ``uncut`` is the prompt as the chat template rendered it when ``data.truncation`` cut it
    to ``prompt_ids`` (None: not cut): the next messages' tokens are found against it, as
    the model's context holds the same messages. ``overflow``: how many of the prompt's last
    tokens are over ``data.max_prompt_length`` (a split's re-rendered history), sent on the
    wire as the head of the response, masked.
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    masked_spans: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str = "stop"
    temperature: float | None = None
    start_version: int = 0
    lead: int = 0
    uncut: list[int] | None = None
    overflow: int = 0
    dated_down: bool = False  # see samples.add_span

    def add_sampled(self, sample: Sample) -> None:
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.dated_down |= sample.dated_down
        for version, n in sample.version_spans:
            self._span(version, n)
        self.finish_reason = sample.finish_reason
        self.temperature = sample.temperature
        if len(self.token_ids) == len(sample.token_ids):
            self.start_version = sample.start_version

    def add_inserted(self, ids: list[int]) -> None:
        if not ids:
            return
        self.masked_spans.append((len(self.token_ids), len(ids)))
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        last = self.version_spans[-1][0] if self.version_spans else self.start_version
        self._span(last, len(ids))

    def response_ids(self) -> list[int]:
        """The episode's response tokens in this sample: its ``lead``, then its tokens."""
        lead = self.prompt_ids[len(self.prompt_ids) - self.lead :] if self.lead else []
        return lead + self.token_ids

    def rendered(self) -> list[int]:
        """The sample's tokens as the chat template renders its conversation: the uncut
        prompt, then its tokens (what the next messages' tokens are found against)."""
        return (self.prompt_ids if self.uncut is None else self.uncut) + self.token_ids

    def wire(self) -> tuple[list[int], list[int], list[float], list, list]:
        """Prompt, response, logprobs, version spans and masked spans as the wire carries
        the sample: the ``overflow`` prompt tokens lead the response, masked, dated as its
        first sampled token (so the sample's lag is its sampled tokens')."""
        spans = self.version_spans or [(self.start_version, 0)]
        n = self.overflow
        if not n:
            return self.prompt_ids, self.token_ids, self.logprobs, spans, self.masked_spans
        cut = len(self.prompt_ids) - n
        version, first = spans[0]
        moved = [(version, n + first), *spans[1:]]
        masked = [(start + n, k) for start, k in self.masked_spans]
        if masked and masked[0][0] == n:  # the response opens with inserted tokens: one run
            masked[0] = (0, n + masked[0][1])
        else:
            masked.insert(0, (0, n))
        response = self.prompt_ids[cut:] + self.token_ids
        return self.prompt_ids[:cut], response, [0.0] * n + self.logprobs, moved, masked

    def _span(self, version: int, n: int) -> None:
        # A later turn under a catch-up down dates the earlier turns' tokens down too.
        self.dated_down |= add_span(self.version_spans, version, n)


@dataclass
class Episode:
    """One episode: its samples (pieces), the conversation, and what happened."""

    pieces: list[Piece]
    messages: list[dict[str, Any]]
    turns: int = 0  # assistant turns
    tool_turns: int = 0
    tool_calls: int = 0
    #: The tools' step rewards in call order, None (no reward) left out, as veRL's tool
    #: agent keeps them: the scorer reads them as ``extra_info["tool_rewards"]``.
    tool_rewards: list[float] = field(default_factory=list)
    splits: int = 0
    ended: str = "done"
    #: ``data.max_response_length`` the episode ran under (0: not told): one that ended
    #: for want of room (``length``) counts as that long (:meth:`budget_len`).
    max_response_len: int = 0

    def draft(self) -> Episode:
        """A copy to prepare a turn on, kept only if the turn succeeds (the OpenAI endpoint
        prepares a turn before it knows the engine will answer). A turn changes only the
        last sample and the conversation, so only those are copied."""
        pieces = list(self.pieces)
        if pieces:
            last = pieces[-1]
            pieces[-1] = dataclasses.replace(
                last,
                token_ids=list(last.token_ids),
                logprobs=list(last.logprobs),
                version_spans=list(last.version_spans),
                masked_spans=list(last.masked_spans),
            )
        return dataclasses.replace(
            self, pieces=pieces, messages=list(self.messages), tool_rewards=list(self.tool_rewards)
        )

    def scorer_extra_info(self, extra_info: dict[str, Any]) -> dict[str, Any]:
        """The row's ``extra_info`` as veRL's reward loop hands a multi-turn sample's scorer:
        with ``num_turns`` (tool and assistant turns, plus one, as veRL's agent loop counts
        them), ``tool_rewards`` (:attr:`tool_rewards`), and ``turn_scores`` and
        ``rollout_reward_scores``, which veRL fills from interactions and its older
        rollout's tool scores, neither of which is here (empty, so a scorer that reads
        them finds them). The row's own keys of these names are replaced, as in veRL."""
        return {
            **extra_info,
            "num_turns": self.turns + self.tool_turns + 1,
            "tool_rewards": list(self.tool_rewards),
            "turn_scores": [],
            "rollout_reward_scores": {},
        }

    def response_len(self) -> int:
        """Tokens of the episode's response so far, all samples together (see the module
        docstring): what ``data.max_response_length`` bounds."""
        return sum(p.lead + len(p.token_ids) for p in self.pieces)

    def budget_len(self) -> int:
        """The length the overlong penalty measures: :meth:`response_len`, or the whole
        budget for an episode that ended because its next tokens did not fit (the
        response budget, ``length``, or the context, ``prompt_too_long``: both end on a
        sample cut with ``finish_reason`` ``length``), as a single-turn response cut at
        the limit is that long."""
        if self.ended in ("length", "prompt_too_long"):
            return max(self.response_len(), self.max_response_len)
        return self.response_len()

    def text(self, tok: Tokenizer) -> str:
        """The response as the scorer sees it: every sample's response tokens decoded, the
        tool answers that opened a split's sample included (veRL's agent loop scores the
        tool answers too)."""
        return "".join(tok.decode(p.response_ids(), skip_special_tokens=True) for p in self.pieces)
