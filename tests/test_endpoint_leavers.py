"""The OpenAI endpoint when an agent or its client goes off the usual path: the real
endpoint served over HTTP on 127.0.0.1 (a character tokenizer and a stand-in engine, no
vLLM).

- A member refused from the group's first request gave the slot back: it may still post
  its reward, which counts toward the group's completion when a mate opens it again.
- A malformed ``<tool_call>`` block is a call too, in its place: the agent's answers match
  the model's calls by position.
- A client that left before its reply was written is counted, not a 500 with a traceback.
- A request whose handler was cancelled (its client left) leaves its turn running: a resend
  joins it, never a second sample.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from rollout_servers.chat_bodies import MALFORMED_CALL, assistant_reply
from rollout_servers.samples import Sample
from rollout_servers.sessions import model_message
from tests.standins.chat import EOT, ReplyEngine
from tests.test_endpoint_clients import GatedEngine
from tests.test_endpoint_faults import USER, Rig, _serve
from tests.test_endpoint_mends import TOO_LONG, AckingClient, _chat, _reward
from tests.test_endpoint_slots import RecordingPusher

STREAM = {"model": "m", "messages": [USER], "stream": True}


def _recording(rig: Rig) -> tuple[AckingClient, RecordingPusher]:
    client, pusher = AckingClient(), RecordingPusher()
    rig.endpoint.groups.client, rig.endpoint.groups.pusher = client, pusher  # type: ignore[assignment]
    return client, pusher


def test_a_member_refused_by_a_group_given_back_still_counts(monkeypatch):
    """g/0's first request opens the group and is refused: the slot goes back at once, and
    g/0's reward is still taken and counts when g/1 opens the group again."""

    async def scenario(rig: Rig) -> None:
        groups, metrics = rig.endpoint.groups, rig.endpoint.metrics
        client, pusher = _recording(rig)
        status, _, body = await _chat(rig, "g/0", [TOO_LONG])
        assert status == 400 and "g" not in groups.by_name, body  # given back
        first = await _reward(rig, "g/0", 0.0)
        assert first[0] == 200 and first[2]["rewarded"] == 1, first
        assert not first[2]["group_complete"]
        for key, reward in (("g/1", 1.0), ("g/2", 0.0)):
            assert (await _chat(rig, key))[0] == 200
            if key == "g/1":  # the group open again, with g/0 in it, ended
                assert await _reward(rig, "g/0", 0.0) == first  # a re-post: its answer
            status, _, body = await _reward(rig, key, reward)
            assert status == 200, body
        assert body["group_complete"] and body["rewarded"] == 3, body
        await asyncio.gather(*groups._pushes)
        (pushed,) = pusher.groups  # the two members with turns, not the refused one
        assert sorted(t.meta.reward for t in pushed) == [0.0, 1.0]
        assert client.acked == [["ext/1"]] and len(client.nacked) == 1  # the give-back
        assert metrics["rollout/openai/sessions_dropped"] == 1  # counted once, not twice
        assert metrics["rollout/openai/groups_unused"] == 1

    _serve(monkeypatch, scenario, ("rollout.n=3", "rollout.openai_endpoint.group_size=3"))


def test_a_group_whose_every_member_was_refused_completes_and_closes(monkeypatch):
    async def scenario(rig: Rig) -> None:
        client, pusher = _recording(rig)
        for key in ("g/0", "g/1"):  # g/1 opens the group again, and is refused too
            assert (await _chat(rig, key, [TOO_LONG]))[0] == 400
            status, _, body = await _reward(rig, key, 0.0)
            assert status == 200, body
        assert body["group_complete"] and body["rewarded"] == 2, body
        await asyncio.gather(*rig.endpoint.groups._pushes)  # the give-backs, sent
        assert len(client.nacked) == 2 and client.acked == [] and pusher.groups == []
        status, _, body = await _chat(rig, "g/2")  # closed: no new group under its name
        assert status == 409 and "every member was refused" in body["error"]["message"], body
        assert rig.endpoint.metrics["rollout/openai/sessions_dropped"] == 2

    _serve(monkeypatch, scenario)


#: A turn whose first block is malformed (no value for ``b``), the second well formed.
MIXED = (
    'Let me compute.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }}\n</tool_call>'
    ' and also <tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
)


class MixedCallsEngine(ReplyEngine):
    """Samples :data:`MIXED` first, then a plain answer."""

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        self.calls += 1
        text = (MIXED if self.calls == 1 else "6") + EOT
        ids = [ord(c) for c in text]
        return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], "stop")


def test_a_malformed_tool_call_keeps_its_place_among_the_calls(monkeypatch):
    """The agent answers each call it is shown, by position: a malformed block dropped from
    ``tool_calls`` put the mul answer where the model's add call was."""

    async def scenario(rig: Rig) -> None:
        rig.endpoint.turns.engine = MixedCallsEngine()  # type: ignore[assignment]
        status, _, body = await _chat(rig, "g/0")
        assert status == 200, body
        message = body["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        assert calls == [("add", '{"name": "add", "arguments": {"a": 1, "b": }}'), ("mul", ANY)]
        assert json.loads(calls[1][1]) == {"a": 2, "b": 3}
        assert message["content"] == "Let me compute. and also "
        answers = [
            {"role": "tool", "content": "Error: bad arguments"},
            {"role": "tool", "content": "6"},
        ]
        status, _, body = await _chat(rig, "g/0", [USER, message, *answers])
        assert status == 200, body
        (piece,) = rig.endpoint.groups.by_name["g"].sessions["g/0"].episode.pieces
        model_read = "".join(map(chr, piece.prompt_ids + piece.token_ids))
        assert f"{MIXED}{EOT}<tool>Error: bad arguments{EOT}<tool>6{EOT}<assistant>" in model_read

    _serve(monkeypatch, scenario)


class _Any:
    def __eq__(self, other: object) -> bool:
        return True


ANY = _Any()


def test_a_malformed_block_is_shown_as_a_call_and_read_back_as_written():
    message, finish = assistant_reply(f"<tool_call>{{oops}}</tool_call>{MIXED}")
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert finish == "tool_calls" and names == [MALFORMED_CALL, "add", "mul"]
    assert message["tool_calls"][0]["function"]["arguments"] == "{oops}"
    back = model_message(message)["content"]  # a rewritten history: as the model wrote it
    assert '<tool_call>\n{oops}\n</tool_call><tool_call>\n{"name": "add"' in back
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }}\n</tool_call>' in back
    # No call at all can be read: the text is the answer.
    for raw in ("<tool_call>{oops}</tool_call>", 'I try <tool_call>{"name": '):
        assert assistant_reply(raw) == ({"role": "assistant", "content": raw}, "stop")
    # Cut off inside a call: still the call it began, in its place.
    message, _ = assistant_reply('<tool_call>{"name": "add", "argu')
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"]


async def _gives_up(rig: Rig, body: dict[str, Any], retry: bool = False) -> int | None:
    """The status of a chat as ``g/0``, or None when the client gave up after 0.5 s."""
    headers = {"Authorization": "Bearer g/0"} | ({"x-stainless-retry-count": "1"} if retry else {})
    timeout = aiohttp.ClientTimeout(total=None if retry else 0.5)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.post(f"{rig.base}/v1/chat/completions", json=body, headers=headers) as r,
        ):
            await r.read()
            return r.status
    except asyncio.TimeoutError:
        return None


def test_a_client_that_left_before_its_streamed_reply_is_counted_not_a_500(monkeypatch, caplog):
    async def scenario(rig: Rig) -> None:
        engine = GatedEngine()
        rig.endpoint.turns.engine = engine  # type: ignore[assignment]
        assert await _gives_up(rig, STREAM) is None
        engine.gate.set()  # the turn ends after its client left
        for _ in range(50):
            await asyncio.sleep(0.05)
            if not rig.endpoint.groups.by_name["g"].sessions["g/0"].busy:
                break
        await asyncio.sleep(0.2)  # the handler writes its reply
        metrics = rig.endpoint.metrics
        assert metrics["rollout/openai/client_left"] == 1, dict(metrics)
        assert metrics["rollout/openai/refused/500"] == 0, dict(metrics)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text

    with caplog.at_level(logging.INFO):
        _serve(monkeypatch, scenario)


def test_a_resend_after_a_cancelled_handler_joins_its_turn(monkeypatch):
    """aiohttp's test server (``handler_cancellation``) cancels the handler of a client that
    left; the turn runs on, and the client's resend must join it, not sample it again."""

    async def scenario(rig: Rig) -> None:
        engine = GatedEngine()
        rig.endpoint.turns.engine = engine  # type: ignore[assignment]
        server = TestServer(rig.endpoint.app(), host="127.0.0.1")
        await server.start_server()
        try:
            cancelling = Rig(rig.endpoint, engine, str(server.make_url("")).rstrip("/"))
            body = {"model": "m", "messages": [USER]}
            assert await _gives_up(cancelling, body) is None
            await asyncio.sleep(0.1)
            resend = asyncio.create_task(_gives_up(cancelling, body, retry=True))
            await asyncio.sleep(0.3)
            engine.gate.set()
            assert await resend == 200
            assert engine.calls == 1 and rig.session().episode.turns == 1
        finally:
            await server.close()

    _serve(monkeypatch, scenario)
