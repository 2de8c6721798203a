"""Multi-turn, tool-using episodes on a rollout server: token ids in, token ids out.

An episode keeps the exact token ids the engine sampled, with their behaviour logprobs and
versions, and never re-tokenizes them. After an assistant turn that calls tools, the calls
run in the tool workers (:class:`asyncrl.tools.ToolPool`), and only the new messages are
turned into tokens: the history is rendered with the chat template without and with them,
and the difference is appended (loss mask 0, behaviour logprob 0). When the template does
not keep the held tokens as a prefix (a template that rewrites history, e.g. one that drops
past ``<think>`` blocks), the sample is closed and a new sample of the same episode starts
from the re-rendered history. One episode thus becomes one or more samples that share its
reward; group statistics count episodes (see :func:`episode_trajectories`).
``data.max_response_length`` bounds the episode's response, all its samples together
(:mod:`rollout_servers.episodes`).

The loop of one episode (:meth:`AgentRunner.episode`) consumes engine samples and tool
results; it waits for the engine (bounded by ``episode_timeout_s``) and for tools (bounded by
``tool_timeout_s`` per call, in killable processes, and by the episode's deadline while queued
for a worker, in the tool pool's own threads), and ends on a turn without tool calls, the turn
limits, the response budget, or the episode's deadline (which does not count the time the
engine was paused for weight syncs, during an engine turn or a tool call alike:
:mod:`rollout_servers.deadlines`). A first prompt over ``data.max_prompt_length`` is cut as
``data.truncation`` says, or refused (:class:`~rollout_servers.groups.PromptTooLong`), as a
single-turn prompt is; a cut episode goes on as any other (its later samples leave out what
the cut left out: :mod:`rollout_servers.episode_tokens`). An episode cut short by a limit
says so in its last sample's ``finish_reason`` (:data:`CUT_FINISH`), and one that ran out of
response budget counts as long as the budget for the overlong penalty
(:func:`budget_lengths`).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.tools.hermes import in_block_order, parse_tool_calls
from asyncrl.tools.pool import BAD_REWARD
from asyncrl.tools.tokens import render
from asyncrl.wire import Trajectory
from rollout_servers.deadlines import Deadline, within
from rollout_servers.episode_tokens import extend
from rollout_servers.episodes import Episode, Piece
from rollout_servers.groups import (
    SamplingSettings,
    fit_prompt,
    group_fields,
    sampling_params,
    scored,
)

if TYPE_CHECKING:
    from vllm import SamplingParams

    from asyncrl.config import Config
    from asyncrl.control.messages import Task
    from asyncrl.rewards import ScoreResult
    from asyncrl.tools import ToolPool
    from rollout_servers.protocols import GenerationEngine, Tokenizer
    from rollout_servers.samples import Sample

log = logging.getLogger(__name__)

#: Why an episode ended (counted as ``rollout/agent/episodes_ended/<why>``).
END_REASONS = ("done", "max_turns", "length", "timeout", "prompt_too_long", "template_error")
#: The ``finish_reason`` (vLLM's words) of the last sample of an episode that a limit cut
#: short: ``length`` when the budget or the engine's context had no room for what came
#: next (a tool answer thrown away), as a single-turn response cut at the limit;
#: ``abort`` when its deadline stopped it. Other episodes keep their last turn's.
CUT_FINISH = {"length": "length", "prompt_too_long": "length", "timeout": "abort"}


@dataclass(frozen=True)
class AgentSettings:
    """What an episode needs from ``rollout.multi_turn`` and ``data``."""

    max_assistant_turns: int | None
    max_user_turns: int | None
    max_parallel_calls: int
    max_prompt_len: int
    max_response_len: int
    episode_timeout_s: float
    #: ``data.truncation``: how a first prompt over ``max_prompt_len`` is cut, or refused.
    truncation: str = "left"
    #: ``data.filter_overlong_prompts``: a long training prompt is dropped before its
    #: episodes (:mod:`rollout_servers.task_groups`); a validation one is cut at the left.
    filter_overlong_prompts: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> AgentSettings:
        mt = cfg.rollout.multi_turn
        return cls(
            max_assistant_turns=mt.max_assistant_turns,
            max_user_turns=mt.max_user_turns,
            max_parallel_calls=mt.max_parallel_calls,
            max_prompt_len=cfg.data.max_prompt_length,
            max_response_len=cfg.data.max_response_length,
            episode_timeout_s=mt.episode_timeout_s,
            truncation=cfg.data.truncation,
            filter_overlong_prompts=cfg.data.filter_overlong_prompts,
        )


def turn_params(
    settings: SamplingSettings, task: Task, index: int, turn: int, max_tokens: int
) -> SamplingParams:
    """Sampling parameters of assistant turn ``turn`` of episode ``index``: the task's,
    with the response budget left and a seed of the turn's own (a reused seed would replay
    the first turn's random draws)."""
    params = sampling_params(settings, task, index).clone()
    params.max_tokens = max_tokens
    if turn and params.seed is not None:
        params.seed = zlib.crc32(f"{params.seed}/turn/{turn}".encode()) & 0x7FFFFFFF
    return params


class AgentRunner:
    """Runs the episodes of ``tool_agent`` tasks on one server's engine; counts what
    happened in :attr:`metrics` (``rollout/agent/...``)."""

    def __init__(
        self,
        settings: AgentSettings,
        sampling: SamplingSettings,
        engine: GenerationEngine,
        tok: Tokenizer,
        tools: ToolPool | None,
    ) -> None:
        self.settings, self.sampling = settings, sampling
        self.engine, self.tok, self.tools = engine, tok, tools
        # Counts, and seconds (the tool queue's wait): floats, so not a Counter.
        self.metrics: defaultdict[str, float] = defaultdict(float)
        self._eos = getattr(tok, "eos_token_id", None)
        self._warned_kwargs = False  # a malformed tools_kwargs is logged once

    def prompt_len(self, task: Task) -> int:
        """Tokens of the episodes' first prompt (the task's messages and the tools' names,
        under the chat template): what ``data.max_prompt_length`` is held to."""
        schemas = self.tools.schemas if self.tools is not None else None
        return len(render(self.tok, list(task.prompt), schemas, gen=True))

    async def episode(self, task: Task, index: int) -> Episode:
        """Run episode ``index`` of ``task`` to its end (see the module docstring)."""
        s = self.settings
        schemas = self.tools.schemas if self.tools is not None else None
        messages = list(task.prompt)
        rendered = render(self.tok, messages, schemas, gen=True)
        prompt = self._first_prompt(task, rendered)
        # The version now, as a split's sample starts: a first turn that times out samples
        # nothing, and its empty sample would date the whole group to version 0 (dropped
        # for lag).
        uncut = None if prompt is rendered else rendered
        first = Piece(prompt_ids=prompt, start_version=self.engine.version, uncut=uncut)
        ep = Episode(pieces=[first], messages=messages, max_response_len=s.max_response_len)
        deadline = Deadline(s.episode_timeout_s, self.engine)
        while True:
            piece = ep.pieces[-1]
            # What the episode has left, not the sample: a split opens no new budget
            # (extend ends the episode before nothing is left).
            budget = s.max_response_len - ep.response_len()
            params = turn_params(self.sampling, task, index, ep.turns, budget)
            rid = f"{task.task_id}/{task.attempt}/{index}/t{ep.turns}"
            try:
                sample = await within(
                    self.engine.generate(piece.prompt_ids + piece.token_ids, params, rid),
                    deadline,
                )
            except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
                ep.ended = "timeout"
                break
            piece.add_sampled(sample)
            ep.turns += 1
            content = self._content(sample.token_ids)
            messages.append({"role": "assistant", "content": content})
            ended = self._after_turn(ep, task, content, sample.finish_reason, schemas, deadline)
            ep.ended = await ended
            if ep.ended:
                break
        if ep.ended in CUT_FINISH:
            ep.pieces[-1].finish_reason = CUT_FINISH[ep.ended]
        self.metrics["rollout/agent/episodes"] += 1
        self.metrics[f"rollout/agent/episodes_ended/{ep.ended}"] += 1
        self.metrics["rollout/agent/turns"] += ep.turns
        self.metrics["rollout/agent/tool_calls"] += ep.tool_calls
        self.metrics["rollout/agent/splits"] += ep.splits
        return ep

    def _first_prompt(self, task: Task, ids: list[int]) -> list[int]:
        """The episode's first prompt within ``data.max_prompt_length``, cut as
        ``data.truncation`` says (a validation prompt with long prompts filtered at the
        left, as single-turn ones); raises PromptTooLong (its line names the fix) with
        ``error``, which fails the task as a single-turn prompt's does."""
        s = self.settings
        if len(ids) <= s.max_prompt_len:
            return ids
        mode = "left" if s.filter_overlong_prompts and task.validation else s.truncation
        out = fit_prompt(ids, s.max_prompt_len, mode)
        if not self.metrics["rollout/agent/prompts_truncated"]:
            log.warning(
                "episode prompt of %d tokens (tool names included) cut to "
                "data.max_prompt_length=%d (data.truncation=%s); raise it, or filter long "
                "prompts",
                len(ids),
                s.max_prompt_len,
                mode,
            )
        self.metrics["rollout/agent/prompts_truncated"] += 1
        return out

    async def _after_turn(
        self,
        ep: Episode,
        task: Task,
        content: str,
        finish: str,
        schemas: list[dict] | None,
        deadline: Deadline,
    ) -> str:
        """Run the turn's tool calls and append their answers; the reason the episode
        ends, or "" to go on. Waiting for the tools ends at the episode's deadline, which
        a weight sync during the wait moves on as it does an engine turn's."""
        s = self.settings
        if finish == "length":
            return "length"
        parsed = parse_tool_calls(content)
        if not parsed.calls and not parsed.errors:
            return "done"
        if (s.max_assistant_turns and ep.turns >= s.max_assistant_turns) or (
            s.max_user_turns and ep.tool_turns >= s.max_user_turns
        ):
            return "max_turns"
        self.metrics["rollout/agent/tool_errors/bad_call"] += len(parsed.errors)
        calls = parsed.calls[: s.max_parallel_calls]
        texts: list[str] = []  # the calls' answers, in call order
        if calls and self.tools is None:
            texts = ["Error: no tools here"] * len(calls)
        elif calls:
            assert self.tools is not None
            kwargs, bad = create_kwargs(task.extra_info.get("tools_kwargs"))
            if bad is not None and not self._warned_kwargs:
                self._warned_kwargs = True  # the data's slip, the same on every deal
                log.warning("task %s: extra_info.tools_kwargs%s: passed over", task.task_id, bad)
            try:
                results = await within(self.tools.call_many_async(calls, kwargs), deadline)
            except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
                return "timeout"
            for r in results:
                if r.error:
                    self.metrics[f"rollout/agent/tool_errors/{r.error}"] += 1
            ep.tool_rewards.extend(r.reward for r in results if r.reward is not None)
            # A step reward that is no number keeps its answer (no r.error): only the pool
            # counts it, for the server's whole life, so its count is reported as it stands.
            if bad := self.tools.counters[BAD_REWARD]:
                self.metrics["rollout/agent/tool_bad_rewards"] = bad
            # Cumulative as the pool keeps it: seconds calls waited for a free worker.
            self.metrics["rollout/agent/tool_queue_wait_s"] = self.tools.queue_wait["total_s"]
            texts = [r.text for r in results]
        ep.tool_calls += len(calls)
        return self._append(ep, in_block_order(parsed, texts), schemas)

    def _append(self, ep: Episode, new: list[dict[str, Any]], schemas: list[dict] | None) -> str:
        """Append the tool answers to the episode (see :func:`extend`); why it ends, or ""."""
        s = self.settings
        try:
            ended = extend(ep, new, self.tok, schemas, s.max_prompt_len, s.max_response_len)
        except Exception as e:  # a template that refuses a tool turn (jinja2, a ValueError)
            if not self.metrics["rollout/agent/episodes_ended/template_error"]:
                log.error(
                    "the chat template cannot render the tool answers (%s: %s): episodes end "
                    "at their first tool call; use a chat template that takes 'tool' messages",
                    type(e).__name__,
                    str(e)[:200],
                )
            return "template_error"
        if ended in ("", "split"):  # the answers joined the episode
            ep.tool_turns += 1
        if ended == "split":
            ep.pieces[-1].start_version = self.engine.version
            return ""
        return ended

    def _content(self, ids: list[int]) -> str:
        """The assistant message's text: the sampled tokens without the end-of-turn token
        (the template adds its own)."""
        if ids and ids[-1] == self._eos:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)


def _mapping(value: Any) -> dict[str, Any] | None:
    """``value`` as a dict: a dict, or a parquet map (read as ``(key, value)`` pairs, sent
    on as lists) with text keys; None when it is neither."""
    if isinstance(value, dict):
        return value
    pairs = isinstance(value, list | tuple) and all(
        isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) for p in value
    )
    return dict(value) if pairs else None


def create_kwargs(tools_kwargs: Any) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Per tool name, the ``create_kwargs`` of a row's ``extra_info.tools_kwargs`` (veRL's
    layout: ``{tool: {"create_kwargs": {...}}}``), and what was passed over as malformed
    (None: nothing). Reading the data refuses such a row
    (:func:`asyncrl.tasks.parquet.row_problem`); one that reaches a server anyway (a task
    from elsewhere) runs its tools without those keywords rather than failing every deal of
    the row at its first call."""
    by_name = _mapping(tools_kwargs)
    if by_name is None:
        bad = (
            None if tools_kwargs is None else f" is a {type(tools_kwargs).__name__}, not a mapping"
        )
        return {}, bad
    out: dict[str, dict[str, Any]] = {}
    bad = None
    for name, entry in by_name.items():
        fields = {} if entry is None else _mapping(entry)  # a struct's unset tool: None
        given = (fields or {}).get("create_kwargs")
        kwargs = {} if given is None else _mapping(given)
        if fields is None:
            bad = f"[{name!r}] is a {type(entry).__name__}, not a mapping"
        elif kwargs is None:
            bad = f"[{name!r}]['create_kwargs'] is a {type(given).__name__}, not a mapping"
        else:
            out[name] = dict(kwargs)
    return out, bad


def episode_trajectories(
    task: Task,
    episodes: list[Episode],
    scores: list[ScoreResult],
    *,
    server_id: str,
    created_at: float,
) -> list[Trajectory]:
    """Wire trajectories of a group of episodes: one per sample, numbered in order
    (``group_size`` is the number of samples); every sample carries its episode's index and
    reward, its loss mask as masked spans (a split's prompt tokens over
    ``data.max_prompt_length`` lead its response, masked: :meth:`Piece.wire`)."""
    common = group_fields(task, server_id=server_id, created_at=created_at)
    pieces = [(i, p.wire(), p) for i, ep in enumerate(episodes) for p in ep.pieces]
    return [
        Trajectory.build(
            prompt_ids=prompt,
            response_ids=response,
            logprobs=logprobs,
            version_spans=spans,
            masked_spans=masked,
            episode=i,
            **scored(scores[i]),
            group_index=j,
            group_size=len(pieces),
            finish_reason=p.finish_reason,
            temperature=p.temperature,
            **common,
        )
        for j, (i, (prompt, response, logprobs, spans, masked), p) in enumerate(pieces)
    ]


def budget_lengths(episodes: list[Episode]) -> list[int]:
    """Per episode, the response length ``data.max_response_length`` bounds (what the
    overlong penalty measures): all its samples together, with the tool answers that opened
    a split's sample; the whole budget for one that ran out of it (:meth:`Episode.budget_len`)."""
    return [ep.budget_len() for ep in episodes]


def episode_samples(episodes: list[Episode]) -> list[Sample]:
    """Each episode as one sample of all its tokens (what a server counts in its metrics):
    its pieces' runs as they went on the wire, each piece a trajectory of its own; counted
    dated down when a piece was, or a later piece ran under a catch-up down."""
    from rollout_servers.samples import Sample, add_span

    out = []
    for ep in episodes:
        runs = [s for p in ep.pieces for s in p.version_spans]
        folded: list[tuple[int, int]] = []
        dated = any(p.dated_down for p in ep.pieces)
        for version, n in runs:
            dated |= add_span(folded, version, n)
        tokens = [t for p in ep.pieces for t in p.token_ids]
        out.append(Sample(token_ids=tokens, version_spans=runs, dated_down=dated))
    return out
