"""Validation scores from the buffer's sums per round and data source, one record per
round.

The coordinator deals a validation round (every validation prompt once, ``val_kwargs.n``
samples each) every ``trainer.test_freq`` steps; the buffer sums each complete validation
group by its round and data source. This tracker reports a round once its groups are all
in: ``val/score`` (mean reward over the round's responses), its standard errors over
responses and over prompts, and ``val/<data_source>/score``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.control.state import ValidationProgress
    from asyncrl.wire import ValidationStats


class ValidationTracker:
    """Reports each validation round once, when the buffer's sums for it are complete.

    The buffer keeps each round's sums for its session (never drained), so a reply lost on
    the way, or a learner restarted from a checkpoint taken before it read them, reads them
    again; the rounds reported are saved in checkpoints (:meth:`state_dict`). A round
    reported after the checkpoint by a learner that then died is reported again."""

    def __init__(self) -> None:
        self.reported: set[str] = set()  # round keys (``val.<lineage>/<k>``)
        # A restarted buffer sums from 0: what its earlier sessions had summed is carried
        # (their scored groups are not dealt again), the current session's is the latest.
        self.session: str | None = None
        self.carried: dict[str, dict[str, ValidationStats]] = {}
        self.seen: dict[str, dict[str, ValidationStats]] = {}

    def missing(self, progress: ValidationProgress) -> list[str]:
        """The keys of the started rounds not reported yet."""
        keys = map(progress.round_key, range(progress.rounds_started))
        return [key for key in keys if key not in self.reported]

    def pending(self, progress: ValidationProgress) -> bool:
        """Whether a started round is not reported yet."""
        return bool(self.missing(progress))

    def add(
        self,
        by_round: dict[str, dict[str, ValidationStats]],
        progress: ValidationProgress,
        session: str = "",
    ) -> list[dict[str, float]]:
        """The metrics of every started round whose groups (one per validation row) are all
        in (``by_round``: buffer ``session``'s sums, round key -> data source -> sums, plus
        what earlier buffer sessions summed) and that was not reported yet, oldest first
        (see :func:`round_metrics`)."""
        if session != self.session:
            if self.session is not None:
                for key, sources in self.seen.items():
                    self.carried[key] = _merged(self.carried.get(key, {}), sources)
            self.session = session
        self.seen = by_round
        out = []
        for number in range(progress.rounds_started):
            key = progress.round_key(number)
            stats = _merged(self.carried.get(key, {}), by_round.get(key, {}))
            if key in self.reported or not stats or progress.round_groups == 0:
                continue
            if sum(s.groups for s in stats.values()) >= progress.round_groups:
                out.append(round_metrics(stats))
                self.reported.add(key)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"reported": sorted(self.reported)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reported = set(state.get("reported", []))


def _merged(
    a: dict[str, ValidationStats], b: dict[str, ValidationStats]
) -> dict[str, ValidationStats]:
    """Two sets of sums per data source, added."""
    if not a or not b:
        return a or b
    out = dict(a)
    for source, s in b.items():
        if source in out:
            t = out[source]
            fields = {f: getattr(t, f) + getattr(s, f) for f in s.__struct_fields__}
            out[source] = type(s)(**fields)
        else:
            out[source] = s
    return out


def round_metrics(stats: dict[str, ValidationStats]) -> dict[str, float]:
    """One round's record from its sums per data source: ``val/score`` (mean reward over
    responses), ``val/score_se`` (its standard error over responses),
    ``val/score_se_prompt`` (over prompts' mean rewards: larger when prompts differ in
    difficulty, since a prompt's samples are not independent), ``val/responses`` and
    ``val/<data_source>/score``."""
    resp, prompt = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    for s in stats.values():
        _add(resp, s.trajectories, s.reward_sum, s.reward_sq_sum)
        _add(prompt, s.groups, s.group_mean_sum, s.group_mean_sq_sum)
    n, total, _ = resp
    out = {"val/score": total / max(n, 1), "val/responses": n}
    for key, acc in (("val/score_se", resp), ("val/score_se_prompt", prompt)):
        if acc[0] >= 2:
            out[key] = mean_standard_error(*acc)
    for source, s in stats.items():
        out[f"val/{source}/score"] = s.reward_sum / max(s.trajectories, 1)
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
