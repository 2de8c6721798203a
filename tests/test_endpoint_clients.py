"""The OpenAI endpoint as agent frameworks call it: the real endpoint served over HTTP on
127.0.0.1 (a character tokenizer and a stand-in engine, no vLLM), asked as openai-python,
LangChain, smolagents and shared-client pools ask.

- A client resends a request whose reply did not come in time: the resend must get the
  same turn, never a second sample (the episode would train on a turn the agent never saw).
- A session may be named per request (``X-Session-Id``, or ``session`` in the body: the
  client's ``extra_body``) when one client serves many episodes with one API key.
- What would constrain sampling (a forced tool call, a JSON format) is refused: the
  learner's logprobs must be the behaviour's.
- An assistant message the model did not sample (a prefill, a handoff) starts a new sample
  rather than being refused; OpenAI's ``developer`` role is a system message.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from rollout_servers.samples import Sample
from tests.standins.chat import EOT, ReplyEngine
from tests.test_endpoint_faults import USER, Rig, _serve


async def _post(
    rig: Rig, body: dict[str, Any], headers: dict[str, str] | None = None, path: str = "chat"
) -> tuple[int, dict[str, Any]]:
    url = f"{rig.base}/v1/chat/completions" if path == "chat" else f"{rig.base}{path}"
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, json=body, headers=headers or {"Authorization": "Bearer g/0"}) as r,
    ):
        return r.status, await r.json()


def _chat(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, **extra}


class GatedEngine(ReplyEngine):
    """Answers once :attr:`gate` is set: a turn that outlasts the client's timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        await self.gate.wait()
        return await super().generate(prompt_ids, params, request_id)


def test_a_resent_request_gets_the_same_turn_not_a_second_sample(monkeypatch):
    async def scenario(rig: Rig) -> None:
        engine = GatedEngine()
        rig.endpoint.turns.engine = engine  # type: ignore[assignment]
        # The client gives up on the first request and sends it again while it runs.
        first = asyncio.create_task(_post(rig, _chat([USER])))
        await asyncio.sleep(0.2)
        retry = {"Authorization": "Bearer g/0", "x-stainless-retry-count": "1"}
        second = asyncio.create_task(_post(rig, _chat([USER]), retry))
        await asyncio.sleep(0.2)
        # A different request to the busy session is still a retryable 409.
        status, body = await _post(rig, _chat([USER, USER]))
        assert status == 409 and "running already" in body["error"]["message"], body
        engine.gate.set()
        (s1, b1), (s2, b2) = await asyncio.gather(first, second)
        assert s1 == s2 == 200 and b1 == b2, (b1, b2)
        # Sent once more after the reply, marked as a retry: the same reply again.
        assert await _post(rig, _chat([USER]), retry) == (200, b1)
        ep = rig.session().episode
        assert engine.calls == 1 and ep.turns == 1 and len(ep.pieces) == 1
        metrics = rig.endpoint.metrics
        assert metrics["rollout/openai/retries_joined"] == 1
        assert metrics["rollout/openai/retries_replayed"] == 1
        assert metrics["rollout/openai/rewritten"] == 0
        # Not marked as a retry, the same messages ask for a new sample (a re-ask).
        status, _ = await _post(rig, _chat([USER]))
        assert status == 200 and engine.calls == 2
        assert len(rig.session().episode.pieces) == 2

    _serve(monkeypatch, scenario)


def test_a_session_is_named_by_header_or_body_before_the_api_key(monkeypatch):
    async def scenario(rig: Rig) -> None:
        shared = {"Authorization": "Bearer EMPTY"}  # one client, one key, many episodes
        assert (await _post(rig, _chat([USER], session="g/0"), shared))[0] == 200
        assert (await _post(rig, _chat([USER]), {**shared, "X-Session-Id": "g/1"}))[0] == 200
        sessions = rig.endpoint.groups.by_name["g"].sessions
        assert sorted(sessions) == ["g/0", "g/1"] and "EMPTY" not in rig.endpoint.groups.by_name
        status, body = await _post(rig, {"reward": 1.0, "session": "g/1"}, shared, "/rl/reward")
        assert status == 200 and body["session"] == "g/1", body

    _serve(monkeypatch, scenario)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tool_choice": "required"}, 'tool_choice="required" is not supported'),
        (
            {"tool_choice": {"type": "function", "function": {"name": "add"}}},
            "a forced call constrains sampling",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format 'json_object'"),
    ],
)
def test_what_would_constrain_sampling_is_refused(monkeypatch, extra, says):
    async def scenario(rig: Rig) -> None:
        status, body = await _post(rig, _chat([USER], **extra))
        assert status == 400 and says in body["error"]["message"], body
        assert rig.engine.calls == 0
        fine = {"tool_choice": "auto", "response_format": {"type": "text"}}
        assert (await _post(rig, _chat([USER], **fine)))[0] == 200

    _serve(monkeypatch, scenario)


def test_an_added_assistant_message_starts_a_new_sample_and_developer_is_system(monkeypatch):
    async def scenario(rig: Rig) -> None:
        status, body = await _post(rig, _chat([{"role": "developer", "content": "be brief"}, USER]))
        assert status == 200, body
        shown = body["choices"][0]["message"]
        assert rig.session().episode.messages[0]["role"] == "system"
        handoff = {"role": "assistant", "content": "Calling tools: add"}
        convo = [{"role": "developer", "content": "be brief"}, USER, shown, handoff, USER]
        status, body = await _post(rig, _chat(convo))
        assert status == 200, body
        assert len(rig.session().episode.pieces) == 2
        assert rig.endpoint.metrics["rollout/openai/rewritten"] == 1

    _serve(monkeypatch, scenario)


def test_a_body_over_the_limit_is_a_413_not_a_retried_500(monkeypatch):
    async def scenario(rig: Rig) -> None:
        big = [{"role": "user", "content": "x" * (5 << 20)}]
        status, body = await _post(rig, _chat(big))
        assert status == 413 and "MiB" in body["error"]["message"], body
        assert rig.endpoint.metrics["rollout/openai/refused/500"] == 0

    _serve(monkeypatch, scenario)


class ReActEngine(ReplyEngine):
    """Writes past its action into an observation it made up, as a model asked with stop
    sequences does when they are ignored."""

    TEXT = "Thought: add\nCode: 1+1<end_code>\nObservation: 3"

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        self.calls += 1
        ids = [ord(c) for c in self.TEXT]
        return Sample(ids, [-0.5] * len(ids), [(0, 30), (1, len(ids) - 30)], "length")


def test_stop_sequences_end_the_turn_at_the_first_one(monkeypatch):
    """smolagents and ReAct agents send ``stop``: the turn keeps the tokens up to the one
    that completes the first stop string, with their logprobs and versions; the agent is
    shown the text before it; the next request continues the same sample."""

    async def scenario(rig: Rig) -> None:
        rig.endpoint.turns.engine = ReActEngine()  # type: ignore[assignment]
        stops = {"stop": ["Observation:", "<end_code>"]}
        status, body = await _post(rig, _chat([USER], **stops))
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["message"]["content"] == "Thought: add\nCode: 1+1"
        assert choice["finish_reason"] == "stop"
        piece = rig.session().episode.pieces[0]
        kept = "Thought: add\nCode: 1+1<end_code>"
        assert "".join(map(chr, piece.token_ids)) == kept
        assert piece.logprobs == [-0.5] * len(kept)
        assert piece.version_spans == [(0, 30), (1, len(kept) - 30)]
        assert body["usage"]["completion_tokens"] == len(kept)
        observed = [USER, choice["message"], {"role": "user", "content": "Observation: 2"}]
        status, body = await _post(rig, _chat(observed, stop="Observation:"))
        assert status == 200 and len(rig.session().episode.pieces) == 1, body
        assert rig.endpoint.metrics["rollout/openai/stopped"] == 2
        status, body = await _post(rig, _chat(observed, stop=[""]))
        assert status == 400 and "stop must be" in body["error"]["message"], body

    _serve(monkeypatch, scenario)


def test_a_streaming_client_gets_the_turn_as_chunks(monkeypatch):
    """LangGraph's message streaming and the Agents SDK's streamed runs ask with
    ``stream=true``: openai-python reads the turn as chunks, the usage last when asked."""
    import openai

    async def scenario(rig: Rig) -> None:
        client = openai.AsyncOpenAI(base_url=f"{rig.base}/v1", api_key="g/0", max_retries=0)
        stream = await client.chat.completions.create(
            model="m",
            messages=[USER],  # type: ignore[list-item]
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        await client.close()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == body_text(rig)
        assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "stop"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        assert rig.session().episode.turns == 1

    _serve(monkeypatch, scenario)


def body_text(rig: Rig) -> str:
    """What the session was shown as its last assistant message."""
    return rig.session().shown[-1]["content"]


def test_streamed_tool_calls_carry_their_index():
    from rollout_servers.chat_bodies import completion_body, completion_chunks

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    body = completion_body(message, "tool_calls", "m", 3, 4)
    first, last = completion_chunks(body, usage=False)
    assert first["choices"][0]["delta"]["tool_calls"] == [{"index": 0, **call}]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["id"] == body["id"] for c in (first, last))


def test_logprobs_are_the_behaviour_logprobs_the_turn_trains_with(monkeypatch):
    async def scenario(rig: Rig) -> None:
        status, body = await _post(rig, _chat([USER], logprobs=True))
        assert status == 200, body
        content = body["choices"][0]["logprobs"]["content"]
        piece = rig.session().episode.pieces[0]
        assert [c["logprob"] for c in content] == piece.logprobs
        assert "".join(c["token"] for c in content) == "".join(map(chr, piece.token_ids))
        assert all(c["top_logprobs"] == [] for c in content)
        status, body = await _post(rig, {"reward": 1.0}, path="/rl/reward")
        assert status == 200, body
        status, body = await _post(
            rig, _chat([USER], logprobs=True, top_logprobs=5), {"Authorization": "Bearer g/1"}
        )
        assert status == 400 and "top_logprobs=5 is not supported" in body["error"]["message"]

    _serve(monkeypatch, scenario)


def test_new_tool_schemas_start_a_sample_that_shows_them(monkeypatch):
    """A planning call without tools, then calls with them: the model must read the
    schemas the agent sent, so the first request with new tools starts a new sample
    rendered with them; the next request with the same tools continues it."""
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

    async def scenario(rig: Rig) -> None:
        status, body = await _post(rig, _chat([USER]))
        assert status == 200 and rig.session().tools is None
        convo = [USER, body["choices"][0]["message"], {"role": "user", "content": "now add"}]
        status, body = await _post(rig, _chat(convo, tools=[add]))
        assert status == 200, body
        session = rig.session()
        assert session.tools == [add] and len(session.episode.pieces) == 2
        assert "".join(map(chr, session.episode.pieces[1].prompt_ids)).startswith("[add]")
        convo += [body["choices"][0]["message"], {"role": "tool", "content": "4"}]
        status, body = await _post(rig, _chat(convo, tools=[add]))
        assert status == 200 and len(rig.session().episode.pieces) == 2, body
        assert rig.endpoint.metrics["rollout/openai/rewritten"] == 1

    _serve(monkeypatch, scenario)


class ToolCallEngine(ReplyEngine):
    """Samples a hermes tool call, as a tool-using model does."""

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        self.calls += 1
        text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        ids = [ord(c) for c in text]
        return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], "stop")


def test_tool_choice_none_gets_text_and_parallel_calls_off_is_refused(monkeypatch):
    """LangChain's bind_tools(tool_choice="none") and the Agents SDK's ModelSettings ask for
    no tool calls: the sampled text comes back as content (sampling is unchanged). One call
    per turn (parallel_tool_calls=false) would constrain sampling: a 400 naming why, not
    ignored."""

    async def scenario(rig: Rig) -> None:
        rig.endpoint.turns.engine = ToolCallEngine()  # type: ignore[assignment]
        status, body = await _post(rig, _chat([USER], tool_choice="none"))
        choice = body["choices"][0]
        assert status == 200 and choice["finish_reason"] == "stop", body
        assert "tool_calls" not in choice["message"]
        assert choice["message"]["content"].startswith("<tool_call>")
        status, body = await _post(
            rig, _chat([USER], parallel_tool_calls=False), {"Authorization": "Bearer g/1"}
        )
        assert status == 400 and "parallel_tool_calls=false" in body["error"]["message"]
        status, body = await _post(rig, _chat([USER]), {"Authorization": "Bearer g/1"})
        assert status == 200 and body["choices"][0]["finish_reason"] == "tool_calls", body

    _serve(monkeypatch, scenario)


def test_the_end_of_a_sessions_room_reads_as_the_context_window(monkeypatch):
    """LiteLLM (and so SWE-agent, mini-swe-agent) maps an error to ContextWindowExceeded
    by its text, openai-python users by its code; anything else is retried for minutes.
    Every way a session runs out of room says both."""

    async def scenario(rig: Rig) -> None:
        long = {"role": "user", "content": "x" * 80}
        status, body = await _post(rig, _chat([long]))
        first = body["error"]
        status2, body = await _post(rig, _chat([USER]), {"Authorization": "Bearer g/1"})
        assert status2 == 200, body
        more = [USER, body["choices"][0]["message"], long]
        status3, body = await _post(rig, _chat(more), {"Authorization": "Bearer g/1"})
        for code, error in ((status, first), (status3, body["error"])):
            assert code == 400 and error["code"] == "context_length_exceeded", error
            assert error["message"].lower().startswith("this model's maximum context length is")

    _serve(monkeypatch, scenario, ("data.max_prompt_length=64", "data.max_response_length=16"))


def test_a_sessions_samples_share_one_response_budget(monkeypatch):
    """``max_tokens`` is within ``data.max_response_length`` for the whole session, as the
    server's own agent episodes are: a request that rewrites the conversation (a new
    sample, whose messages added after the model's last turn count) and a raw completion
    get what the session has left, not the limit anew; each sample had a budget of its
    own, so a session could sample many times the limit."""

    async def scenario(rig: Rig) -> None:
        turns, asked = rig.endpoint.turns, []
        sample = turns._sample

        async def recorded(session: Any, draft: Any, budget: int, stops: Any) -> Any:
            asked.append(budget)  # the engine's max_tokens for the turn
            return await sample(session, draft, budget, stops)

        monkeypatch.setattr(turns, "_sample", recorded)
        assert (await _post(rig, _chat([USER])))[0] == 200  # answers "ok" + end: 3 tokens
        other = {"role": "user", "content": "something else"}
        assert (await _post(rig, _chat([other])))[0] == 200  # rewritten: a new sample
        # Rewritten again (its first message changed), with the model's turn and what the
        # agent added after it: the added turn is the session's response too, as it is
        # when appended.
        changed = {"role": "user", "content": "something new"}
        said = {"role": "assistant", "content": "ok"}
        added = {"role": "user", "content": "more"}
        assert (await _post(rig, _chat([changed, said, added])))[0] == 200
        lead = len("<user>more" + EOT + "<assistant>")  # as the character template renders
        raw = {"model": "m", "prompt": "go on", "max_tokens": 64}
        assert (await _post(rig, raw, path="/v1/completions"))[0] == 200
        assert asked == [64, 61, 58 - lead, 55 - lead]
        pieces = rig.session().episode.pieces
        assert len(pieces) == 4 and [p.lead for p in pieces] == [0, 0, lead, 0]

    _serve(monkeypatch, scenario, ("data.max_response_length=64",))


def test_the_model_card_has_what_typed_clients_read(monkeypatch):
    async def scenario(rig: Rig) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{rig.base}/v1/models") as r:
                (card,) = (await r.json())["data"]
            async with http.get(f"{rig.base}/v1/models/{card['id']}") as r:
                assert r.status == 200 and await r.json() == card
            async with http.get(f"{rig.base}/v1/models/other") as r:
                assert (
                    r.status == 404 and "is not served here" in (await r.json())["error"]["message"]
                )
        assert card["object"] == "model" and isinstance(card["created"], int)
        assert card["owned_by"] == "asyncrl"

    _serve(monkeypatch, scenario)


def test_stopping_the_endpoint_cuts_a_turn_still_running(monkeypatch, tmp_path):
    """The run ends while an agent's turn is still generating: the endpoint's stop waits
    ``STOP_S`` for it, then cancels it, so the server's leave (sent after the stop) reaches
    the coordinator; aiohttp's default 60 s outlasted every grace and the server was killed
    at the end of a run with its leave unsent (a walkthrough's hang)."""
    import time

    from rollout_servers import endpoint_turns
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.openai_api import STOP_S, OpenAIEndpoint
    from tests.standins.chat import CharTokenizer
    from tests.test_endpoint_faults import OneSlotClient, endpoint_config

    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)
    cfg = endpoint_config("rollout.openai_endpoint.port=0", f"trainer.default_local_dir={tmp_path}")
    engine = GatedEngine()  # never opened: the turn runs until the stop cuts it
    parts = (engine, CharTokenizer(), OneSlotClient(), None, SamplingSettings.from_config(cfg))
    endpoint = OpenAIEndpoint(cfg, "r0", *parts)  # type: ignore[arg-type]

    async def main() -> None:
        url = await endpoint.start()
        rig = Rig(endpoint, engine, url.removesuffix("/v1"))
        turn = asyncio.create_task(_post(rig, _chat([USER])))
        await asyncio.sleep(0.5)
        assert not turn.done()
        began = time.monotonic()
        await endpoint.stop()
        assert time.monotonic() - began < 2 * STOP_S + 1.5  # a wait, then one for the cancel
        with pytest.raises(aiohttp.ClientError):  # the connection closed, no reply
            await asyncio.wait_for(turn, 5)

    asyncio.run(main())
