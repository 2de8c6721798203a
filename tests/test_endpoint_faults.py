"""The OpenAI endpoint when a completion does not happen: the real endpoint served over HTTP
on 127.0.0.1, with a character-level stand-in tokenizer and a stand-in engine (no vLLM).

A refused (400) or failed (500) completion must leave the session exactly as it was, so the
agent's retry of the same conversation continues the same sample: no second sample from a
re-rendered prompt, no first sample ending in tokens no turn answered. What the agent got
wrong is a 400 with one line naming the fix (OpenAI clients retry a 500 by themselves).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from asyncrl.config import ConfigError, load_config, run_dir
from asyncrl.control.messages import TaskGrant
from asyncrl.control.task_states import external_task
from rollout_servers import endpoint_turns
from rollout_servers.groups import SamplingSettings
from rollout_servers.openai_api import STOP_S, OpenAIEndpoint
from rollout_servers.sessions import Session
from tests.standins.chat import REPLY, CharTokenizer, ReplyEngine

USER = {"role": "user", "content": "hi"}


class OneSlotClient:
    """Grants slot ``ext/1``; records what the endpoint gives back."""

    def __init__(self) -> None:
        self.nacked: list[tuple[list[str], str]] = []

    def request_slot(self) -> TaskGrant:
        return TaskGrant(tasks=[external_task("ext/1", 0)], policy_version=0)

    def give_back_unanswered_slots(self, older_than_s: float) -> int:
        return 0

    def nack(self, task_ids: list[str], reason: str, dealt: list[int] | None = None) -> None:
        self.nacked.append((task_ids, reason))


class Rig:
    """The endpoint served on 127.0.0.1, and a way to post to it as session ``g/0``."""

    def __init__(self, endpoint: OpenAIEndpoint, engine: ReplyEngine, base: str) -> None:
        self.endpoint, self.engine, self.base = endpoint, engine, base

    async def chat(self, messages: list[Any], **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"model": "m", "messages": messages, **extra}
        headers = {"Authorization": "Bearer g/0"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{self.base}/v1/chat/completions", json=body, headers=headers) as response,
        ):
            return response.status, await response.json()

    async def reward(self, body: Any) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": "Bearer g/0"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{self.base}/rl/reward", json=body, headers=headers) as response,
        ):
            return response.status, await response.json()

    def session(self) -> Session:
        return self.endpoint.groups.by_name["g"].sessions["g/0"]


def _state(s: Session) -> tuple:
    """Everything a turn may change, by value."""
    ep = s.episode
    pieces = [
        (p.prompt_ids, p.token_ids, p.logprobs, p.version_spans, p.masked_spans) for p in ep.pieces
    ]
    return repr(pieces), repr(ep.messages), ep.turns, ep.splits, repr(s.shown), repr(s.tools)


def endpoint_config(*overrides: str) -> Any:
    """The endpoint tests' config: groups of 2, room for long chat prompts."""
    return load_config(
        None,
        [
            "rollout.n=2",
            "rollout.openai_endpoint.group_size=2",
            "data.max_prompt_length=512",
            "data.max_response_length=512",
            *overrides,
        ],
    )


def _serve(
    monkeypatch: pytest.MonkeyPatch,
    scenario: Callable[[Rig], Awaitable[None]],
    overrides: tuple[str, ...] = (),
    cancel_handlers: bool = False,
) -> None:
    """Run ``scenario`` against a fresh endpoint (group size 2) served on 127.0.0.1
    (``cancel_handlers``: a handler is cancelled when its client leaves, as aiohttp's
    ``handler_cancellation`` does)."""
    # Sampling parameters are the engine's business; importing vLLM for them takes seconds.
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)
    cfg = endpoint_config(*overrides)
    engine = ReplyEngine()
    settings = SamplingSettings.from_config(cfg)
    parts = (engine, CharTokenizer(), OneSlotClient(), None, settings)
    endpoint = OpenAIEndpoint(cfg, "r0", *parts)  # type: ignore[arg-type]

    async def main() -> None:
        # Served as the endpoint serves itself (OpenAIEndpoint.start): aiohttp's test server
        # cancels the handler of a client that left, which production never does.
        runner = web.AppRunner(
            endpoint.app(),
            access_log=None,
            shutdown_timeout=STOP_S,
            handler_cancellation=cancel_handlers,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            base = f"http://127.0.0.1:{runner.addresses[0][1]}"
            await scenario(Rig(endpoint, engine, base))
        finally:
            await runner.cleanup()

    asyncio.run(main())


async def _first_turn(rig: Rig) -> list[dict[str, Any]]:
    """One answered turn, and the conversation the agent sends next (a tool's answer)."""
    status, body = await rig.chat([USER])
    assert status == 200, body
    return [USER, body["choices"][0]["message"], {"role": "tool", "content": "42"}]


@pytest.mark.parametrize("fault", ["max_tokens", "engine"])
def test_a_refused_or_failed_turn_leaves_the_session_as_it_was(monkeypatch, fault: str):
    async def scenario(rig: Rig) -> None:
        convo = await _first_turn(rig)
        before = _state(rig.session())
        extra: dict[str, Any] = {"max_tokens": 0} if fault == "max_tokens" else {}
        rig.engine.fail_next = fault == "engine"
        status, body = await rig.chat(convo, **extra)
        assert status == (400 if fault == "max_tokens" else 500), body
        assert _state(rig.session()) == before

        status, body = await rig.chat(convo)  # the agent's retry, corrected
        assert status == 200, body
        ep = rig.session().episode
        assert len(ep.pieces) == 1 and ep.turns == 2
        assert rig.endpoint.metrics["rollout/openai/rewritten"] == 0
        piece = ep.pieces[0]
        ((start, length),) = piece.masked_spans  # the tool answer, inserted once
        text = "".join(map(chr, piece.token_ids))
        assert text == REPLY + text[start : start + length] + REPLY
        assert text.count("<tool>42") == 1

    _serve(monkeypatch, scenario)


def test_client_mistakes_are_400s_that_change_nothing(monkeypatch):
    async def scenario(rig: Rig) -> None:
        status, body = await rig.chat([USER], tools="calculator")
        assert status == 400 and "tools must be a list" in body["error"]["message"]
        status, body = await rig.chat([USER], tools=[{"type": "function", "function": "add"}])
        assert status == 400, body
        convo = await _first_turn(rig)
        before = _state(rig.session())
        bad = {"role": "assistant", "content": "", "tool_calls": 7}
        status, body = await rig.chat([USER, bad, convo[2]])  # a rewritten history, malformed
        assert status == 400 and "tool_calls must be a list" in body["error"]["message"]
        status, body = await rig.chat([USER, {**bad, "tool_calls": ["add"]}, convo[2]])
        assert status == 400, body
        assert _state(rig.session()) == before
        assert rig.endpoint.metrics["rollout/openai/refused/500"] == 0

    _serve(monkeypatch, scenario)


def test_rewards_are_checked_final_and_never_alone_in_a_baseline(monkeypatch):
    """A reward outside the range is refused; a reward is final (a second one, or a chat
    after it, is a 409 that changes nothing); a group closed with one rewarded member of
    two is given back, not trained on that member's raw reward as its advantage."""

    async def scenario(rig: Rig) -> None:
        await _first_turn(rig)
        status, body = await rig.reward({"reward": 5000})
        assert status == 400 and "reward_range [-1, 1]" in body["error"]["message"]
        assert rig.session().reward is None
        status, body = await rig.reward({"reward": 1})
        assert status == 200 and body["rewarded"] == 1, body
        status, body = await rig.reward({"reward": 0.5})
        assert status == 409 and "reward already (1;" in body["error"]["message"]
        status, body = await rig.chat([USER])
        assert status == 409 and "ended with its reward" in body["error"]["message"]
        assert rig.session().reward == 1.0 and rig.engine.calls == 1

        groups = rig.endpoint.groups
        groups.close(groups.by_name["g"], "idle")  # as the reaper closes it: 1 of 2 rewarded
        await asyncio.gather(*groups._pushes)
        client = groups.client
        assert client.nacked == [(["ext/1"], "dropped: 1 of 2 sessions rewarded with turns")]  # type: ignore[attr-defined]
        assert rig.endpoint.metrics["rollout/openai/groups_too_few_rewarded"] == 1
        assert rig.endpoint.metrics["rollout/openai/groups_pushed"] == 0
        # Found by a review: the rewarded session dropped with its group is counted too.
        assert rig.endpoint.metrics["rollout/openai/sessions_dropped"] == 1

    _serve(monkeypatch, scenario, ("rollout.openai_endpoint.reward_range=[-1,1]",))


def test_a_reward_range_upside_down_is_refused():
    with pytest.raises(ConfigError, match=r"reward_range=\[1.0, -1.0\]: its low end is above"):
        load_config(None, ["rollout.openai_endpoint.reward_range=[1,-1]"])


def test_a_refused_first_request_holds_no_slot(monkeypatch):
    """A group whose first request is refused (here: a prompt past data.max_prompt_length)
    gives its slot back at once, not after group_idle_s; a later group gets one."""

    async def scenario(rig: Rig) -> None:
        status, body = await rig.chat([{"role": "user", "content": "x" * 2000}])
        assert status == 400 and "max_prompt_length" in body["error"]["message"], body
        assert body["error"]["code"] == "context_length_exceeded"  # what clients match on
        assert "g" not in rig.endpoint.groups.by_name
        await asyncio.gather(*rig.endpoint.groups._pushes)
        client = rig.endpoint.groups.client
        assert [ids for ids, _ in client.nacked] == [["ext/1"]]  # type: ignore[attr-defined]
        assert rig.endpoint.metrics["rollout/openai/groups_unused"] == 1
        await _first_turn(rig)  # the agent, corrected: a group again
        assert rig.session().episode.turns == 1 and len(client.nacked) == 1  # type: ignore[attr-defined]

    _serve(monkeypatch, scenario)


def test_a_restarted_server_serves_where_its_earlier_life_did(tmp_path, caplog):
    """``port: 0`` takes a free port; a server the launcher restarts after a kill takes the
    port its earlier life served at (the URL file that life left behind names it), so an
    agent's URL, and its client's retries, reach it again. Before, the README's agent kept
    retrying the dead port and stopped, and the run waited for its groups for good. When
    that port is taken, the server serves at a free one and says so."""
    from rollout_servers.openai_http import write_url

    cfg = endpoint_config(
        f"trainer.default_local_dir={tmp_path}", "rollout.openai_endpoint.enable=true"
    )
    settings = SamplingSettings.from_config(cfg)

    def endpoint() -> OpenAIEndpoint:
        parts = (ReplyEngine(), CharTokenizer(), OneSlotClient(), None, settings)
        return OpenAIEndpoint(cfg, "r0", *parts)  # type: ignore[arg-type]

    async def main() -> None:
        first = endpoint()
        url = await first.start()
        url_file = Path(run_dir(cfg)) / "openai_endpoints" / "r0.json"  # what agents read
        assert url_file.is_file()
        await first.stop()  # its port is free again; a kill leaves the file behind:
        write_url(url_file, "r0", url)
        again = endpoint()
        assert await again.start() == url
        await again.stop()

        write_url(url_file, "r0", url)
        with socket.socket() as taken:  # another process took the port meanwhile
            host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
            taken.bind((host, int(port)))
            taken.listen()
            moved = endpoint()
            assert await moved.start() != url
            await moved.stop()
        assert f"port {port}, where it served before its restart, is taken" in caplog.text

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())


def test_an_endpoint_listening_on_every_interface_names_a_reachable_address(tmp_path):
    """A review: with ``rollout.openai_endpoint.host=0.0.0.0`` (the one setting that works
    for servers on several machines) every URL file said ``http://0.0.0.0:PORT/v1``. The URL
    now names the server's address on the route to ``endpoints.host``."""
    from rollout_servers.openai_http import advertised_host

    assert advertised_host("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert advertised_host("10.1.2.3", "127.0.0.1") == "10.1.2.3"  # a bound address names itself
    assert advertised_host("gen-node-3", "127.0.0.1") == "gen-node-3"
    cfg = endpoint_config(
        f"trainer.default_local_dir={tmp_path}",
        "rollout.openai_endpoint.enable=true",
        "rollout.openai_endpoint.host=0.0.0.0",
        "endpoints.insecure=true",
    )
    settings = SamplingSettings.from_config(cfg)
    parts = (ReplyEngine(), CharTokenizer(), OneSlotClient(), None, settings)

    async def main() -> str:
        endpoint = OpenAIEndpoint(cfg, "r0", *parts)  # type: ignore[arg-type]
        url = await endpoint.start()
        try:
            async with aiohttp.ClientSession() as http, http.get(url + "/models") as reply:
                assert reply.status == 200, await reply.text()  # the URL serves
        finally:
            await endpoint.stop()
        return url

    assert asyncio.run(main()).startswith("http://127.0.0.1:")
