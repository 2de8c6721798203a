"""An endpoint group's first turn waits for the weights its group was dealt under, as a
dealt task does (the admission window may open at the learner's send, before the engine
loaded what it sent). The real endpoint served on 127.0.0.1 (a character tokenizer, a
stand-in engine that loads a version when the test says so)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from asyncrl.config import load_config
from asyncrl.control.messages import TaskGrant
from asyncrl.control.task_states import external_task
from rollout_servers import endpoint_turns
from rollout_servers.groups import SamplingSettings
from rollout_servers.openai_api import OpenAIEndpoint
from tests.standins.chat import CharTokenizer, ReplyEngine
from tests.test_endpoint_slots import USER, RecordingPusher

pytestmark = pytest.mark.timeout(60)

DEALT = 3


class LoadingEngine(ReplyEngine):
    """Holds version 2 until :meth:`load`; :meth:`reach` waits as the real engine's does
    (until the version is loaded or ``timeout_s`` passes), and every generate records the
    version it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 2
        self.loaded = asyncio.Event()
        self.ran_under: list[int] = []

    def load(self) -> None:
        self.version = DEALT
        self.loaded.set()

    async def reach(self, version: int, timeout_s: float) -> float:
        start = time.monotonic()
        if self.version < version:
            with contextlib.suppress(asyncio.TimeoutError):  # the builtin one from 3.11
                await asyncio.wait_for(self.loaded.wait(), timeout_s)
        return time.monotonic() - start

    async def generate(self, prompt_ids, params, request_id):  # type: ignore[no-untyped-def]
        self.ran_under.append(self.version)
        return await super().generate(prompt_ids, params, request_id)


class SlotClient:
    """Grants every slot at once, dealt at version :data:`DEALT`."""

    def __init__(self) -> None:
        self.n = 0

    def request_slot(self) -> TaskGrant:
        self.n += 1
        return TaskGrant(tasks=[external_task(f"ext/s/{self.n}", DEALT)], policy_version=DEALT)

    def nack(self, task_ids: list[str], reason: str, dealt: list[int] | None = None) -> None:
        pass

    def give_back_unanswered_slots(self, older_than_s: float) -> int:
        return 0


async def _chat(base: str, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "m", "messages": USER}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
        http.post(f"{base}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        return r.status


def _serve(monkeypatch, engine: LoadingEngine, scenario) -> OpenAIEndpoint:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            "rollout.openai_endpoint.host=127.0.0.1",
            "rollout.openai_endpoint.group_idle_s=600",
        ],
    )
    parts = (engine, CharTokenizer(), SlotClient(), RecordingPusher())
    endpoint = OpenAIEndpoint(cfg, "r0", *parts, SamplingSettings.from_config(cfg))  # type: ignore[arg-type]

    async def main() -> None:
        base = (await endpoint.start()).removesuffix("/v1")
        try:
            await scenario(base)
        finally:
            await endpoint.stop()

    asyncio.run(main())
    return endpoint


def test_a_new_groups_first_turn_waits_for_the_version_it_was_dealt_at(monkeypatch) -> None:
    engine = LoadingEngine()

    async def scenario(base: str) -> None:
        first = asyncio.create_task(_chat(base, "g1/0"))
        await asyncio.sleep(0.3)
        assert engine.calls == 0  # held for the load, not generated under version 2
        engine.load()
        assert await first == 200
        assert await _chat(base, "g1/1") == 200  # the group's next member: loaded by now

    endpoint = _serve(monkeypatch, engine, scenario)
    assert engine.ran_under == [DEALT, DEALT]
    # At least the 0.3 s the test held the load, less the request's way to the wait.
    assert endpoint.metrics["rollout/openai/version_wait_ms"] >= 150
    assert endpoint.metrics["rollout/openai/version_wait_missed"] == 0


def test_a_first_turn_whose_version_never_loads_starts_under_the_old_one_counted(
    monkeypatch,
) -> None:
    monkeypatch.setattr(endpoint_turns, "REACH_S", 0.2)
    engine = LoadingEngine()

    async def scenario(base: str) -> None:
        assert await _chat(base, "g1/0") == 200

    endpoint = _serve(monkeypatch, engine, scenario)
    assert engine.ran_under == [2]
    assert endpoint.metrics["rollout/openai/version_wait_missed"] == 1
