"""The OpenAI endpoint when a turn's reply reaches no client: the real endpoint served over
HTTP on 127.0.0.1 (a character tokenizer and a stand-in engine, no vLLM).

An agent whose client gave up on a turn (its own step timeout, an openai client with no
retries left) never read that turn. It may ask the same again (the turn is replayed: it
cannot be re-asking about a reply it never read), ask something else, or end the episode
with its reward: the turn is then taken back, not trained with a reward given for a
conversation that did not hold it. A marked resend replays only the latest request's turn:
a re-ask whose first attempt failed must not get the reply it re-asks.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_servers.sessions import RequestError
from tests.test_endpoint_clients import GatedEngine
from tests.test_endpoint_faults import USER, Rig, _serve
from tests.test_endpoint_leavers import _gives_up
from tests.test_endpoint_mends import _chat, _reward, _send

OTHER = {"role": "user", "content": "what now"}


async def _unseen_turn(rig: Rig) -> GatedEngine:
    """g/0's first turn runs to its end after its client gave up on it."""
    engine = GatedEngine()
    rig.endpoint.turns.engine = engine  # type: ignore[assignment]
    assert await _gives_up(rig, {"model": "m", "messages": [USER]}) is None
    engine.gate.set()
    await rig.endpoint.turns.settled("g/0")
    await asyncio.sleep(0.1)  # the handler sees its client gone
    assert rig.session().unseen and rig.session().episode.turns == 1
    return engine


def test_the_same_request_after_an_unseen_turn_gets_that_turn(monkeypatch):
    async def scenario(rig: Rig) -> None:
        engine = await _unseen_turn(rig)
        status, _, body = await _chat(rig)  # unmarked: the agent's own retry
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok", body
        session, metrics = rig.session(), rig.endpoint.metrics
        assert engine.calls == 1 and session.episode.turns == 1 and not session.unseen
        assert metrics["rollout/openai/retries_replayed"] == 1, dict(metrics)
        # Seen now: the same messages once more are a re-ask, a new sample.
        assert (await _chat(rig))[0] == 200
        assert engine.calls == 2 and metrics["rollout/openai/rewritten"] == 1

    _serve(monkeypatch, scenario)


def test_another_request_after_an_unseen_turn_takes_it_back(monkeypatch):
    async def scenario(rig: Rig) -> None:
        engine = await _unseen_turn(rig)
        assert (await _chat(rig, "g/0", [OTHER]))[0] == 200
        ep, metrics = rig.session().episode, rig.endpoint.metrics
        assert engine.calls == 2 and ep.turns == 1 and len(ep.pieces) == 1
        assert "<user>hi" not in "".join(map(chr, ep.pieces[0].prompt_ids))
        assert metrics["rollout/openai/unseen_dropped"] == 1, dict(metrics)
        assert metrics["rollout/openai/rewritten"] == 0, dict(metrics)

    _serve(monkeypatch, scenario)


def test_a_reward_posted_while_its_turn_samples_waits_and_takes_it_back(monkeypatch):
    """The agent gave up on its turn and ended the episode: the reward is not a 409 it is
    told never to retry, and the turn it never read is not trained."""

    async def scenario(rig: Rig) -> None:
        engine = GatedEngine()
        rig.endpoint.turns.engine = engine  # type: ignore[assignment]
        assert await _gives_up(rig, {"model": "m", "messages": [USER]}) is None
        reward = asyncio.create_task(_reward(rig, "g/0", 0.0))
        await asyncio.sleep(0.3)
        assert not reward.done()  # it waits for the turn
        engine.gate.set()
        status, _, body = await reward
        assert status == 200 and body["rewarded"] == 1, body
        assert rig.session().episode.turns == 0
        assert rig.endpoint.metrics["rollout/openai/unseen_dropped"] == 1

    _serve(monkeypatch, scenario)


def test_a_reward_meeting_a_turn_that_started_after_its_wait_is_a_retryable_409(monkeypatch):
    async def scenario(rig: Rig) -> None:
        assert (await _chat(rig))[0] == 200
        rig.session().busy = True  # the agent's next turn started as the reward's wait ended
        with pytest.raises(RequestError) as refused:
            rig.endpoint.groups.reward("g/0", lambda: 1.0)
        assert refused.value.status == 409 and refused.value.retry, refused.value.message

    _serve(monkeypatch, scenario)


def test_a_marked_resend_of_a_failed_re_ask_samples_it(monkeypatch):
    """The re-ask's first attempt fails (a 500 the client resends, marked): the resend must
    sample the re-ask, not replay the turn it re-asks."""

    async def scenario(rig: Rig) -> None:
        engine = rig.engine
        assert (await _chat(rig))[0] == 200
        engine.fail_next = True
        assert (await _chat(rig))[0] == 500  # the re-ask, unmarked
        marked = {"x-stainless-retry-count": "1"}
        body = {"model": "m", "messages": [USER]}
        status, _, _ = await _send(rig, "/v1/chat/completions", "g/0", body, headers=marked)
        assert status == 200
        assert engine.calls == 3 and rig.session().episode.turns == 2
        assert rig.endpoint.metrics["rollout/openai/retries_replayed"] == 0

    _serve(monkeypatch, scenario)


def test_a_group_whose_member_lost_its_only_turn_says_so_when_dropped(monkeypatch):
    async def scenario(rig: Rig) -> None:
        client = rig.endpoint.groups.client
        await _unseen_turn(rig)
        assert (await _reward(rig, "g/0", 0.0))[0] == 200  # takes the unseen turn back
        assert (await _chat(rig, "g/1"))[0] == 200
        status, _, body = await _reward(rig, "g/1", 1.0)
        assert status == 200 and body["group_complete"], body
        await asyncio.gather(*rig.endpoint.groups._pushes)
        assert client.nacked == [  # type: ignore[attr-defined]
            (
                ["ext/1"],
                "dropped: 1 of 2 sessions rewarded with turns (1 more rewarded with "
                "no turn to train)",
            )
        ]

    _serve(monkeypatch, scenario)
