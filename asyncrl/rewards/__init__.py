"""Rewards: built-in scorers by data source, custom scorers, and a killable worker pool.

- :func:`default_compute_score` dispatches on ``data_source`` (``arithmetic``,
  ``countdown``, ``gsm8k``/``openai/gsm8k``), as veRL's reward manager does.
- :func:`load_custom_scorer` loads ``reward.custom_reward_function.{path,name}``, to be
  called as one of veRL's per-response reward managers calls it (:data:`REWARD_MANAGERS`).
- :class:`RewardPool` runs either in worker processes with a per-sample timeout, so a slow
  or hostile scorer costs one sample's reward, never the caller's progress.

Importing this package loads no torch, vLLM or transformers.
"""

from asyncrl.rewards.registry import (
    KNOWN_DATA_SOURCES,
    REWARD_MANAGERS,
    ScoreFn,
    default_compute_score,
    load_custom_scorer,
    normalize_score,
)
from asyncrl.rewards.sandbox import ERROR_KINDS, RewardPool, ScoreJob, ScoreResult

__all__ = [
    "ERROR_KINDS",
    "KNOWN_DATA_SOURCES",
    "REWARD_MANAGERS",
    "RewardPool",
    "ScoreFn",
    "ScoreJob",
    "ScoreResult",
    "default_compute_score",
    "load_custom_scorer",
    "normalize_score",
]
