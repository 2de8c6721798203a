"""A single-turn sample's scorer gets the ``extra_info`` veRL's reward managers give it: the
row's, with ``num_turns`` (2, as veRL's single-turn agent loop counts) and
``rollout_reward_scores`` (empty). A ported scorer that read ``extra_info["num_turns"]``
raised KeyError on every single-turn sample and scored 0."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Sequence
from pathlib import Path

import msgspec

from asyncrl.config import load_config
from asyncrl.rewards import RewardPool, ScoreJob, ScoreResult
from rollout_servers import task_groups
from rollout_servers.groups import SamplingSettings
from rollout_servers.lanes import Lanes
from rollout_servers.protocols import Scorer
from rollout_servers.server_stats import ServerStats
from tests.standins.chat import CharTokenizer
from tests.standins.server_parts import N, StandInEngine, StandInScorer, make_task


class Recording(StandInScorer):
    """Keeps the jobs it is given."""

    def __init__(self) -> None:
        self.jobs: list[ScoreJob] = []

    def score_many(self, items: Sequence[ScoreJob]) -> list[ScoreResult]:
        self.jobs.extend(items)
        return super().score_many(items)


def run_group(scorer: Scorer, extra_info: dict, validation: bool = False) -> list[ScoreResult]:
    """Make one single-turn group of :data:`N` responses, scored by ``scorer``."""
    cfg = load_config(None, [f"rollout.n={N}"])
    engine, tok = StandInEngine(), CharTokenizer()
    engine.gate.set()
    groups = task_groups.TaskGroups(
        cfg, "s", engine, tok, scorer, Lanes(), SamplingSettings.from_config(cfg), ServerStats(tok)
    )
    task = msgspec.structs.replace(make_task("t"), extra_info=extra_info, validation=validation)
    _, _, scores = asyncio.run(groups.make(task, 0.0))
    assert task.extra_info == extra_info  # the task's own is untouched
    return scores


def test_single_turn_scorers_get_num_turns_and_rollout_reward_scores() -> None:
    for validation in (False, True):
        scorer = Recording()
        run_group(scorer, {"index": 7, "split": "train"}, validation)
        assert [job.extra_info for job in scorer.jobs] == [
            {"index": 7, "split": "train", "num_turns": 2, "rollout_reward_scores": {}}
        ] * N
    # veRL sets its keys after reading the row's: a row's own of those names is replaced.
    scorer = Recording()
    run_group(scorer, {"index": 7, "num_turns": 99, "rollout_reward_scores": {"x": 1}})
    infos = [job.extra_info or {} for job in scorer.jobs]
    assert all(info["num_turns"] == 2 and info["rollout_reward_scores"] == {} for info in infos)
    scorer = Recording()
    run_group(scorer, {})  # a row without extra_info
    assert scorer.jobs[0].extra_info == {"num_turns": 2, "rollout_reward_scores": {}}


def test_a_ported_scorer_reading_num_turns_scores(tmp_path: Path) -> None:
    file = tmp_path / "turns.py"
    file.write_text(
        textwrap.dedent(
            """
            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return extra_info["num_turns"] / 2 + len(extra_info["rollout_reward_scores"])
            """
        )
    )
    with RewardPool(num_workers=1, custom_path=str(file)) as pool:
        scores = run_group(pool, {"index": 0})
    assert [(s.score, s.error) for s in scores] == [(1.0, None)] * N
