"""The OpenAI endpoint's groups and bodies, mended: the real endpoint served over HTTP on
127.0.0.1 (a character tokenizer and a stand-in engine, no vLLM).

- A turn longer than ``group_idle_s`` does not leave its group to be closed right after
  its answer: the group is idle from the turn's end, also when the turn outlives the
  request that started it.
- A request naming a group that closed lately (rewarded whole, idle, abandoned) is a
  final 409, not a new group under the same name.
- A member refused from its first request may post its reward: it counts toward the
  group's completion and trains nothing.
- A body the endpoint cannot read, a key too long, ``max_completion_tokens: 0`` are 400s
  in the API's shape on every route.
- A reward posted again (the client lost the answer) gets its first answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from asyncrl.control.task_states import external_task
from rollout_servers.closed_groups import ClosedNames
from rollout_servers.sessions import Group
from tests.standins.chat import ReplyEngine
from tests.test_endpoint_faults import USER, OneSlotClient, Rig, _serve
from tests.test_endpoint_slots import RecordingPusher

TOO_LONG = {"role": "user", "content": "x" * 600}  # past data.max_prompt_length=512


class SlowEngine(ReplyEngine):
    """Answers after ``delay_s``: a turn that outlasts ``group_idle_s``."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        await asyncio.sleep(self.delay_s)
        return await super().generate(prompt_ids, params, request_id)


class AckingClient(OneSlotClient):
    """Also takes acknowledgements, as the coordinator does."""

    def __init__(self) -> None:
        super().__init__()
        self.acked: list[list[str]] = []

    def ack(self, task_ids: list[str], filtered: bool = False) -> None:
        self.acked.append(task_ids)


async def _send(
    rig: Rig,
    path: str,
    key: str = "g/0",
    body: dict[str, Any] | None = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, str | None, dict[str, Any]]:
    """Status, ``x-should-retry`` and JSON answer of a POST to ``path`` as session ``key``."""
    sent = {"Authorization": f"Bearer {key}", **(headers or {})}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{rig.base}{path}", json=body, data=data, headers=sent) as r,
    ):
        return r.status, r.headers.get("x-should-retry"), await r.json()


async def _chat(rig: Rig, key: str = "g/0", messages: Any = (USER,), **extra: Any) -> tuple:
    body = {"model": "m", "messages": list(messages), **extra}
    return await _send(rig, "/v1/chat/completions", key, body)


async def _reward(rig: Rig, key: str, reward: float) -> tuple:
    return await _send(rig, "/rl/reward", key, {"reward": reward})


def test_a_turn_longer_than_group_idle_s_keeps_its_group_for_its_reward(monkeypatch):
    async def scenario(rig: Rig) -> None:
        rig.endpoint.groups.start()  # the idle reaper, every 0.25 s
        rig.endpoint.turns.engine = SlowEngine(1.3)  # type: ignore[assignment]
        assert (await _chat(rig))[0] == 200
        await asyncio.sleep(0.6)  # the agent runs its tool: shorter than group_idle_s
        status, _, body = await _reward(rig, "g/0", 1.0)
        assert status == 200 and body["rewarded"] == 1, body
        assert rig.endpoint.metrics["rollout/openai/groups_timed_out"] == 0

    _serve(monkeypatch, scenario, ("rollout.openai_endpoint.group_idle_s=1",))


def test_a_turn_that_outlives_its_request_keeps_its_group_idle_from_its_end(monkeypatch):
    """The client leaves 0.3 s into a 1.8 s turn and its handler is cancelled; the turn runs
    on. Its group is idle from the turn's end, not from the request's: the agent's resend
    0.4 s after the end (under ``group_idle_s=1``) gets the reply, and its reward trains.
    Timed from the request, the reaper closed the group as the turn ended."""

    async def scenario(rig: Rig) -> None:
        rig.endpoint.groups.start()  # the idle reaper, every 0.25 s
        rig.endpoint.turns.engine = SlowEngine(1.8)  # type: ignore[assignment]
        body = {"model": "m", "messages": [USER]}
        left = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=left) as http:
            with pytest.raises(asyncio.TimeoutError):
                await http.post(
                    f"{rig.base}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": "Bearer g/0"},
                )
        await asyncio.sleep(1.5 + 0.4)  # past the turn's end, by less than group_idle_s
        status, _, reply = await _chat(rig)
        assert status == 200, reply
        assert rig.endpoint.metrics["rollout/openai/retries_replayed"] == 1
        status, _, answer = await _reward(rig, "g/0", 1.0)
        assert status == 200 and answer["rewarded"] == 1, answer
        assert rig.endpoint.metrics["rollout/openai/groups_timed_out"] == 0

    _serve(
        monkeypatch,
        scenario,
        ("rollout.openai_endpoint.group_idle_s=1",),
        cancel_handlers=True,
    )


def test_a_request_naming_a_closed_group_is_a_final_409_not_a_new_group(monkeypatch):
    async def scenario(rig: Rig) -> None:
        groups, metrics = rig.endpoint.groups, rig.endpoint.metrics
        for key, reward in (("g/0", 1.0), ("g/1", 0.0)):
            assert (await _chat(rig, key))[0] == 200
            assert (await _reward(rig, key, reward))[0] == 200
        for key in ("g/0", "g/2"):  # a rewarded member, and a new one
            status, retry, body = await _chat(rig, key)
            message = body["error"]["message"]
            assert status == 409 and retry == "false", body
            assert "(every member rewarded)" in message and "use a new GROUP name" in message
        assert "g" not in groups.by_name and metrics["rollout/openai/groups_opened"] == 1

        assert (await _chat(rig, "h/0"))[0] == 200
        assert (await _send(rig, "/rl/abandon", "h/0"))[0] == 200
        status, _, body = await _chat(rig, "h/0")
        assert status == 409 and "abandoned by its agent" in body["error"]["message"], body
        status, _, body = await _send(rig, "/rl/abandon", "h/0")
        assert status == 404 and "(closed: abandoned by its agent)" in body["error"]["message"]

        assert (await _chat(rig, "i/0"))[0] == 200
        groups.close(groups.by_name["i"], "idle for 61 s")  # as the reaper closes it
        status, _, body = await _reward(rig, "i/0", 1.0)
        assert status == 409 and "(idle for 61 s)" in body["error"]["message"], body
        assert metrics["rollout/openai/groups_opened"] == 3 and rig.engine.calls == 4
        await asyncio.gather(*groups._pushes)

    _serve(monkeypatch, scenario)


def test_closed_names_are_kept_a_while_and_at_most_so_many():
    closed = ClosedNames(keep_s=0.2, most=2)
    for name in ("a", "b", "c"):
        closed.add(Group(name, external_task(f"ext/{name}", 0), 2), "abandoned")
    assert closed.get("a") is None and closed.get("b") is not None  # the oldest went first
    time.sleep(0.25)
    assert closed.get("c") is None  # and none is kept past keep_s


def test_a_member_refused_from_its_first_request_counts_toward_completion(monkeypatch):
    async def scenario(rig: Rig) -> None:
        groups = rig.endpoint.groups
        client, pusher = AckingClient(), RecordingPusher()
        groups.client, groups.pusher = client, pusher  # type: ignore[assignment]
        assert (await _chat(rig, "g/0"))[0] == 200
        status, _, body = await _chat(rig, "g/1", [TOO_LONG])
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert (await _chat(rig, "g/2"))[0] == 200
        # The agent ends the refused episode with its reward, as the README's agent does.
        status, _, body = await _reward(rig, "g/1", 0.0)
        assert status == 200 and body["rewarded"] == 1 and not body["group_complete"], body
        assert (await _reward(rig, "g/0", 1.0))[0] == 200
        status, _, body = await _reward(rig, "g/2", 0.0)
        assert status == 200 and body["group_complete"] and body["rewarded"] == 3, body
        await asyncio.gather(*groups._pushes)
        (pushed,) = pusher.groups  # the two members with turns, not the refused one
        assert sorted({t.meta.reward for t in pushed}) == [0.0, 1.0]
        assert len({t.meta.episode_index for t in pushed}) == 2
        assert client.acked == [["ext/1"]] and client.nacked == []
        metrics = rig.endpoint.metrics
        assert metrics["rollout/openai/sessions_dropped"] == 1

    _serve(monkeypatch, scenario, ("rollout.n=3", "rollout.openai_endpoint.group_size=3"))


BAD_BODIES = {
    "charset": (b'{"reward": 1}', "application/json; charset=bogus", "charset is unknown"),
    "nested": (b"[" * 100_000 + b"]" * 100_000, "application/json", "nested too deeply"),
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/rl/reward", "/rl/abandon"])
@pytest.mark.parametrize("bad", sorted(BAD_BODIES))
def test_a_body_that_cannot_be_read_is_a_400_in_the_api_shape(monkeypatch, path, bad):
    data, content_type, says = BAD_BODIES[bad]

    async def scenario(rig: Rig) -> None:
        headers = {"Content-Type": content_type}
        status, retry, body = await _send(rig, path, data=data, headers=headers)
        assert status == 400 and retry == "false", body
        assert says in body["error"]["message"] and "\n" not in body["error"]["message"]
        assert rig.endpoint.metrics["rollout/openai/refused/400"] == 1

    _serve(monkeypatch, scenario)


def test_a_key_too_long_and_no_tokens_asked_are_400s(monkeypatch):
    async def scenario(rig: Rig) -> None:
        key = "g/" + "x" * 300
        for status, _, body in (await _chat(rig, key), await _reward(rig, key, 1.0)):
            assert status == 400 and "session key of 302 characters" in body["error"]["message"]
        status, _, body = await _chat(rig, max_completion_tokens=0, max_tokens=5)
        assert status == 400 and "max_tokens must be a positive" in body["error"]["message"]
        assert rig.engine.calls == 0

    _serve(monkeypatch, scenario)


def test_a_reward_posted_again_gets_its_first_answer(monkeypatch):
    async def scenario(rig: Rig) -> None:
        assert (await _chat(rig, "g/0"))[0] == 200
        first = await _reward(rig, "g/0", 1.0)
        assert first[0] == 200 and await _reward(rig, "g/0", 1.0) == first
        status, _, body = await _reward(rig, "g/0", 0.5)
        assert status == 409 and "a reward is final" in body["error"]["message"], body
        assert (await _chat(rig, "g/1"))[0] == 200
        last = await _reward(rig, "g/1", 0.0)
        assert last[0] == 200 and last[2]["group_complete"], last
        # The group has closed: its rewards are still answered as the first time.
        assert await _reward(rig, "g/1", 0.0) == last
        assert await _reward(rig, "g/0", 1.0) == first
        status, _, body = await _reward(rig, "g/0", 0.0)
        assert status == 409 and "reward already (1; group 'g' closed" in body["error"]["message"]
        assert rig.endpoint.metrics["rollout/openai/retries_replayed"] == 3
        await asyncio.gather(*rig.endpoint.groups._pushes)

    _serve(monkeypatch, scenario)


@pytest.mark.parametrize("route", ["reward", "abandon"])
def test_a_failure_on_the_rl_routes_answers_in_the_api_shape(monkeypatch, route):
    """As a chat does: a 500 with ``error.message``, not aiohttp's plain-text page."""

    def broken(*args: Any) -> Any:
        raise RuntimeError("the groups hiccuped")

    async def scenario(rig: Rig) -> None:
        monkeypatch.setattr(rig.endpoint.groups, route, broken)
        status, retry, body = await _send(rig, f"/rl/{route}", body={"reward": 1})
        assert status == 500 and retry == "true", body
        assert body["error"]["message"] == "RuntimeError: the groups hiccuped"

    _serve(monkeypatch, scenario)
