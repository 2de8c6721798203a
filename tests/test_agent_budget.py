"""An agent episode's response budget and deadline, as veRL's agent loop holds them.

``data.max_response_length`` bounds an episode as a whole: an episode whose chat template
rewrites history (Qwen3's, which drops past ``<think>`` blocks) splits into several samples,
and each sample got the whole limit anew, so the episode generated several times the limit,
and the overlong penalty measured its longest sample only. Its scored text lacked the tool
answers at the splits, which the same episode under a template that keeps history has.
An episode whose turn was frozen by a weight sync ended as ``timeout`` when the time paused
took it past ``episode_timeout_s``, and trained as the model's fault.

Fast: a character tokenizer, engines that answer at once, no tools (a call is answered
"Error: no tools here")."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from asyncrl.config import load_config
from asyncrl.control.messages import Task
from asyncrl.rewards import ScoreJob, ScoreResult
from rollout_servers import task_groups
from rollout_servers.agent import AgentRunner, AgentSettings
from rollout_servers.episodes import Episode
from rollout_servers.groups import SamplingSettings
from rollout_servers.lanes import Lanes
from rollout_servers.samples import Sample
from rollout_servers.server_stats import ServerStats
from tests.standins.chat import EOT, CharTokenizer
from tests.standins.server_parts import make_task

TURN = '<think>hm</think><tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>' + EOT
ANSWER = "Error: no tools here"
LIMIT = 300  # about three turns with their answers
PAUSE = "rollout/sync_pause_s"


class DropsThinking(CharTokenizer):
    """Renders past assistant turns without their think block, as Qwen3's template does:
    the sampled tokens are no prefix of the history, so every tool turn splits."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        shown = [
            {**m, "content": m["content"].split("</think>")[-1]} if m["role"] == "assistant" else m
            for m in conversation
        ]
        return super().apply_chat_template(shown, **kwargs)


class ThinkAndCall:
    """Every turn thinks, then calls a tool; cut at ``max_tokens`` as vLLM cuts. Records
    each turn's ``max_tokens``."""

    version, partial = 0, False

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {PAUSE: 0.0}
        self.max_tokens: list[int] = []

    def paused_s(self) -> float:
        return self.metrics[PAUSE]

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Sample:
        self.max_tokens.append(params.max_tokens)
        ids = [ord(c) for c in TURN][: params.max_tokens]
        finish = "stop" if len(ids) == len(TURN) else "length"
        return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], finish)


def _runner(engine: Any, tok: CharTokenizer, turns: int, limit: int, timeout_s: float = 30.0):
    sampling = SamplingSettings.from_config(load_config(None, []))
    settings = AgentSettings(turns, None, 1, 4096, limit, timeout_s)
    return AgentRunner(settings, sampling, engine, tok, None)


def _task() -> Task:
    return msgspec.structs.replace(make_task("t"), n=1, agent_name="tool_agent")


def _episode(tok: CharTokenizer, turns: int, limit: int) -> tuple[Episode, ThinkAndCall]:
    engine = ThinkAndCall()
    return asyncio.run(_runner(engine, tok, turns, limit).episode(_task(), 0)), engine


def test_an_episode_that_splits_has_one_response_budget_not_one_per_sample() -> None:
    split, split_engine = _episode(DropsThinking(), turns=8, limit=LIMIT)
    whole, whole_engine = _episode(CharTokenizer(), turns=8, limit=LIMIT)
    assert split.splits >= 2 and not whole.splits  # the setting: one splits, one does not
    # All its samples together stay within the limit, and it ends where the episode
    # that keeps one sample ends, each turn allowed what the episode has left.
    assert sum(len(p.token_ids) for p in split.pieces) <= LIMIT
    assert split.response_len() <= LIMIT
    assert split.ended == whole.ended == "length"
    assert split.turns == whole.turns
    assert split_engine.max_tokens == whole_engine.max_tokens
    assert split_engine.max_tokens[0] == LIMIT and split_engine.max_tokens[-1] < len(TURN)


def test_the_scored_text_of_an_episode_that_split_has_its_tool_answers() -> None:
    tok = CharTokenizer()
    split, _ = _episode(DropsThinking(), turns=3, limit=4096)
    whole, _ = _episode(tok, turns=3, limit=4096)
    assert split.splits == whole.tool_turns == 2 and split.ended == "max_turns"
    assert split.text(tok).count(ANSWER) == 2
    assert split.text(tok) == whole.text(tok)  # the episode as the model saw it, either way


def test_a_group_is_scored_and_penalised_on_its_whole_episodes() -> None:
    """Through :class:`task_groups.TaskGroups`: the reward function reads the tool answers
    of a split, and the overlong penalty measures the episode, not its longest sample."""
    jobs: list[ScoreJob] = []

    class Recorder:
        def score_many(self, items: list[ScoreJob]) -> list[ScoreResult]:
            jobs.extend(items)
            return [ScoreResult(1.0) for _ in items]

    overlong = ["enable=true", "len=100", "penalty_factor=1.0"]
    overlong = [f"reward.overlong_buffer.{kv}" for kv in overlong]
    cfg = load_config(None, [f"data.max_response_length={LIMIT}", *overlong])
    tok, engine = DropsThinking(), ThinkAndCall()
    agent = _runner(engine, tok, turns=8, limit=LIMIT)
    sampling = SamplingSettings.from_config(cfg)
    groups = task_groups.TaskGroups(
        cfg, "s", engine, tok, Recorder(), Lanes(), sampling, ServerStats(tok), agent
    )
    group, _, scores = asyncio.run(groups.make(_task(), 0.0))
    assert len(group) >= 3  # one episode in several samples
    assert jobs[0].solution_str.count(ANSWER) >= 2
    # The episode used its whole budget: the full penalty, as for a response cut at the limit.
    assert scores[0].parts["overlong_penalty"] < -0.9


class FrozenBySync:
    """A turn frozen by a weight sync for ``pause_s`` (the engine counts the pause when it
    resumes generation), then sampling for ``after_s`` more (forever: None)."""

    version, partial = 0, False

    def __init__(self, pause_s: float, after_s: float | None, paused_before: float) -> None:
        self.metrics: dict[str, float] = {PAUSE: paused_before}
        self.pause_s, self.after_s = pause_s, after_s

    def paused_s(self) -> float:  # counted once the pause ends, as an ended sync's
        return self.metrics[PAUSE]

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Sample:
        await asyncio.sleep(self.pause_s)
        self.metrics[PAUSE] += self.pause_s
        if self.after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after_s or 0.0)
        ids = [ord(c) for c in "42" + EOT]
        return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], "stop")


def _timed_episode(engine: FrozenBySync, timeout_s: float) -> tuple[Episode, float]:
    runner = _runner(engine, CharTokenizer(), turns=2, limit=64, timeout_s=timeout_s)

    async def run() -> Episode:  # bounded: a deadline moved on by old pauses never ends
        return await asyncio.wait_for(runner.episode(_task(), 0), 10.0)

    started = time.monotonic()
    ep = asyncio.run(run())
    return ep, time.monotonic() - started


def test_time_paused_for_a_sync_does_not_count_against_the_episode_deadline() -> None:
    # 1.3 s from the start, of which 0.6 s paused: 0.7 s of the episode's 1.0 s.
    ep, took = _timed_episode(FrozenBySync(0.6, 0.7, paused_before=0.0), timeout_s=1.0)
    assert ep.ended == "done" and ep.turns == 1
    assert took > 1.2


def test_the_deadline_moves_on_by_the_episodes_own_pauses_only() -> None:
    """A turn that never ends still times out: 0.4 s paused moves the 0.6 s deadline to
    1.0 s; the 100 s paused before the episode started are not its."""
    ep, took = _timed_episode(FrozenBySync(0.4, None, paused_before=100.0), timeout_s=0.6)
    assert ep.ended == "timeout"
    assert 0.95 < took < 5.0


class DropsThinkingBeforeAUser(CharTokenizer):
    """Qwen3's way: an assistant turn keeps its think block until a user turn follows it,
    so appending a user turn re-renders the history before it."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        last_user = max((i for i, m in enumerate(conversation) if m["role"] == "user"), default=-1)
        shown = [
            {**m, "content": m["content"].split("</think>")[-1]}
            if m["role"] == "assistant" and i < last_user
            else m
            for i, m in enumerate(conversation)
        ]
        return super().apply_chat_template(shown, **kwargs)


def test_a_split_that_rewrites_the_history_counts_the_new_messages_only() -> None:
    """The new sample's prompt differs from the history from the rewritten assistant turn
    on; only the new user turn (and the generation prompt) is the episode's response, not
    the assistant turn rendered again, which its first sample holds already."""
    from rollout_servers.episode_tokens import extend
    from rollout_servers.episodes import Piece

    tok = DropsThinkingBeforeAUser()
    said = "<think>long thoughts</think>an answer" + EOT
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": said}]
    prompt = tok.encode(tok.apply_chat_template(messages[:1]))
    first = Piece(prompt_ids=prompt, token_ids=tok.encode(said), logprobs=[0.0] * len(said))
    ep = Episode(pieces=[first], messages=messages)
    new = [{"role": "user", "content": "and then?"}]
    assert extend(ep, new, tok, None, 4096, 4096) == "split"
    added = "<user>and then?" + EOT + "<assistant>"
    assert ep.pieces[-1].lead == len(added)
    assert ep.response_len() == len(said) + len(added)
    assert ep.text(tok) == said + added  # the assistant turn once


def test_what_an_agent_added_to_a_rewritten_conversation_starts_after_the_models_turn() -> None:
    """The endpoint's rewritten conversations: the messages after the model's last turn
    are the session's response (counted once), a prefill after a tool answer included;
    a history trimmed before that turn does not count its kept turns again, and a resent
    older history adds nothing."""
    from types import SimpleNamespace

    from rollout_servers.sessions import first_new

    def msg(role: str, content: str) -> dict[str, str]:
        return {"role": role, "content": content}

    shown = [msg("user", "q"), msg("assistant", "a1"), msg("tool", "t1"), msg("assistant", "a2")]
    session = SimpleNamespace(shown=shown)
    trimmed = [msg("user", "q"), msg("assistant", "a2"), msg("tool", "t2")]
    assert first_new(session, trimmed) == 2  # t2 only
    prefilled = [*shown, msg("tool", "t2"), msg("assistant", "a prefill")]
    assert first_new(session, prefilled) == 4  # t2 and the prefill
    resent = shown[:3]  # the model's last turn dropped: t1 was counted already
    assert first_new(session, resent) == 3


class NoToolTurnAlone(CharTokenizer):
    """Qwen3.5's template refuses a conversation without a user query (tool answers
    rendered alone)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        if not any(m["role"] == "user" for m in conversation):
            raise ValueError("No user query found in messages.")
        return super().apply_chat_template(conversation, **kwargs)


def test_added_messages_are_measured_when_the_template_refuses_them_alone() -> None:
    from rollout_servers.episode_tokens import added_len

    tok = NoToolTurnAlone()
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "x" * 500},
    ]
    prompt = tok.encode(tok.apply_chat_template(history))
    assert added_len(tok, prompt, history, 2, None) == len(
        "<tool>" + "x" * 500 + EOT + "<assistant>"
    )
