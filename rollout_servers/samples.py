"""A response as the rollout engine returns it (:class:`Sample`), and how one is read out
of vLLM's outputs: each sampled token's behaviour logprob and the policy versions vLLM
labelled the tokens with; and the sampling parameters of a request's later pieces, when a
sync in ``abort`` mode re-submits it (:func:`piece_params`)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import SamplingParams


@dataclass
class Sample:
    """One finished response.

    ``version_spans`` lists ``(policy_version, n_tokens)`` runs covering ``token_ids`` in
    order; ``logprobs[i]`` is the behaviour logprob of ``token_ids[i]`` (after temperature).
    ``temperature`` is the one vLLM sampled at (its ``SamplingParams`` may have adjusted
    the requested value): the learner divides this response's logits by it.
    ``dated_down``: some tokens were dated down to a later, lower version (:func:`add_span`).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str = "length"
    resubmissions: int = 0
    start_version: int = 0  # the version when the request started (empty responses)
    temperature: float | None = None
    dated_down: bool = False

    def extend(
        self, token_ids: list[int], logprobs: list[float], spans: list[tuple[int, int]]
    ) -> None:
        """Append one piece of the response (a re-submission continues the same sample)."""
        self.token_ids += token_ids
        self.logprobs += logprobs
        for version, n in spans:
            self.dated_down |= add_span(self.version_spans, version, n)


def add_span(spans: list[tuple[int, int]], version: int, n: int) -> bool:
    """Append ``n`` tokens of policy ``version`` to the ``(version, n_tokens)`` runs
    ``spans`` (in place; merged with the last run of the same version). Returns whether
    earlier tokens were dated down.

    Versions on the wire never go backwards (the codec refuses a sample whose do). They
    would here after a catch-up *down*: a learner restarted from an older checkpoint sends
    its weights labelled below the ones this server held (:mod:`asyncrl.control.versions`),
    and a response in flight goes on under them. Its earlier tokens came from weights the
    restarted run no longer descends from; they are dated as the new version, which makes
    the sample look older to the lag rule, never fresher. Their behaviour logprobs stay as
    drawn, so the importance weights still describe how they were sampled. Only the runs
    above ``version`` are dated: older ones keep their versions (dated up, they would make
    the sample look fresher)."""
    above = 0
    while spans and spans[-1][0] > version:
        above += spans.pop()[1]
    n += above
    if spans and spans[-1][0] == version:
        spans[-1] = (version, spans[-1][1] + n)
    elif n:
        spans.append((version, n))
    return bool(above)


def piece_params(params: SamplingParams, piece: int, max_tokens: int) -> SamplingParams:
    """``SamplingParams`` of piece ``piece`` (0 = the first submission) of a request that a
    sync in ``abort`` mode interrupted, allowed ``max_tokens`` more tokens.

    vLLM seeds a fresh generator per request: a re-submitted piece with the request's seed
    would replay the random draws of the first piece (with vLLM's exponential-race sampler,
    token ``k + j`` tied to token ``j``), and the behaviour logprobs would no longer describe
    how the tokens were drawn. Later pieces get their own seed, derived from the request's
    seed and the piece number, so a seeded run stays reproducible; piece 0 keeps the seed.
    """
    out = params.clone()
    out.max_tokens = max_tokens
    if piece and params.seed is not None:
        out.seed = zlib.crc32(f"{params.seed}#{piece}".encode()) & 0x7FFFFFFF
    return out


def sampled_logprob(position: dict | None, token: int) -> float:
    """The sampled token's logprob at one position (NaN if vLLM did not report it, which
    the learner drops and counts)."""
    entry = position.get(token) if position else None
    return float(entry.logprob) if entry is not None else math.nan


def version_spans_of(done: Any, n_tokens: int, fallback_version: int) -> list[tuple[int, int]]:
    """``(version, n_tokens)`` runs from vLLM's weight version labels."""
    labels = getattr(done, "weight_versions", None)
    if not labels:
        return [(fallback_version, n_tokens)] if n_tokens else []
    return [(int(s.version), s.end - s.start) for s in labels if s.end > s.start]
