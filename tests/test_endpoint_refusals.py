"""The OpenAI endpoint's refusals, mended: the real endpoint served over HTTP on 127.0.0.1 (a
character tokenizer and a stand-in engine, no vLLM).

- A member refused by its body's checks (``n``, what would constrain sampling, vLLM's
  fields, a raw prompt's) is kept as one refused later is: its reward counts toward its
  group's completion. Those checks ran before its session existed, and its reward was a
  404, its group never complete.
- A refused request leaves the session as it was, an unseen turn included: the same
  request as that turn's still replays it.
- A large body is rendered and tokenized off the server's loop: the loop (its other
  sessions, its syncs) is not held for seconds by a prompt it refuses anyway.
- A reward too large for a float is the 400 of an infinite one, not a 500 clients resend.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.standins.chat import CharTokenizer
from tests.test_endpoint_faults import USER, Rig, _serve
from tests.test_endpoint_mends import _chat, _reward, _send
from tests.test_endpoint_unseen import _unseen_turn

#: Bodies each refused before a session exists: (path, what the body adds).
REFUSED_EARLY = {
    "n": ("/v1/chat/completions", {"n": 2}),
    "response_format": ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    "tool_choice": ("/v1/chat/completions", {"tool_choice": "required"}),
    "vllm_field": ("/v1/chat/completions", {"guided_json": {"type": "object"}}),
    "raw_echo": ("/v1/completions", {"prompt": "hi", "echo": True}),
}


async def _refused(rig: Rig, key: str, case: str) -> None:
    path, extra = REFUSED_EARLY[case]
    status, _, body = await _send(rig, path, key, {"model": "m", "messages": [USER], **extra})
    assert status == 400, body


@pytest.mark.parametrize("case", sorted(REFUSED_EARLY))
def test_a_member_refused_by_its_bodys_checks_still_counts(monkeypatch, case):
    async def scenario(rig: Rig) -> None:
        groups, metrics = rig.endpoint.groups, rig.endpoint.metrics
        # In an open group: g/1 refused, g/0 with a turn.
        assert (await _chat(rig, "g/0"))[0] == 200
        await _refused(rig, "g/1", case)
        status, _, body = await _reward(rig, "g/1", 0.0)
        assert status == 200 and body["rewarded"] == 1, body
        status, _, body = await _reward(rig, "g/0", 1.0)
        assert status == 200 and body["group_complete"], body
        # Before its group opened: h/0 refused, then h/1 opens the group with h/0 in it.
        await _refused(rig, "h/0", case)
        assert "h" not in groups.by_name  # no slot was taken for it
        assert (await _reward(rig, "h/0", 0.0))[0] == 200
        assert (await _chat(rig, "h/1"))[0] == 200
        status, _, body = await _reward(rig, "h/1", 1.0)
        assert status == 200 and body["group_complete"] and body["rewarded"] == 2, body
        await asyncio.gather(*groups._pushes)
        # Each group has one member with turns, no baseline for GRPO: both are dropped
        # whole, each refused member counted once among their sessions.
        assert metrics["rollout/openai/groups_too_few_rewarded"] == 2
        assert metrics["rollout/openai/sessions_dropped"] == 4

    _serve(monkeypatch, scenario)


def test_a_refused_request_keeps_an_unseen_turn(monkeypatch):
    async def scenario(rig: Rig) -> None:
        engine = await _unseen_turn(rig)
        status, _, body = await _chat(rig, max_tokens=0)  # refused in its turn
        assert status == 400 and "max_tokens" in body["error"]["message"], body
        session, metrics = rig.session(), rig.endpoint.metrics
        assert session.unseen and session.episode.turns == 1
        assert metrics["rollout/openai/unseen_dropped"] == 0, dict(metrics)
        marked = {"x-stainless-retry-count": "1"}
        body = {"model": "m", "messages": [USER]}
        status, _, _ = await _send(rig, "/v1/chat/completions", "g/0", body, headers=marked)
        assert status == 200 and engine.calls == 1  # the unseen turn, replayed
        assert metrics["rollout/openai/retries_replayed"] == 1, dict(metrics)

    _serve(monkeypatch, scenario)


class BlockingTokenizer(CharTokenizer):
    """Encodes a long text in ``BLOCK_S`` of blocking work outside the GIL, as a Rust
    tokenizer takes seconds for a few MB."""

    BLOCK_S = 1.0

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if len(text) > 100_000:
            time.sleep(self.BLOCK_S)
        return super().encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_large_body_is_tokenized_off_the_servers_loop(monkeypatch, path):
    async def scenario(rig: Rig) -> None:
        rig.endpoint.tok = rig.endpoint.turns.tok = BlockingTokenizer()
        big = "x" * 1_000_000  # under the body limit, far past data.max_prompt_length
        gaps: list[float] = []

        async def ticker() -> None:  # how long the loop goes without running a task
            while True:
                start = time.monotonic()
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - start - 0.01)

        ticking = asyncio.create_task(ticker())
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": big}]}
        if path == "/v1/completions":
            body = {"model": "m", "prompt": big}
        status, _, answer = await _send(rig, path, "g/0", body)
        ticking.cancel()
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert max(gaps) < BlockingTokenizer.BLOCK_S / 2, max(gaps)

    _serve(monkeypatch, scenario)


def test_a_reward_too_large_for_a_float_is_a_400(monkeypatch):
    async def scenario(rig: Rig) -> None:
        assert (await _chat(rig))[0] == 200
        huge = b'{"reward": 1' + b"0" * 400 + b"}"
        headers = {"Content-Type": "application/json"}
        status, retry, body = await _send(rig, "/rl/reward", data=huge, headers=headers)
        assert status == 400 and retry == "false", body
        assert "finite number" in body["error"]["message"]
        assert rig.session().reward is None

    _serve(monkeypatch, scenario)
