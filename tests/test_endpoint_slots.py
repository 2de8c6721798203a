"""Endpoint slots as agent frameworks use them: the real endpoint served on 127.0.0.1, driven
by the ``openai`` client, holding slots of a real coordinator over its sockets (a stand-in
engine and tokenizer stand for vLLM: the slow test in ``test_openai_endpoint.py`` runs it).

A slot is the staleness budget's: a group that is not alive must give it back (its first
request refused, idle past ``group_idle_s``, abandoned), and an agent refused a slot is told
what holds the budget and when the next slot frees.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import openai
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.client import CoordinatorClient
from asyncrl.control.group_filter import GroupFilter
from asyncrl.launch.progress import accounting_lines
from rollout_servers import endpoint_turns
from rollout_servers.groups import SamplingSettings
from rollout_servers.openai_api import OpenAIEndpoint
from tests.helpers import start_coordinator
from tests.standins.chat import REPLY, CharTokenizer, ReplyEngine

IDLE_S = 4.0  # rollout.openai_endpoint.group_idle_s: longer than the 9 chats before the sweep
LIMIT = 8  # the budget: policy lag 1, 4 groups per version
USER = [{"role": "user", "content": "hi"}]


class RecordingPusher:
    """Takes pushed groups as the buffer would (the trajectories are kept)."""

    def __init__(self) -> None:
        self.groups: list[Sequence[Any]] = []

    async def send_async(self, trajectories: Sequence[Any], timeout_s: float | None = None):
        self.groups.append(trajectories)
        return 0.0


@pytest.fixture
def coordinator() -> Iterator[Any]:
    coord = start_coordinator(100, per_version=LIMIT // 2)
    try:
        yield coord
    finally:
        coord.stop()


def _endpoint(cfg: Any, coord: Any) -> tuple[OpenAIEndpoint, CoordinatorClient, RecordingPusher]:
    """The real endpoint of server ``r0``, registered with ``coord``, pushing to a
    recording pusher (a stand-in engine and tokenizer stand for vLLM)."""
    client = CoordinatorClient(coord.tasks_addr, coord.control_addr, "r0", engine_world_size=0)
    client.register()
    pusher = RecordingPusher()
    parts = (ReplyEngine(), CharTokenizer(), client, pusher, SamplingSettings.from_config(cfg))
    return OpenAIEndpoint(cfg, "r0", *parts), client, pusher  # type: ignore[arg-type]


def _agent(url: str, key: str, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=retries, timeout=30)


async def _chat(url: str, key: str, messages: list[dict] = USER, retries: int = 0) -> Any:
    async with _agent(url, key, retries) as agent:
        return await agent.chat.completions.create(model="tiny", messages=messages)


async def _post(url: str, path: str, key: str, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url.removesuffix("/v1") + path, json=body, headers=headers) as response,
    ):
        return response.status, await response.json()


async def _status(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url[:-3] + "/rl/status") as response:
        return await response.json()


def _rewarded_groups(endpoint: OpenAIEndpoint, groups: dict[str, tuple[float, float]]) -> dict:
    """Serve ``endpoint`` while each group's members ``a`` and ``b`` chat once and post
    their rewards, in order; the pushes done, return its status."""

    async def scenario() -> dict:
        url = await endpoint.start()
        try:
            for name, rewards in groups.items():
                for member, reward in zip("ab", rewards, strict=True):
                    await _chat(url, f"{name}/{member}")
                    body = {"reward": reward}
                    assert (await _post(url, "/rl/reward", f"{name}/{member}", body))[0] == 200
                await asyncio.gather(*endpoint.groups._pushes)
            return await _status(url)
        finally:
            await endpoint.stop()

    return asyncio.run(scenario())


def _external(coord: Any) -> dict[str, float]:
    acct = coord.accounting()
    return {k.split("/", 2)[2]: v for k, v in acct.items() if k.startswith("accounting/external")}


def test_slots_are_held_only_by_live_groups(coordinator, tmp_path, monkeypatch):
    """Eight groups opened and forgotten, a refused request, a bad and a second reward, an
    abandoned group: the budget is never wedged, and every slot is accounted for."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            "data.max_prompt_length=512",
            "data.max_response_length=512",
            "rollout.openai_endpoint.host=127.0.0.1",
            f"rollout.openai_endpoint.group_idle_s={IDLE_S}",
            "rollout.openai_endpoint.reward_range=[-1,1]",
            "rollout.openai_endpoint.slot_wait_s=0",  # refused at once: the client retries
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    endpoint, client, pusher = _endpoint(cfg, coordinator)

    async def scenario() -> None:
        url = await endpoint.start()
        try:
            await _refused_and_forgotten(url, endpoint, coordinator)
            await _rewarded_and_abandoned(url, endpoint, coordinator)
            async with _agent(url, "x/a") as agent:  # an unserved route: the API's 404
                with pytest.raises(openai.NotFoundError, match="not served here"):
                    await agent.embeddings.create(model="tiny", input="1+1=")
        finally:
            await endpoint.stop()

    try:
        asyncio.run(scenario())
    finally:
        client.close()
    assert len(pusher.groups) == 1 and len(pusher.groups[0]) == 2
    ext = _external(coordinator)
    assert ext == {
        "dealt": 11.0,
        "in_flight": 0.0,
        "in_buffer": 1.0,
        "trained": 0.0,
        "dropped/lag": 0.0,
        "dropped/expired": 0.0,
        "dropped/duplicate": 0.0,
        "dropped/filtered": 0.0,
        "dropped/prompt_too_long": 0.0,
        "dropped/oversize": 0.0,
        "dropped/overflow": 0.0,
        "dropped/invalid": 0.0,
        "given_up": 10.0,
        "unaccounted": 0.0,
    }, ext
    line = accounting_lines([coordinator.accounting()])[-1]
    assert line.startswith("accounting external: dealt 11 = in flight 0 + in buffer 1"), line


async def _refused_and_forgotten(url: str, endpoint: OpenAIEndpoint, coord: Any) -> None:
    # A refused first request holds no slot.
    with pytest.raises(openai.BadRequestError, match="max_prompt_length"):
        await _chat(url, "bad/a", [{"role": "user", "content": "x" * 2000}])
    await asyncio.gather(*endpoint.groups._pushes)  # the slot went back to the coordinator
    assert _external(coord)["in_flight"] == 0 and _external(coord)["given_up"] == 1

    # Eight groups take a turn each and are forgotten: the budget is theirs.
    for i in range(LIMIT):
        assert (await _chat(url, f"dead{i}/a")).choices[0].message.content == "ok"
    with pytest.raises(openai.RateLimitError) as refused:
        await _chat(url, "agent/a")
    said = refused.value.message
    assert refused.value.response.headers["x-should-retry"] == "true"
    assert "staleness budget (staleness.max_policy_lag=1) is full" in said, said
    assert "8 of the 8 groups admitted so far are charged" in said, said
    assert "8 of them endpoint groups, 8 at this server" in said, said
    assert "'dead0' idle" in said and "POST /rl/abandon" in said, said
    status = await _status(url)
    assert sorted(g["group"] for g in status["open_groups"]) == [f"dead{i}" for i in range(8)]
    assert all(g["members"][0]["turns"] == 1 for g in status["open_groups"])

    # The agent retries as OpenAI clients do (429 with Retry-After): it gets a slot once
    # the forgotten groups are idle for group_idle_s, with no learner step in between.
    asked = time.monotonic()
    reply = await _chat(url, "agent/a", retries=30)
    waited = time.monotonic() - asked
    assert reply.choices[0].message.content == "ok"
    assert waited < IDLE_S + 10, f"a slot came {waited:.1f} s after the agent asked"
    # The agent may have taken the slot of the first group swept; the sweep after it (every
    # group_idle_s / 4) closes the others, which went idle a few milliseconds later.
    for _ in range(30):
        status = await _status(url)
        if [g["group"] for g in status["open_groups"]] == ["agent"]:
            break
        await asyncio.sleep(0.1)
    assert [g["group"] for g in status["open_groups"]] == ["agent"]
    forgotten = [g for g in status["recent_groups"] if g["group"].startswith("dead")]
    assert len(forgotten) == 8 and {g["outcome"] for g in forgotten} == {"given back"}
    assert "no session was rewarded" in forgotten[0]["why"]


async def _rewarded_and_abandoned(url: str, endpoint: OpenAIEndpoint, coord: Any) -> None:
    await _chat(url, "agent/b")
    status, body = await _post(url, "/rl/reward", "agent/a", {"reward": 5000})
    assert status == 400 and "reward_range [-1, 1]" in body["error"]["message"], body
    assert (await _post(url, "/rl/reward", "agent/a", {"reward": 1}))[0] == 200
    status, body = await _post(url, "/rl/reward", "agent/a", {"reward": 0.5})
    assert status == 409 and "a reward is final" in body["error"]["message"], body
    status, body = await _post(url, "/rl/reward", "agent/b", {"reward": 0})
    assert status == 200 and body["group_complete"], body

    await _chat(url, "quit/a")
    await asyncio.gather(*endpoint.groups._pushes)
    ext = _external(coord)
    assert ext["in_flight"] == 1 and ext["in_buffer"] == 1, ext  # "quit"; "agent" pushed
    status, body = await _post(url, "/rl/abandon", "quit/a", {})
    assert status == 200 and body["abandoned"], body
    status, body = await _post(url, "/rl/abandon", "quit/a", {})
    assert status == 404 and "no open group 'quit'" in body["error"]["message"], body
    await asyncio.gather(*endpoint.groups._pushes)
    outcomes = {g["group"]: g["outcome"] for g in (await _status(url))["recent_groups"]}
    assert outcomes["agent"] == "pushed" and outcomes["quit"] == "given back"


def test_a_give_back_the_coordinator_never_answered_is_sent_again(
    coordinator, tmp_path, monkeypatch
):
    """Found by a review: a closed group's give-back (here an abandon's failure report)
    was sent once; never answered, its slot stayed charged for the server's life (no
    registration names a closed group, and the coordinator's reclaim leaves endpoint
    slots alone). The reaper now sends it again."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            "rollout.openai_endpoint.host=127.0.0.1",
            "rollout.openai_endpoint.group_idle_s=2",  # the reaper wakes every 0.5 s
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    endpoint, client, _ = _endpoint(cfg, coordinator)
    nack, lost = client.nack, []

    def nack_lost_once(*args, **kwargs) -> bool:
        if not lost:  # the coordinator never hears the first
            lost.append(args)
            return False
        return nack(*args, **kwargs)

    monkeypatch.setattr(client, "nack", nack_lost_once)

    async def scenario() -> None:
        url = await endpoint.start()
        try:
            await _chat(url, "quit/a")
            assert _external(coordinator)["in_flight"] == 1
            assert (await _post(url, "/rl/abandon", "quit/a", {}))[0] == 200
            await asyncio.gather(*endpoint.groups._pushes)
            assert lost and _external(coordinator)["in_flight"] == 1  # still charged
            deadline = time.monotonic() + 10
            while _external(coordinator)["in_flight"] and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            await endpoint.stop()

    try:
        asyncio.run(scenario())
    finally:
        client.close()
    ext = _external(coordinator)
    assert (ext["in_flight"], ext["given_up"]) == (0.0, 1.0), ext
    assert endpoint.metrics["rollout/openai/give_backs_resent"] == 1


def test_a_request_is_held_while_the_budget_is_full_then_answered_or_refused(
    coordinator, tmp_path, monkeypatch
):
    """Backpressure for clients that retry twice (openai-python's default): a new group's
    first request waits for a slot up to slot_wait_s, answered as soon as one frees (here
    the forgotten groups idle out) or refused once the wait is over, saying how long."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            "rollout.openai_endpoint.host=127.0.0.1",
            f"rollout.openai_endpoint.group_idle_s={IDLE_S}",
            f"rollout.openai_endpoint.slot_wait_s={3 * IDLE_S}",
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    endpoint, client, _ = _endpoint(cfg, coordinator)

    async def scenario() -> tuple[float, str]:
        url = await endpoint.start()
        try:
            for i in range(LIMIT):  # the budget is theirs, and they are forgotten
                await _chat(url, f"dead{i}/a")
            asked = time.monotonic()
            reply = await _chat(url, "agent/a")  # no client retry
            assert reply.choices[0].message.content == "ok"
            waited = time.monotonic() - asked
            for i in range(LIMIT - 1):  # the budget is spent again, by live groups
                await _chat(url, f"live{i}/a")
            endpoint.groups.slots.slot_wait_s = 2.0
            asked = time.monotonic()
            with pytest.raises(openai.RateLimitError) as refused:
                await _chat(url, "late/a")
            assert time.monotonic() - asked >= 2.0
            return waited, refused.value.message
        finally:
            await endpoint.stop()

    try:
        waited, said = asyncio.run(scenario())
    finally:
        client.close()
    assert IDLE_S - 2 < waited < IDLE_S + 5, f"answered {waited:.1f} s after it was sent"
    assert "(held 2 s, rollout.openai_endpoint.slot_wait_s=2)" in said, said
    assert "staleness budget (staleness.max_policy_lag=1) is full" in said, said
    # the two above (a live group may also have waited for the sweep to give slots back)
    assert endpoint.groups.metrics["rollout/openai/slot_waits"] >= 2
    assert endpoint.groups.metrics["rollout/openai/slots_refused/budget"] == 1


def test_a_group_whose_rewards_are_alike_is_filtered_and_its_slot_frees(tmp_path, monkeypatch):
    """algorithm.filter_groups with agents: a group rewarded 1 and 1 carries no signal and
    is never pushed (accounted dropped/filtered, its slot free at once); 1 and 0 is."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    on = GroupFilter(enable=True, max_num_gen_batches=0, batch_size=4)
    coordinator = start_coordinator(100, per_version=LIMIT // 2, group_filter=on)
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            "algorithm.filter_groups.enable=true",
            "rollout.openai_endpoint.host=127.0.0.1",
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    endpoint, client, pusher = _endpoint(cfg, coordinator)
    try:
        status = _rewarded_groups(endpoint, {"same": (1.0, 1.0), "apart": (1.0, 0.0)})
        ext = _external(coordinator)
    finally:
        client.close()
        coordinator.stop()
    outcomes = {g["group"]: g["outcome"] for g in status["recent_groups"]}
    assert outcomes == {"same": "filtered", "apart": "pushed"}, status["recent_groups"]
    assert len(pusher.groups) == 1 and [t.reward for t in pusher.groups[0]] == [1.0, 0.0]
    assert (ext["dropped/filtered"], ext["in_buffer"], ext["in_flight"]) == (1, 1, 0), ext
    assert ext["unaccounted"] == 0


def test_the_overlong_penalty_shapes_the_endpoints_groups_too(tmp_path, monkeypatch):
    """reward.overlong_buffer with agents: a session whose response ran to
    data.max_response_length loses penalty_factor, as the server's own groups do (the
    client's raw reward was trained); the filter still reads the unshaped rewards."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    limit = len(REPLY)  # the stand-in's reply fills the whole budget
    on = GroupFilter(enable=True, max_num_gen_batches=0, batch_size=4)
    coordinator = start_coordinator(100, per_version=LIMIT // 2, group_filter=on)
    overlong = ["enable=true", f"len={limit // 2}", "penalty_factor=1.0"]
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            f"data.max_response_length={limit}",
            "algorithm.filter_groups.enable=true",
            *(f"reward.overlong_buffer.{kv}" for kv in overlong),
            "rollout.openai_endpoint.host=127.0.0.1",
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    endpoint, client, pusher = _endpoint(cfg, coordinator)
    try:
        _rewarded_groups(endpoint, {"same": (1.0, 1.0), "apart": (1.0, 0.0)})
    finally:
        client.close()
        coordinator.stop()
    [group] = pusher.groups  # "same" filtered on its unshaped 1 and 1
    assert [t.reward for t in group] == [0.0, -1.0]
    assert [t.meta.reward_parts for t in group] == [{"overlong_penalty": -1.0}] * 2


def test_a_session_refused_for_want_of_room_is_penalised_at_the_whole_budget(tmp_path, monkeypatch):
    """Found by a review: a session whose next turn did not fit its response budget (a
    400 ``context_length_exceeded``) ended there, but the overlong penalty measured only
    the tokens it had used, where the server's own episodes that run out of room count the
    whole limit (as a single response cut there)."""
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: None)  # no vLLM import
    limit = 4 * len(REPLY)
    overlong = ["enable=true", f"len={limit}", "penalty_factor=1.0"]
    coordinator = start_coordinator(100, per_version=LIMIT // 2)
    cfg = load_config(
        None,
        [
            "rollout.n=2",
            f"data.max_response_length={limit}",
            *(f"reward.overlong_buffer.{kv}" for kv in overlong),
            "rollout.openai_endpoint.host=127.0.0.1",
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    endpoint, client, pusher = _endpoint(cfg, coordinator)

    async def scenario() -> None:
        url = await endpoint.start()
        try:
            first = await _chat(url, "g/a")
            history = [*USER, {"role": "assistant", "content": first.choices[0].message.content}]
            history.append({"role": "user", "content": "x" * (2 * limit)})  # no room left
            with pytest.raises(openai.BadRequestError, match="maximum context length"):
                await _chat(url, "g/a", history)
            await _chat(url, "g/b")
            for member in "ab":
                assert (await _post(url, "/rl/reward", f"g/{member}", {"reward": 1.0}))[0] == 200
            await asyncio.gather(*endpoint.groups._pushes)
        finally:
            await endpoint.stop()

    try:
        asyncio.run(scenario())
    finally:
        client.close()
        coordinator.stop()
    [group] = pusher.groups
    penalties = [t.meta.reward_parts.get("overlong_penalty", 0.0) for t in group]
    assert penalties[0] == -1.0, penalties  # measured at the whole budget: the most
    assert -1.0 < penalties[1] <= 0.0, penalties  # b used a quarter of it


def test_an_endpoint_only_run_refuses_validation_it_could_never_finish():
    only = ["rollout.openai_endpoint.enable=true", "rollout.openai_endpoint.take_tasks=false"]
    with pytest.raises(ConfigError, match="trainer.val_before_train=false trainer.test_freq=-1"):
        load_config(None, only)
    off = ["trainer.val_before_train=false", "trainer.test_freq=-1"]
    assert not load_config(None, [*only, *off]).rollout.openai_endpoint.take_tasks


def test_the_endpoint_of_a_server_asks_for_slots_in_the_servers_lanes(coordinator, tmp_path):
    """Inside a rollout server, the endpoint's slot requests and give-backs run in the
    server's control threads, which the server's stop closes; the threads the endpoint
    made for itself are closed at once (left, they were a second pool nothing closed)."""
    from rollout_servers.server import RolloutServer
    from tests.standins.server_parts import StandInEngine, StandInScorer

    cfg = load_config(
        None,
        ["rollout.openai_endpoint.host=127.0.0.1", f"trainer.default_local_dir={tmp_path}"],
    )
    endpoint, client, pusher = _endpoint(cfg, coordinator)
    own = endpoint.groups.lanes
    parts = (StandInEngine(), CharTokenizer(), StandInScorer(), pusher, client)
    server = RolloutServer(cfg, "r0", *parts, endpoint=endpoint)  # type: ignore[arg-type]
    assert endpoint.groups.lanes is server.lanes
    assert endpoint.groups.slots.lanes is server.lanes
    with pytest.raises(RuntimeError):  # closed: it takes no more calls
        own._control.submit(time.monotonic)
