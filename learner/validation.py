"""Validation scores from the buffer's per-data-source sums, one record per round.

The coordinator deals a validation round (every validation prompt once, ``val_kwargs.n``
samples each) every ``trainer.test_freq`` steps; the buffer sums each complete validation
group per data source. This tracker adds those sums up until a round's groups are all in,
then reports ``val/score`` (mean reward over the round's responses), its standard errors
over responses and over prompts, and ``val/<data_source>/score``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any


class ValidationTracker:
    """Accumulates validation sums into rounds of ``round_groups`` groups."""

    def __init__(self) -> None:
        self.groups = 0
        self._reset()
        self.rounds_done = 0

    def _reset(self) -> None:
        # n, sum, sum of squares over responses; the same over the groups' mean rewards
        self.resp = [0.0, 0.0, 0.0]
        self.prompt = [0.0, 0.0, 0.0]
        self.by_source: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    def pending(self, rounds_started: int) -> bool:
        """Whether a started round (``rounds_started``: the coordinator's count) is not
        complete yet."""
        return rounds_started > self.rounds_done

    def add(self, stats: dict[str, Any], round_groups: int) -> dict[str, float] | None:
        """Add one poll of the buffer's validation sums (a round is ``round_groups`` groups,
        one per validation row); the round's metrics when complete:
        ``val/score`` (mean reward over responses), ``val/score_se`` (its standard error
        over responses), ``val/score_se_prompt`` (over prompts' mean rewards: larger when
        prompts differ in difficulty, since a prompt's samples are not independent),
        ``val/responses`` and ``val/<data_source>/score``."""
        for source, s in stats.items():
            self.groups += s.groups
            _add(self.resp, s.trajectories, s.reward_sum, s.reward_sq_sum)
            _add(self.prompt, s.groups, s.group_mean_sum, s.group_mean_sq_sum)
            acc = self.by_source[source]
            acc[0] += s.reward_sum
            acc[1] += s.trajectories
        if round_groups == 0 or self.groups < round_groups:
            return None
        n, total, _ = self.resp
        out = {"val/score": total / max(n, 1), "val/responses": n}
        for key, acc in (("val/score_se", self.resp), ("val/score_se_prompt", self.prompt)):
            if acc[0] >= 2:
                out[key] = mean_standard_error(*acc)
        for source, (total, count) in self.by_source.items():
            out[f"val/{source}/score"] = total / max(count, 1)
        self.rounds_done += 1
        self.groups -= round_groups
        self._reset()
        return out


def _add(acc: list[float], n: float, total: float, sq: float) -> None:
    acc[0] += n
    acc[1] += total
    acc[2] += sq


def mean_standard_error(n: float, total: float, sq: float) -> float:
    """Standard error of the mean of ``n`` values from their sum and sum of squares
    (sample variance with ``n - 1``); for 0/1 rewards close to ``sqrt(p (1 - p) / n)``."""
    mean = total / n
    var = max(0.0, (sq - n * mean * mean) / (n - 1))
    return math.sqrt(var / n)
