"""Refusals of the endpoint as agents meet them under a full staleness budget or a failure
of its own: a malformed request's 400 comes at once (it waited for a slot, then got a 429
that clients retry), an unreadable body still keeps the member its key names, and a group
whose trajectories could not be built gives its slot back. The real endpoint on 127.0.0.1
and a real coordinator over its sockets (a stand-in engine and tokenizer stand for vLLM).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from asyncrl.config import load_config
from rollout_servers import endpoint_groups, endpoint_turns
from tests import test_endpoint_slots
from tests.test_endpoint_slots import LIMIT, _chat, _endpoint, _external, _post, _status

BAD_BODIES = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": 5}, "stop"),
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
    ({"tools": [{"type": "function"}]}, "tools"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 1}]},
        "tool_calls",
    ),
]


coordinator = test_endpoint_slots.coordinator  # the same real coordinator, per test


def _cfg(tmp_path: Any, *more: str) -> Any:
    return load_config(
        None,
        [
            "rollout.n=2",
            "rollout.openai_endpoint.host=127.0.0.1",
            f"trainer.default_local_dir={tmp_path}",
            *more,
        ],
    )


def test_a_malformed_request_is_refused_at_once_when_the_budget_is_full(
    coordinator, tmp_path, monkeypatch
):
    """Every body check runs before the request's group takes a slot: with the budget
    spent and slot_wait_s long, each malformed request is a 400 naming its field within
    a fraction of the wait, and none of them waited for a slot."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    endpoint, client, _ = _endpoint(
        _cfg(tmp_path, "rollout.openai_endpoint.slot_wait_s=30"), coordinator
    )

    async def scenario() -> list[tuple[int, str, float]]:
        url = await endpoint.start()
        try:
            for i in range(LIMIT):  # the budget is theirs
                await _chat(url, f"held{i}/a")
            answers = []
            for i, (fields, _) in enumerate(BAD_BODIES):
                body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
                asked = time.monotonic()
                status, reply = await _post(url, "/v1/chat/completions", f"bad{i}/a", body | fields)
                answers.append((status, reply["error"]["message"], time.monotonic() - asked))
            return answers
        finally:
            await endpoint.stop()

    try:
        answers = asyncio.run(scenario())
    finally:
        client.close()
    for (status, said, took), (_, field) in zip(answers, BAD_BODIES, strict=True):
        assert status == 400 and field in said, (status, said)
        assert took < 10.0, f"{field}: answered after {took:.1f} s"
    assert endpoint.groups.metrics["rollout/openai/slot_waits"] == 0


def test_an_unreadable_body_keeps_the_member_its_key_names(coordinator, tmp_path, monkeypatch):
    """A body that is not JSON is a 400, and its API key still names the member: the
    member's reward counts toward its group, which completes at once (its reward was a
    404, and the group waited for group_idle_s)."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)
    endpoint, client, _ = _endpoint(_cfg(tmp_path), coordinator)

    async def scenario() -> tuple[int, int, dict]:
        url = await endpoint.start()
        try:
            await _chat(url, "g/1")
            headers = {"Authorization": "Bearer g/0", "Content-Type": "application/json"}
            async with (
                aiohttp.ClientSession() as http,
                http.post(url + "/chat/completions", data=b"{oops", headers=headers) as r,
            ):
                unreadable = r.status
            assert (await _post(url, "/rl/reward", "g/1", {"reward": 1.0}))[0] == 200
            rewarded, body = await _post(url, "/rl/reward", "g/0", {"reward": 0.0})
            await asyncio.gather(*endpoint.groups._pushes)
            return unreadable, rewarded, body
        finally:
            await endpoint.stop()

    try:
        unreadable, rewarded, body = asyncio.run(scenario())
    finally:
        client.close()
    assert unreadable == 400
    # Complete by its rewards at once (grpo then drops it: one member has no turn).
    assert rewarded == 200 and body["group_complete"], body


def test_a_group_whose_trajectories_cannot_be_built_gives_its_slot_back(
    coordinator, tmp_path, monkeypatch
):
    """A failure building a complete group's trajectories (a bug, not the agent's) gives
    the task back to the coordinator, as a failed push does: the slot stayed charged for
    the server's lifetime, and the task in flight for ever."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a bug")

    monkeypatch.setattr(endpoint_groups, "episode_trajectories", broken)
    endpoint, client, pusher = _endpoint(_cfg(tmp_path), coordinator)

    async def scenario() -> dict:
        url = await endpoint.start()
        try:
            for member, reward in (("a", 1.0), ("b", 0.0)):
                await _chat(url, f"g/{member}")
                assert (await _post(url, "/rl/reward", f"g/{member}", {"reward": reward}))[0] == 200
            await asyncio.gather(*endpoint.groups._pushes)
            return await _status(url)
        finally:
            await endpoint.stop()

    try:
        status = asyncio.run(scenario())
    finally:
        client.close()
    [group] = status["recent_groups"]
    assert group["outcome"] == "given back" and "a bug" in group["why"], group
    assert not pusher.groups
    ext = _external(coordinator)
    assert ext["in_flight"] == 0 and ext["unaccounted"] == 0, ext
