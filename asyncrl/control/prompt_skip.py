"""Skipping prompts the filter is likely to drop, before they are generated
(``algorithm.filter_groups.skip_uninformative``).

DAPO's filter pays for a dropped group's whole generation. A prompt's groups tend to stay
uninformative from one epoch to the next (a sum the model has learned keeps scoring 8 of
8), which GRESO (Zheng et al., 2025, "Act Only When It Pays") uses to skip such prompts
*before* generating them. Here the coordinator keeps, per training row, how many of its
groups in a row the servers filtered (``streak``; a group that is trained resets it), and
the task source passes over a row with ``streak = k`` with probability ``1 -
max(explore ** k, explore_min)``: a prompt still gets tried now and then, so one the model
has un-learned (or grown into) comes back. A skipped row is never dealt, so it is no task
and not in the accounting identity; it is counted in ``filter/prompts_skipped``.

Only groups dealt with the filter on are verdicts (past ``max_num_gen_batches`` groups are
dealt unfiltered and pushed whatever they score). The decision for one row at one position
of one epoch is a pure function of the seed, that position and the row's streak: the
streaks are saved with the coordinator, and a restored one draws as the saved one would
have (the groups outstanding at the checkpoint, dealt again, may then move the streaks at
other moments than in the lost run).
"""

from __future__ import annotations

import random
from typing import Any


class PromptSkip:
    """Rows' filtered streaks, and whether to pass a row over; not thread-safe."""

    def __init__(self, *, explore: float, explore_min: float, seed: int):
        if not (0.0 < explore <= 1.0 and 0.0 < explore_min <= 1.0):
            raise ValueError(f"explore {explore} and explore_min {explore_min} must be in (0, 1]")
        self.explore = explore
        self.explore_min = explore_min
        self.seed = seed
        self.streak: dict[int, int] = {}  # row -> its groups filtered in a row (absent: 0)
        self.skipped = 0  # rows passed over, in all
        self.skipped_since_step = 0
        self.last_skipped = 0  # rows passed over between the last two trained steps

    def record(self, row: int, informative: bool) -> None:
        """A group of ``row`` was trained (``informative``) or filtered."""
        if informative:
            self.streak.pop(row, None)
        else:
            self.streak[row] = self.streak.get(row, 0) + 1

    def keep_probability(self, row: int) -> float:
        """The chance ``row`` is dealt when its turn comes."""
        k = self.streak.get(row, 0)
        return 1.0 if k == 0 else max(self.explore**k, self.explore_min)

    def skip(self, row: int, epoch: int, position: int) -> bool:
        """Pass ``row`` over at ``position`` of ``epoch`` (counted when True)."""
        p = self.keep_probability(row)
        if p >= 1.0:
            return False
        # An int seed: the same draw on every platform, and again after a restore.
        draw = random.Random((self.seed * 1_000_003 + epoch) * 1_000_033 + position).random()
        if draw < p:
            return False
        self.skipped += 1
        self.skipped_since_step += 1
        return True

    def stepped(self) -> None:
        """The learner trained a step: the per-step count starts again."""
        self.last_skipped, self.skipped_since_step = self.skipped_since_step, 0

    def state_dict(self) -> dict[str, Any]:
        """The streaks (as ``[row, k]`` pairs: JSON has no int keys) and the count."""
        return {"streak": sorted(self.streak.items()), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = {int(r): int(k) for r, k in state["streak"]}
        self.skipped = int(state["skipped"])

    def metrics(self) -> dict[str, float]:
        return {
            "filter/prompts_skipped": float(self.skipped),
            "filter/prompts_skipped_step": float(self.last_skipped),
            "filter/rows_with_streak": float(len(self.streak)),
        }
