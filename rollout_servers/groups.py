"""From a task to a pushed group: prompt tokens, sampling parameters, trajectories.

Pure helpers of the rollout server (no sockets, no engine): what a task becomes before it
is generated, and how finished samples and their rewards become wire trajectories.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.wire import Trajectory

if TYPE_CHECKING:
    from vllm import SamplingParams

    from asyncrl.config import Config
    from asyncrl.config.data import DataConfig
    from asyncrl.config.recipes import OverlongBufferConfig
    from asyncrl.control.messages import Task
    from asyncrl.rewards import ScoreResult
    from rollout_servers.samples import Sample


@dataclass(frozen=True)
class SamplingSettings:
    """What a request needs from the config: training sampling is the full distribution
    after temperature (the learner recomputes exactly it); validation uses ``val_kwargs``."""

    temperature: float
    max_tokens: int
    seed: int
    val_temperature: float
    val_top_p: float
    val_top_k: int
    seeded: bool = True  # per-request seeds (see rollout_servers.engine_config.cpu_token_budget)

    @classmethod
    def from_config(cls, cfg: Config, seeded: bool = True) -> SamplingSettings:
        val = cfg.rollout.val_kwargs
        return cls(
            seeded=seeded,
            temperature=cfg.rollout.temperature,
            max_tokens=cfg.data.max_response_length,
            seed=cfg.trainer.seed,
            val_temperature=val.temperature,
            val_top_p=val.top_p,
            val_top_k=val.top_k,
        )


def request_seed(base: int, task_id: str, attempt: int, index: int) -> int:
    """A per-request seed: reproducible for a (task, attempt, sample) and distinct across
    the samples of a group, so the group's responses differ."""
    return zlib.crc32(f"{base}/{task_id}/{attempt}/{index}".encode()) & 0x7FFFFFFF


def sampling_params(settings: SamplingSettings, task: Task, index: int) -> SamplingParams:
    """vLLM ``SamplingParams`` for sample ``index`` of ``task`` (logprob of the sampled
    token at each position, ``n`` = 1: every sample is its own request).

    The server reads only a request's final output, as token ids (it decodes the text it
    scores itself), so vLLM is asked for nothing else: no output per engine step, no
    incremental detokenization. On 2 CPU cores that made 256 short requests 35% faster
    (0.34 s -> 0.22 s): per-step outputs cost the server's Python more than the tiny
    model's forward passes.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    seed = (
        request_seed(settings.seed, task.task_id, task.attempt, index) if settings.seeded else None
    )
    if task.validation:
        sampling = {
            "temperature": settings.val_temperature,
            "top_p": settings.val_top_p,
            "top_k": settings.val_top_k,
        }
    else:  # the full distribution after temperature (see SamplingSettings)
        sampling = {"temperature": settings.temperature, "top_p": 1.0, "top_k": -1}
    return SamplingParams(
        **sampling,
        max_tokens=settings.max_tokens,
        logprobs=0,
        seed=seed,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=False,
    )


def build_group(
    task: Task,
    prompt_ids: list[int],
    samples: list[Sample],
    scores: list[ScoreResult],
    *,
    server_id: str,
    created_at: float,
) -> list[Trajectory]:
    """Wire trajectories of one complete group: ``samples[i]`` (an engine ``Sample``)
    scored ``scores[i]`` (a reward ``ScoreResult``). Each carries the temperature its
    sample was drawn at, so a server whose rollout.temperature differs from the learner's
    configured one still gets importance weights right."""
    common = group_fields(task, server_id=server_id, created_at=created_at)
    return [
        Trajectory.build(
            prompt_ids=prompt_ids,
            response_ids=sample.token_ids,
            logprobs=sample.logprobs,
            version_spans=sample.version_spans or [(sample.start_version, 0)],
            **scored(score),
            group_index=index,
            group_size=len(samples),
            finish_reason=sample.finish_reason,
            temperature=sample.temperature,
            **common,
        )
        for index, (sample, score) in enumerate(zip(samples, scores, strict=True))
    ]


def group_fields(task: Task, *, server_id: str, created_at: float) -> dict[str, Any]:
    """The trajectory fields every member of ``task``'s group shares."""
    return {
        "task_id": task.task_id,
        "validation": task.validation,
        "data_source": task.data_source,
        "server_id": server_id,
        "created_at": created_at,
        "finished_at": time.time(),
    }


def scored(score: ScoreResult) -> dict[str, Any]:
    """A member's reward fields from its score (``reward_error`` only when the scorer
    failed on it: omitted, the field is false)."""
    fields: dict[str, Any] = {
        "reward": float(score.score),
        "reward_parts": {k: float(v) for k, v in score.parts.items()},
    }
    if score.error is not None:
        fields["reward_error"] = True
    return fields


def shape_overlong(
    scores: list[ScoreResult], lengths: list[int], max_len: int, cfg: OverlongBufferConfig
) -> list[ScoreResult]:
    """Each member's score plus DAPO's soft overlong penalty for its ``lengths[i]``
    generated tokens (``reward.overlong_buffer``); the penalty is kept as the part
    ``overlong_penalty``, and the scorer's score as ``unshaped`` (what the group filter's
    ``score`` and ``acc`` compare). Unchanged when it is off."""
    from asyncrl.rewards import ScoreResult
    from asyncrl.rewards.shaping import OVERLONG_PART, overlong_penalty

    if not cfg.enable:
        return scores
    out = []
    for score, n in zip(scores, lengths, strict=True):
        penalty = overlong_penalty(n, max_len, cfg.len, cfg.penalty_factor)
        parts = {**score.parts, OVERLONG_PART: penalty}
        shaped = score.score + penalty
        out.append(ScoreResult(shaped, parts, score.error, unshaped=score.score))
    return out


def filtered_out(task: Task, scores: list[ScoreResult], metric: str) -> bool:
    """Whether the group filter drops this group: its task was dealt with the filter on
    and every member's ``metric`` (``algorithm.filter_groups.metric``) is the same. Not a
    group whose every member the scorer failed on: alike only by its failures, it is kept,
    so that a scorer failing everywhere shows in the step records' ``rollout/reward_errors``
    (filtered, no step ever came, and the coordinator blamed the prompts)."""
    from asyncrl.rewards.shaping import has_signal, metric_value

    if not task.filter or task.validation or all(s.error for s in scores):
        return False
    values = [
        metric_value(metric, s.score if s.unshaped is None else s.unshaped, s.score, s.parts)
        for s in scores
    ]
    return not has_signal(values)


def unknown_filter_metric(task: Task, scores: list[ScoreResult], metric: str) -> str | None:
    """The one-line warning when ``algorithm.filter_groups.metric`` names nothing the group's
    scores carry (not a score name, and no member returns it as a part), else None. Such a
    group is kept, as every group would be: the filter would do nothing, unnoticed (veRL
    raises a KeyError here)."""
    from asyncrl.rewards.shaping import SCORE_METRICS

    if not task.filter or task.validation or metric in SCORE_METRICS or metric == "acc":
        return None
    if any(metric in s.parts for s in scores):
        return None
    returned = sorted({k for s in scores for k in s.parts}) or ["no parts, only a score"]
    return (
        f"algorithm.filter_groups.metric={metric!r} is not among what the scorer returns "
        f"({', '.join(returned)}): no group is filtered; use acc, score, seq_reward, "
        "seq_final_reward or one of the scorer's keys"
    )


class PromptTooLong(ValueError):
    """A prompt over ``data.max_prompt_length`` with ``data.truncation: error``."""


def fit_prompt(ids: list[int], limit: int, truncation: str) -> list[int]:
    """``ids`` cut to ``limit`` tokens as ``data.truncation`` says (veRL's modes): ``left``
    keeps the end (the chat header the model answers after), ``right`` the start,
    ``middle`` both halves; ``error`` raises :class:`PromptTooLong` naming the fix."""
    if len(ids) <= limit:
        return ids
    if truncation == "left":
        return ids[-limit:]
    if truncation == "right":
        return ids[:limit]
    if truncation == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head) :]
    raise PromptTooLong(
        f"prompt of {len(ids)} tokens is over data.max_prompt_length={limit} with "
        "data.truncation=error: set data.filter_overlong_prompts=True to drop such prompts, "
        "or data.truncation=left to cut them"
    )


def fit_task_prompt(ids: list[int], data: DataConfig, validation: bool) -> list[int] | None:
    """A task's prompt tokens within ``data.max_prompt_length``: None when it is longer and
    ``data.filter_overlong_prompts`` drops it, else cut as ``data.truncation`` says
    (:func:`fit_prompt`). A validation prompt is never dropped here (its round waits for
    it): with the filter on, the coordinator left the over-long validation rows out when
    it loaded them, as veRL does; one still longer here (measured otherwise) is cut, at
    the left where ``error`` would fail it."""
    if len(ids) <= data.max_prompt_length:
        return ids
    if data.filter_overlong_prompts and not validation:
        return None
    mode = data.truncation
    if data.filter_overlong_prompts and mode == "error":
        mode = "left"
    return fit_prompt(ids, data.max_prompt_length, mode)
