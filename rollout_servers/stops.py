"""Stop sequences of an OpenAI request (``stop``), applied after sampling.

vLLM honours stop strings only when it detokenizes, which the servers switch off. Cutting a
finished sample at its first stop string is the same draw: a stop string ends a sample but
does not change the distribution of any token before it. So the engine samples as always,
and the turn keeps the tokens up to the one that completes the stop string (their
behaviour logprobs are exact); the agent is shown the text before it, as the API does
(the stop string itself is not returned). What the engine sampled past it is discarded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rollout_servers.samples import Sample


def first_stop(ids: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> int:
    """The fewest leading tokens of ``ids`` whose text holds a stop string (0: none does).

    Binary search: once a prefix's text holds a stop string, every longer prefix's does."""
    if not stops or not any(s in decode(ids) for s in stops):
        return 0
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            high = mid
        else:
            low = mid + 1
    return low


def cut(sample: Sample, n: int) -> Sample:
    """``sample``'s first ``n`` tokens, their logprobs and version spans; ended by a stop."""
    spans, left = [], n
    for version, count in sample.version_spans:
        if left <= 0:
            break
        spans.append((version, min(count, left)))
        left -= count
    return replace(
        sample,
        token_ids=sample.token_ids[:n],
        logprobs=sample.logprobs[:n],
        version_spans=spans,
        finish_reason="stop",
    )


def before_stop(text: str, stops: list[str]) -> str:
    """``text`` up to its first stop string (all of it when it holds none)."""
    found = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(found)] if found else text
