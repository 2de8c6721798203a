"""The long-response shape's reward (``benchmarks/vs_trl.py``): the share of digits in the
response, dense in [0, 1], so an untrained model writing 128 tokens has a signal to learn
from at every step. veRL's ``compute_score`` signature, as reward.custom_reward_function."""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    if not solution_str:
        return 0.0
    return sum(ch.isdigit() for ch in solution_str) / len(solution_str)
