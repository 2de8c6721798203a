"""Validation rounds from the buffer's sums: score and its standard errors over responses
and over prompts, checked against the same figures computed from the raw rewards."""

import math
import statistics

from asyncrl.wire import ValidationStats
from learner.validation import ValidationTracker, mean_standard_error


def _stats(groups: list[list[float]]) -> ValidationStats:
    s = ValidationStats()
    for rewards in groups:
        s.add_group(rewards, response_tokens=len(rewards))
    return s


def _sem(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs))


def test_round_scores_and_standard_errors_match_the_raw_rewards():
    a = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0.5, 1, 1]]  # prompts of different difficulty
    b = [[0.25, 0.75, 1, 1], [0, 1, 0, 1]]
    rounds_started, round_groups = 1, 5
    tracker = ValidationTracker()
    assert tracker.pending(rounds_started)
    assert tracker.add({"a": _stats(a[:2])}, round_groups) is None  # 2 of 5 groups in
    out = tracker.add({"a": _stats(a[2:]), "b": _stats(b)}, round_groups)
    flat = [r for g in a + b for r in g]
    means = [sum(g) / len(g) for g in a + b]
    assert out is not None and not tracker.pending(rounds_started)
    assert math.isclose(out["val/score"], statistics.fmean(flat))
    assert math.isclose(out["val/score_se"], _sem(flat))
    assert math.isclose(out["val/score_se_prompt"], _sem(means))
    assert out["val/score_se_prompt"] > out["val/score_se"]  # prompts differ in difficulty
    assert math.isclose(out["val/a/score"], statistics.fmean([r for g in a for r in g]))
    assert out["val/responses"] == len(flat)


def test_binary_rewards_give_the_binomial_standard_error_up_to_n_over_n_minus_1():
    n, k = 40, 10
    se = mean_standard_error(n, k, k)  # 0/1 rewards: sum of squares == sum
    p = k / n
    assert math.isclose(se, math.sqrt(p * (1 - p) / n) * math.sqrt(n / (n - 1)))
    assert mean_standard_error(3, 3.0, 3.0) == 0.0  # all equal: no spread
