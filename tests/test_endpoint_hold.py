"""A new group's request held while no training slot is free
(``rollout.openai_endpoint.slot_wait_s``), with what may happen during the hold: the group
is abandoned, the server stops, the client leaves, a resend joins it, several groups are
granted at once under ``max_groups``, the opening request is cancelled. The real endpoint
served on 127.0.0.1 (a character tokenizer and a stand-in engine); a stand-in coordinator
client refuses slots until the test opens the budget. The hold against a real coordinator
is in ``test_endpoint_slots.py``."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp.test_utils import TestServer

from asyncrl.config import load_config
from asyncrl.control.messages import TaskGrant
from asyncrl.control.task_states import external_task
from rollout_servers import endpoint_turns
from rollout_servers.groups import SamplingSettings
from rollout_servers.openai_api import OpenAIEndpoint
from tests.standins.chat import CharTokenizer, ReplyEngine
from tests.test_endpoint_slots import USER, RecordingPusher


class BudgetClient:
    """A coordinator client whose budget is full until :attr:`free`; then it grants
    ``ext/<k>`` slots. Each call takes :attr:`delay` seconds (in the endpoint's thread)."""

    def __init__(self) -> None:
        self.free = False
        self.delay = 0.0
        self.asked = 0
        self.granted: list[str] = []
        self.nacked: list[str] = []
        self._ids = itertools.count(1)

    def request_slot(self) -> TaskGrant:
        self.asked += 1
        time.sleep(self.delay)
        if not self.free:
            return TaskGrant(tasks=[], policy_version=0, reason="budget", detail="all charged")
        task_id = f"ext/s/{next(self._ids)}"
        self.granted.append(task_id)
        return TaskGrant(tasks=[external_task(task_id, 0)], policy_version=0)

    def nack(self, task_ids: list[str], reason: str, dealt: list[int] | None = None) -> None:
        self.nacked += task_ids

    def give_back_unanswered_slots(self, older_than_s: float) -> int:
        return 0  # every request here is answered


Scenario = Callable[[OpenAIEndpoint, BudgetClient, str], Awaitable[None]]


def _hold(monkeypatch, scenario: Scenario, *overrides: str, cancelling: bool = False) -> None:
    """Run ``scenario(endpoint, client, base URL)`` against an endpoint that holds a
    request up to 6 s; ``cancelling``: served by aiohttp's test server, which cancels a
    handler whose client left (the endpoint's own server lets it run)."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            "rollout.openai_endpoint.host=127.0.0.1",
            "rollout.openai_endpoint.slot_wait_s=6",
            "rollout.openai_endpoint.group_idle_s=600",
            *overrides,
        ],
    )
    client = BudgetClient()
    parts = (ReplyEngine(), CharTokenizer(), client, RecordingPusher())
    endpoint = OpenAIEndpoint(cfg, "r0", *parts, SamplingSettings.from_config(cfg))  # type: ignore[arg-type]

    async def main() -> None:
        if cancelling:
            server = TestServer(endpoint.app(), host="127.0.0.1")
            await server.start_server()
            base = str(server.make_url("")).rstrip("/")
        else:
            base = (await endpoint.start()).removesuffix("/v1")
        try:
            await scenario(endpoint, client, base)
        finally:
            await (server.close() if cancelling else endpoint.stop())

    asyncio.run(main())


async def _chat(base: str, key: str, timeout: float = 30, retry: bool = False) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"}
    if retry:
        headers["x-stainless-retry-count"] = "1"
    body = {"model": "m", "messages": USER}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http,
        http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


async def _gave_up(base: str, key: str) -> None:
    """A client that gives up on its request after 0.5 s."""
    try:
        await _chat(base, key, timeout=0.5)
    except asyncio.TimeoutError:
        return
    raise AssertionError("the request was answered during the hold")


def test_a_group_abandoned_while_it_waits_takes_no_slot(monkeypatch):
    async def scenario(endpoint: OpenAIEndpoint, client: BudgetClient, base: str) -> None:
        held = asyncio.create_task(_chat(base, "g/0"))
        await asyncio.sleep(0.5)
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{base}/rl/abandon", json={"group": "g"}) as r,
        ):
            assert r.status == 200 and (await r.json())["abandoned"]
        client.free = True
        status, body = await held
        assert status == 409 and "abandoned while it waited" in body["error"]["message"]
        assert client.granted == [] and not endpoint.groups.by_name
        # A member coming later is refused as a closed group's: it opened the group again
        # on a slot of its own, and its rewarded members trained (review).
        status, body = await _chat(base, "g/1")
        assert status == 409 and "abandoned by its agent" in body["error"]["message"], body
        assert client.granted == [] and not endpoint.groups.by_name

    _hold(monkeypatch, scenario)


def test_a_stopping_server_answers_its_held_requests_at_once(monkeypatch):
    async def scenario(endpoint: OpenAIEndpoint, client: BudgetClient, base: str) -> None:
        held = asyncio.create_task(_chat(base, "g/0"))
        await asyncio.sleep(0.5)
        began = time.monotonic()
        endpoint.groups.begin_stop()  # what OpenAIEndpoint.stop() does first
        status, body = await held
        assert time.monotonic() - began < 2.0
        assert status == 503 and "stopping" in body["error"]["message"], body
        assert client.granted == []

    _hold(monkeypatch, scenario)


def test_a_client_that_left_gets_no_group_and_its_resend_does(monkeypatch):
    async def scenario(endpoint: OpenAIEndpoint, client: BudgetClient, base: str) -> None:
        await _gave_up(base, "gone/0")  # left while held: nothing opens for it
        await asyncio.sleep(1.5)  # its hold notices at its next ask
        client.free = True
        await asyncio.sleep(1.5)  # past its next ask (a held request asks at least every 1 s)
        assert client.granted == [] and not endpoint.groups.by_name
        client.free = False
        # openai-python's resend joins a held opening whose first request timed out
        first = asyncio.create_task(_gave_up(base, "g/0"))
        await asyncio.sleep(0.2)
        resend = asyncio.create_task(_chat(base, "g/0", retry=True))
        await first
        client.free = True
        status, body = await resend
        assert status == 200, body
        assert client.granted == ["ext/s/1"] and endpoint.turns.engine.calls == 1  # type: ignore[attr-defined]

    _hold(monkeypatch, scenario)


def test_groups_granted_at_once_keep_within_max_groups(monkeypatch):
    async def scenario(endpoint: OpenAIEndpoint, client: BudgetClient, base: str) -> None:
        held = [asyncio.create_task(_chat(base, f"g{k}/0")) for k in range(3)]
        await asyncio.sleep(0.5)
        client.free = True  # the budget frees for all of them at once
        statuses = sorted(status for status, _ in await asyncio.gather(*held))
        assert statuses == [200, 429, 429]
        assert len(client.granted) == 1 and len(endpoint.groups.by_name) == 1

    _hold(monkeypatch, scenario, "rollout.openai_endpoint.max_groups=1")


def test_a_cancelled_opening_gives_its_late_slot_back_and_a_mate_opens_the_group(monkeypatch):
    """Under a server that cancels the handler of a client that left, the cancellation may
    land while the slot request runs: the slot it gets is given back, and a group-mate
    still waiting opens the group itself instead of being dropped with the opener."""

    async def scenario(endpoint: OpenAIEndpoint, client: BudgetClient, base: str) -> None:
        client.delay = 1.0
        opener = asyncio.create_task(_gave_up(base, "g/0"))
        await asyncio.sleep(0.2)
        mate = asyncio.create_task(_chat(base, "g/1"))
        await opener
        client.free = True
        status, body = await mate
        assert status == 200, body
        await asyncio.sleep(1.5)
        await asyncio.gather(*endpoint.groups.slots._late)
        assert len(client.granted) == len(client.nacked) + 1, (client.granted, client.nacked)
        assert list(endpoint.groups.by_name) == ["g"]

    _hold(monkeypatch, scenario, cancelling=True)
