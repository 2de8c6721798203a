"""Validation rounds from the buffer's sums: score and its standard errors over responses
and over prompts, checked against the same figures computed from the raw rewards."""

import math
import statistics

from asyncrl.control.state import ValidationProgress
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
    progress = ValidationProgress(rounds_started=1, round_groups=5, head="val.x")
    tracker = ValidationTracker()
    assert tracker.pending(progress)
    assert tracker.add({"val.x/0": {"a": _stats(a[:2])}}, progress) == []  # 2 of 5 groups in
    # The buffer's sums are cumulative: the next poll has the whole round.
    [out] = tracker.add({"val.x/0": {"a": _stats(a), "b": _stats(b)}}, progress)
    flat = [r for g in a + b for r in g]
    means = [sum(g) / len(g) for g in a + b]
    assert not tracker.pending(progress)
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


def test_each_round_is_reported_once_and_a_restored_tracker_reads_the_rest_again():
    """Rounds are read from the buffer's cumulative sums by key: a round is reported once,
    rounds complete together are reported in order, and a tracker restored from a
    checkpoint taken before a round was read reports it (nothing is drained)."""
    one = {"s": _stats([[1.0, 0.0]])}
    two = {"s": _stats([[1.0, 1.0]])}
    progress = ValidationProgress(rounds_started=2, round_groups=1, head="val.x")
    tracker = ValidationTracker()
    saved = tracker.state_dict()  # a checkpoint before any round was read
    by_round = {"val.x/0": one, "val.x/1": two, "val.other/0": two}  # another lineage's too
    got = tracker.add(by_round, progress)
    assert [r["val/score"] for r in got] == [0.5, 1.0]
    assert tracker.add(by_round, progress) == [] and not tracker.pending(progress)
    restored = ValidationTracker()
    restored.load_state_dict(saved)
    assert restored.pending(progress)
    assert [r["val/score"] for r in restored.add(by_round, progress)] == [0.5, 1.0]
    later = ValidationTracker()
    later.load_state_dict(tracker.state_dict())
    assert later.add(by_round, progress) == [] and not later.pending(progress)


def test_a_round_split_across_a_buffer_restart_adds_both_sessions_sums():
    """The buffer restarts in the middle of a round: its new session sums from 0, and the
    groups the old one scored are not dealt again. The round is the two sessions' sums."""
    progress = ValidationProgress(rounds_started=1, round_groups=3, head="val.x")
    tracker = ValidationTracker()
    assert tracker.add({"val.x/0": {"s": _stats([[1.0, 1.0]])}}, progress, "old") == []
    assert tracker.add({}, progress, "new") == []  # the new buffer has nothing yet
    both = {"s": _stats([[0.0, 0.0], [1.0, 0.0]])}
    [out] = tracker.add({"val.x/0": both}, progress, "new")
    assert math.isclose(out["val/score"], 3 / 6) and out["val/responses"] == 6
