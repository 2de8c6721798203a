"""What a dealt task becomes on a rollout server: its prompt fitted to ``data.*``, its
``task.n`` responses generated (one turn each, or multi-turn tool episodes), scored, and
built into the group to push.

The rollout server (:mod:`rollout_servers.server`) decides when a task runs and what
happens to its group (pushed, filtered, acknowledged, reported failed); this only makes
the group. The pure steps (sampling parameters, prompt fitting, overlong shaping,
trajectories) are :mod:`rollout_servers.groups`'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.rewards import ScoreJob, ScoreResult
from asyncrl.wire import Trajectory
from rollout_servers.agent import (
    AgentRunner,
    budget_lengths,
    episode_samples,
    episode_trajectories,
)
from rollout_servers.groups import (
    SamplingSettings,
    build_group,
    fit_task_prompt,
    sampling_params,
    shape_overlong,
)
from rollout_servers.samples import Sample

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.control.messages import Task
    from rollout_servers.lanes import Lanes
    from rollout_servers.protocols import GenerationEngine, Scorer, Tokenizer
    from rollout_servers.server_stats import ServerStats

log = logging.getLogger(__name__)

T = TypeVar("T")

#: ``extra_info["num_turns"]`` of a single-turn sample: veRL's single-turn agent loop counts
#: two, the prompt's turn and the response's.
SINGLE_TURN_NUM_TURNS = 2


def single_turn_extra_info(extra_info: dict[str, Any]) -> dict[str, Any]:
    """The row's ``extra_info`` as veRL's reward managers hand a single-turn sample's scorer:
    with ``num_turns`` (:data:`SINGLE_TURN_NUM_TURNS`) and ``rollout_reward_scores`` (empty:
    no tool scored the sample). veRL sets them after reading the row, so they replace the
    row's own keys of these names, as a multi-turn sample's do
    (:meth:`rollout_servers.episodes.Episode.scorer_extra_info`)."""
    return {**extra_info, "num_turns": SINGLE_TURN_NUM_TURNS, "rollout_reward_scores": {}}


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """The results of ``aws`` in order; the first to raise cancels the others, and they have
    ended when it is raised here. ``asyncio.gather`` leaves them running: a group whose one
    sample failed was reported failed and its slots freed while the rest still generated
    in the engine. (``asyncio.TaskGroup`` does this from Python 3.11 only.)"""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # a sibling's failure, or this task's own cancellation
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class TaskGroups:
    """Makes the scored group of a task (see the module docstring). The prompts it cuts or
    drops, and the time its responses wait for the scorer, are counted in ``stats``, the
    server's (:class:`~rollout_servers.server_stats.ServerStats`)."""

    def __init__(
        self,
        cfg: Config,
        server_id: str,
        engine: GenerationEngine,
        tokenizer: Tokenizer,
        pool: Scorer,
        lanes: Lanes,
        settings: SamplingSettings,
        stats: ServerStats,
        agent: AgentRunner | None = None,
    ) -> None:
        self.cfg = cfg
        self.server_id = server_id
        self.engine = engine
        self.tok = tokenizer
        self.pool = pool
        self.lanes = lanes
        self.settings = settings
        self.stats = stats
        self.metrics = stats.metrics
        self.agent = agent  # runs tool_agent tasks as multi-turn episodes (None: single turn)

    async def make(
        self, task: Task, created: float
    ) -> tuple[list[Trajectory], list[Sample], list[ScoreResult]]:
        """The task's group (empty when its prompt is dropped), its samples and their
        scores: ``tool_agent`` tasks run as episodes when the server has an agent."""
        if self.agent is not None and task.agent_name == "tool_agent":
            return await self._episodes(task, self.agent, created)
        return await self._single_turn(task, created)

    async def _single_turn(
        self, task: Task, created: float
    ) -> tuple[list[Trajectory], list[Sample], list[ScoreResult]]:
        """Generate and score ``task.n`` responses; the group and what to count."""
        prompt = self._prompt_ids(task)
        if prompt is None:  # too long, filtered: nothing to generate
            return [], [], []
        samples = await gather_or_cancel(
            *[
                self.engine.generate(
                    prompt,
                    sampling_params(self.settings, task, i),
                    f"{task.task_id}/{task.attempt}/{i}",
                )
                for i in range(task.n)
            ]
        )
        texts = [self.tok.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        scores = await self._score(task, texts, [len(s.token_ids) for s in samples])
        group = build_group(
            task, prompt, samples, scores, server_id=self.server_id, created_at=created
        )
        return group, samples, scores

    async def _episodes(
        self, task: Task, agent: AgentRunner, created: float
    ) -> tuple[list[Trajectory], list[Sample], list[ScoreResult]]:
        """Run and score ``task.n`` episodes; the group (one trajectory per sample) and,
        to count, each episode as one sample of its tokens. A training prompt over
        ``data.max_prompt_length`` with ``data.filter_overlong_prompts`` is dropped, as a
        single-turn one is (cut, it lost its start: the system line naming the tools)."""
        d = self.cfg.data
        filtering = d.filter_overlong_prompts and not task.validation
        if filtering and agent.prompt_len(task) > d.max_prompt_length:
            self.metrics["rollout/prompts_filtered_too_long"] += 1
            return [], [], []
        episodes = await gather_or_cancel(*[agent.episode(task, i) for i in range(task.n)])
        texts = [ep.text(self.tok) for ep in episodes]
        samples = episode_samples(episodes)
        infos = [ep.scorer_extra_info(task.extra_info) for ep in episodes]
        scores = await self._score(task, texts, budget_lengths(episodes), infos)
        group = episode_trajectories(
            task, episodes, scores, server_id=self.server_id, created_at=created
        )
        return group, samples, scores

    async def _score(
        self,
        task: Task,
        texts: list[str],
        lengths: list[int],
        infos: list[dict[str, Any]] | None = None,
    ) -> list[ScoreResult]:
        """The scorer's rewards; for training, with the overlong penalty of each
        response's ``lengths[i]`` tokens (``reward.overlong_buffer``). ``infos``: each
        text's ``extra_info`` (an episode's own), else the task's as a single-turn sample's
        (:func:`single_turn_extra_info`)."""
        if infos is None:
            infos = [single_turn_extra_info(task.extra_info) for _ in texts]
        jobs = [
            ScoreJob(task.data_source, t, task.ground_truth, info)
            for t, info in zip(texts, infos, strict=True)
        ]
        with self.stats.after_generation.phase("scoring", task.n):
            scores = await self.lanes.scoring(self.pool.score_many, jobs)
        # Each failure scored 0.0 and was logged once per kind; counted, a scorer that
        # fails on every sample shows in the run's records, not only in this log.
        self.metrics["rollout/reward_errors"] += sum(s.error is not None for s in scores)
        if task.validation:  # validation reports the task's own score
            return scores
        limit = self.cfg.data.max_response_length
        return shape_overlong(scores, lengths, limit, self.cfg.reward.overlong_buffer)

    def _prompt_ids(self, task: Task) -> list[int] | None:
        """The prompt's tokens as ``data.*`` says (:func:`fit_task_prompt`); None when it
        is too long and dropped."""
        from asyncrl.prepare.tokenizer import chat_prompt_ids

        ids = task.prompt_token_ids or chat_prompt_ids(self.tok, task.prompt)
        out = fit_task_prompt(ids, self.cfg.data, task.validation)
        if out is None:
            self.metrics["rollout/prompts_filtered_too_long"] += 1
        elif len(out) < len(ids):
            if not self.metrics["rollout/prompts_truncated"]:
                log.warning(
                    "prompt of %d tokens cut to data.max_prompt_length=%d; drop long "
                    "prompts with data.filter_overlong_prompts=True",
                    len(ids),
                    len(out),
                )
            self.metrics["rollout/prompts_truncated"] += 1
        return out
