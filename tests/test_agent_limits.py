"""Agent episodes at their limits: a cut first prompt, a history that outgrows the prompt
limit after splits, an episode that a limit cuts short.

An episode whose first prompt ``data.truncation`` cut ended at its first tool call
(``prompt_too_long``): the answer was compared with the uncut rendering, and the split it
fell to held the whole history to the prompt limit. After a split (every tool turn, under a
template that drops past ``<think>`` blocks) the re-rendered history had to fit
``data.max_prompt_length`` alone, though the engine's context is the prompt and response
limits together: episodes ended after two turns with most of their budget unused. An
episode that ran out of budget kept its last turn's ``finish_reason="stop"`` and was
penalised for its length without the answer thrown away (-0.25 where a single-turn
response cut at the limit gets -1.0).

Fast: a character tokenizer, scripted engines, no tools (a call is answered "Error: no
tools here")."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from asyncrl import wire
from asyncrl.config import load_config
from asyncrl.control.messages import Task
from asyncrl.rewards import ScoreResult
from rollout_servers.agent import AgentRunner, AgentSettings, budget_lengths, episode_trajectories
from rollout_servers.episodes import Episode
from rollout_servers.groups import SamplingSettings, shape_overlong
from rollout_servers.samples import Sample
from tests.standins.chat import EOT, CharTokenizer
from tests.standins.server_parts import make_task

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>' + EOT
THINK_AND_CALL = "<think>hm</think>" + CALL
ANSWER = "Error: no tools here"


class DropsThinking(CharTokenizer):
    """Renders past assistant turns without their think block, as Qwen3's template does:
    every tool turn splits."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        shown = [
            {**m, "content": m["content"].split("</think>")[-1]} if m["role"] == "assistant" else m
            for m in conversation
        ]
        return super().apply_chat_template(shown, **kwargs)


class GenPromptDiffers(CharTokenizer):
    """Renders the generation prompt unlike a past assistant turn's header (Qwen3's holds an
    empty think block): every tool turn splits, and a prompt cut at the right lost tokens
    that a history does not render."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        text = super().apply_chat_template(conversation, **kwargs)
        return text + "<think></think>" if kwargs.get("add_generation_prompt") else text


class Scripted:
    """Answers each turn with the next of ``turns`` (the last one from then on), cut at
    ``max_tokens`` as vLLM cuts; records each request's prompt and ``max_tokens``."""

    version, partial = 0, False

    def __init__(self, *turns: str, hang_after: int | None = None) -> None:
        self.turns = list(turns)
        self.hang_after = hang_after
        self.requests: list[tuple[list[int], int]] = []

    def paused_s(self) -> float:
        return 0.0

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Sample:
        if self.hang_after is not None and len(self.requests) >= self.hang_after:
            await asyncio.Event().wait()
        text = self.turns[min(len(self.requests), len(self.turns) - 1)]
        self.requests.append((list(prompt_ids), params.max_tokens))
        ids = [ord(c) for c in text][: params.max_tokens]
        finish = "stop" if len(ids) == len(text) else "length"
        return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], finish)


def _run(
    engine: Any,  # a Scripted engine: enough of GenerationEngine for episodes
    tok: CharTokenizer,
    *,
    prompt_limit: int,
    response_limit: int,
    turns: int = 6,
    truncation: str = "left",
    question: str = "q",
    timeout_s: float = 30.0,
) -> tuple[Episode, Task]:
    sampling = SamplingSettings.from_config(load_config(None, []))
    settings = AgentSettings(
        turns, None, 1, prompt_limit, response_limit, timeout_s, truncation=truncation
    )
    runner = AgentRunner(settings, sampling, engine, tok, None)
    prompt = [{"role": "user", "content": question}]
    task = msgspec.structs.replace(make_task("t"), n=1, agent_name="tool_agent", prompt=prompt)
    return asyncio.run(runner.episode(task, 0)), task


def _wire(task: Task, ep: Episode, prompt_limit: int, response_limit: int) -> list[Any]:
    """The episode's trajectories as the buffer reads them, held to the data limits."""
    group = episode_trajectories(task, [ep], [ScoreResult(1.0)], server_id="s", created_at=0)
    limits = wire.Limits(max_prompt_len=prompt_limit, max_response_len=response_limit)
    return wire.decode_trajectories(wire.encode_trajectories(group), limits)


@pytest.mark.parametrize("truncation", ["left", "right", "middle"])
@pytest.mark.parametrize(
    "tok", [CharTokenizer(), DropsThinking(), GenPromptDiffers()], ids=["keeps", "drops", "gen"]
)
def test_an_episode_whose_prompt_was_cut_goes_on_after_its_tool_calls(
    truncation: str, tok: CharTokenizer
) -> None:
    engine = Scripted(THINK_AND_CALL, THINK_AND_CALL, "3" + EOT)
    ep, task = _run(
        engine, tok, prompt_limit=40, response_limit=500, truncation=truncation, question="x" * 80
    )
    assert ep.ended == "done" and ep.turns == 3 and ep.tool_turns == 2
    assert ep.text(tok).count(ANSWER) == 2  # the answers reached the model
    cut = ep.pieces[0].prompt_ids
    assert len(cut) == 40 and ep.pieces[0].uncut is not None
    # Every request starts as the cut prompt (but for the generation prompt that a right
    # cut took off, which a history does not render): the model reads the same start.
    same = 40 if not isinstance(tok, GenPromptDiffers) else 40 - len("<think></think>")
    assert all(prompt[:same] == cut[:same] for prompt, _ in engine.requests)
    assert ep.splits == (0 if type(tok) is CharTokenizer else 2)
    for t in _wire(task, ep, 40, 500):  # the buffer takes them
        assert t.meta.prompt_len <= 40


@pytest.mark.parametrize("tok", [CharTokenizer(), DropsThinking()], ids=["keeps", "drops"])
def test_a_split_history_may_pass_the_prompt_limit_within_the_engines_context(
    tok: CharTokenizer,
) -> None:
    """Either template: the episode has its turns, every request fits the engine's
    context (prompt and response limits together), and on the wire a split's prompt
    tokens over the prompt limit lead its response, masked, so the buffer takes it."""
    prompt_limit, response_limit = 128, 2000
    engine = Scripted(THINK_AND_CALL)
    ep, task = _run(engine, tok, prompt_limit=prompt_limit, response_limit=response_limit)
    assert ep.ended == "max_turns" and ep.turns == 6
    for prompt, max_tokens in engine.requests:
        assert len(prompt) + max_tokens <= prompt_limit + response_limit
    if isinstance(tok, DropsThinking):
        assert ep.splits == 5 and max(len(p.prompt_ids) for p in ep.pieces) > prompt_limit
    for t, p in zip(_wire(task, ep, prompt_limit, response_limit), ep.pieces, strict=True):
        # The same tokens as the engine saw, the boundary moved; moved ones masked.
        assert list(t.prompt_ids) + list(t.response_ids) == p.prompt_ids + p.token_ids
        assert t.meta.prompt_len == min(len(p.prompt_ids), prompt_limit)
        if p.overflow:
            assert t.meta.masked_spans[0] == (0, p.overflow)
            assert not t.logprobs[: p.overflow].any()
            assert t.meta.version_spans[0][1] >= p.overflow


class GrowsHistory(CharTokenizer):
    """Renders each past assistant turn four times: a re-rendered history outgrows the
    budget it is left with."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        past = len(conversation) - 1 if conversation[-1]["role"] == "assistant" else None
        shown = [
            {**m, "content": m["content"] * 4} if m["role"] == "assistant" and i != past else m
            for i, m in enumerate(conversation)
        ]
        return super().apply_chat_template(shown, **kwargs)


def test_a_split_that_does_not_fit_the_engines_context_ends_the_episode() -> None:
    engine = Scripted(CALL)
    ep, _ = _run(engine, GrowsHistory(), prompt_limit=64, response_limit=300)
    assert ep.ended == "prompt_too_long"
    for prompt, max_tokens in engine.requests:
        assert len(prompt) + max_tokens <= 64 + 300
    assert ep.pieces[-1].finish_reason == "length"
    # Found by a review: cut as one at the response limit is, and penalised alike (it was
    # measured by the tokens it had used, and escaped the overlong penalty).
    assert ep.response_len() < 300 and budget_lengths([ep]) == [300]


def test_an_episode_cut_by_its_budget_is_marked_and_penalised_as_truncated() -> None:
    """The next tool answer does not fit: the episode ends ``length``, and is marked and
    penalised as a single-turn response cut at the limit is."""
    limit = 100
    ep, task = _run(Scripted(CALL), CharTokenizer(), prompt_limit=512, response_limit=limit)
    assert ep.ended == "length" and ep.response_len() < limit
    (t,) = _wire(task, ep, 512, limit)
    assert t.meta.finish_reason == "length"
    assert budget_lengths([ep]) == [limit]
    overlong = ["enable=true", "len=40", "penalty_factor=1.0"]
    cfg = load_config(
        None,
        [f"data.max_response_length={limit}", *(f"reward.overlong_buffer.{o}" for o in overlong)],
    )
    (shaped,) = shape_overlong([ScoreResult(1.0)], [limit], limit, cfg.reward.overlong_buffer)
    assert shaped.parts["overlong_penalty"] == -1.0


def test_a_timed_out_episode_is_marked_aborted_and_a_finished_one_stopped() -> None:
    ep, task = _run(
        Scripted(CALL, hang_after=1),
        CharTokenizer(),
        prompt_limit=512,
        response_limit=500,
        timeout_s=0.3,
    )
    assert ep.ended == "timeout"
    assert [t.meta.finish_reason for t in _wire(task, ep, 512, 500)] == ["abort"]
    assert budget_lengths([ep]) == [ep.response_len()]  # not a length cut
    done, task = _run(
        Scripted(CALL, "3" + EOT), CharTokenizer(), prompt_limit=512, response_limit=500
    )
    assert done.ended == "done"
    assert [t.meta.finish_reason for t in _wire(task, done, 512, 500)] == ["stop"]
