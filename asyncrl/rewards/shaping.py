"""DAPO's reward-side rules, pure: the soft overlong penalty and the dynamic-sampling
filter's test of whether a group carries a GRPO signal.

Both run at the rollout server, where a group's scores are known before it is pushed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# The part a shaped member's reward records its penalty under (summed into the reward).
OVERLONG_PART = "overlong_penalty"
# Score metrics that name the reward itself rather than a part the scorer returned.
SCORE_METRICS = {"score": "score", "seq_reward": "reward", "seq_final_reward": "reward"}


def overlong_penalty(response_len: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong penalty of a response of ``response_len`` tokens.

    0 up to ``max_len - buffer_len`` tokens, then falling linearly to ``-factor`` at
    ``max_len``: ``min(-(response_len - (max_len - buffer_len)) / buffer_len * factor, 0)``.
    A response cut at the limit has ``response_len == max_len`` and gets ``-factor``.
    ``buffer_len <= 0`` disables it (0.0).
    """
    if buffer_len <= 0:
        return 0.0
    exceed = response_len - (max_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


def metric_value(metric: str, score: float, reward: float, parts: dict[str, float]) -> float:
    """The value of ``algorithm.filter_groups.metric`` for one member.

    ``score``: the scorer's score before shaping; ``seq_reward``/``seq_final_reward``: the
    reward after shaping (what GRPO's advantage sees); ``acc``: the scorer's ``acc`` part,
    else its score (as veRL's DAPO reward manager records it); any other name: that part
    of a dict-returning scorer (a member without it counts as NaN, so the group is kept).
    """
    if metric in SCORE_METRICS:
        return score if SCORE_METRICS[metric] == "score" else reward
    if metric == "acc" and metric not in parts:
        return score
    return float(parts.get(metric, math.nan))


def has_signal(values: Sequence[float]) -> bool:
    """Whether a group is worth training: its members' metric values are not all equal.

    A group of one is kept (veRL keeps it: nothing to compare), and so is a group with a
    NaN (an unknown metric must not silently empty the batch).
    """
    if len(values) <= 1 or any(math.isnan(v) for v in values):
        return True
    return max(values) - min(values) > 0.0
