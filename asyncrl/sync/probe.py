"""The post-sync probe: does every server hold the weights the learner pushed?

A push can arrive wrong without any error: a bucket corrupted on the way, tensors loaded
under the wrong names or in the wrong order, a version label on other weights. Then the
servers sample from a policy the learner never had, and only the importance weights, much
later and diluted, would show it. So after each push every server scores a small fixed
probe, :func:`probe_ids` (teacher-forced logprobs of fixed token sequences under its new
weights, at temperature 1), and reports them with its ``SyncDone``; the learner scores the
same tokens with the weights it pushed and :func:`compare` says, per server, how far apart
they are (``sync/probe_*`` metrics; the ``max_probe_diff`` health alarm names the server).

The probe's tokens come from a seeded generator over the first :data:`PROBE_VOCAB` ids, so
every side derives the same sequences from nothing but this module (no message carries
them). Pure: no torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

#: Sequences in the probe, and tokens in each (the first has no logprob).
PROBE_SEQUENCES, PROBE_LENGTH = 2, 17
#: Ids the probe draws from: every vocabulary has at least these.
PROBE_VOCAB = 256
#: Logprobs a server may report (the message's bound).
MAX_PROBE_VALUES = 1024


def probe_ids(seed: int = 0) -> list[list[int]]:
    """The probe's token sequences: ``PROBE_SEQUENCES`` lists of ``PROBE_LENGTH`` ids."""
    rng = random.Random(seed)
    return [
        [rng.randrange(PROBE_VOCAB) for _ in range(PROBE_LENGTH)] for _ in range(PROBE_SEQUENCES)
    ]


def _scored(mine: Sequence[float], values: Sequence[float]) -> bool:
    """Whether ``values`` can be set against ``mine``: as many, every one finite (a NaN or
    inf comes from weights that arrived broken, the worst case the probe is there for)."""
    return len(values) == len(mine) and all(math.isfinite(v) for v in values)


def compare(mine: Sequence[float], theirs: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per server, the mean absolute difference between the learner's probe logprobs
    (``mine``) and the server's; a server that reported none is left out, one that reported
    a probe of another length or with a NaN or inf gets ``inf`` (it cannot have scored
    these tokens with these weights)."""
    out: dict[str, float] = {}
    for server, values in theirs.items():
        if not values:
            continue
        if not _scored(mine, values):
            out[server] = float("inf")
            continue
        out[server] = sum(abs(a - b) for a, b in zip(mine, values, strict=True)) / len(mine)
    return out


def probe_metrics(mine: Sequence[float], theirs: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``sync/probe_mean_abs_diff`` (the worst server's), ``sync/probe_max_abs_diff`` (the
    largest single token's) and ``sync/probe_kl`` (mean of mine - theirs on the worst server:
    the learner's view of how much more likely it finds the probe) over the servers that
    reported a probe; empty when none did."""
    diffs = compare(mine, theirs)
    if not diffs:
        return {}
    worst = max(diffs, key=lambda s: diffs[s])
    values = theirs[worst]
    largest = max(
        (
            max((abs(a - b) for a, b in zip(mine, v, strict=True)), default=0.0)
            if _scored(mine, v)
            else float("inf")
        )
        for v in theirs.values()
        if v
    )
    kl = (
        sum(a - b for a, b in zip(mine, values, strict=True)) / len(mine)
        if _scored(mine, values)
        else float("inf")
    )
    return {
        "sync/probe_mean_abs_diff": diffs[worst],
        "sync/probe_max_abs_diff": largest,
        "sync/probe_kl": kl,
        "sync/probe_servers": float(len(diffs)),
        # Infinite differences are left out of the metrics record: this says they were there.
        "sync/probe_broken_servers": float(sum(d == float("inf") for d in diffs.values())),
    }
