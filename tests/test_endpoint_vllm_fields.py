"""vLLM's own chat extensions at the OpenAI endpoint: prefill continuation, template kwargs,
guided decoding. Ignored, an agent would be served another prompt (a closed assistant
message, a thinking turn it switched off) or another distribution than it asked for, with
a 200. Refused with a 400 naming why, over HTTP on 127.0.0.1 (stand-in engine, no vLLM),
and at their no-op values they change nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.test_endpoint_faults import USER, Rig, _serve
from tests.test_endpoint_mends import _chat, _send

PREFILL = [USER, {"role": "assistant", "content": "The answer is"}]

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final"),
    ({"add_generation_prompt": False}, "generation prompt"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "tokenizer_config.json"),
    ({"chat_template": "{{ messages }}"}, "chat template"),
    ({"guided_json": {"type": "object"}}, "ask for the format in the prompt"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "constrained decoding"),
    ({"min_tokens": 5}, "where the policy ends it"),
]


@pytest.mark.parametrize(("extra", "named"), REFUSED, ids=[next(iter(e)) for e, _ in REFUSED])
def test_a_vllm_field_that_changes_the_prompt_or_the_distribution_is_a_400(
    monkeypatch, extra: dict[str, Any], named: str
):
    async def scenario(rig: Rig) -> None:
        status, retry, body = await _chat(rig, "g/0", PREFILL, **extra)
        message = body["error"]["message"]
        assert status == 400 and retry == "false", body
        assert next(iter(extra)) in message and named in message, message
        assert rig.engine.calls == 0

    _serve(monkeypatch, scenario)


def test_the_same_fields_at_their_no_op_values_are_served(monkeypatch):
    async def scenario(rig: Rig) -> None:
        same = {
            "continue_final_message": False,
            "add_generation_prompt": True,
            "chat_template_kwargs": {},
            "guided_json": None,
            "min_tokens": 0,
        }
        status, _, body = await _chat(rig, "g/0", [USER], **same)
        assert status == 200 and rig.engine.calls == 1, body

    _serve(monkeypatch, scenario)


RAW_REFUSED: list[dict[str, Any]] = [
    {"guided_json": {"type": "object"}},
    {"min_tokens": 5},
    {"response_format": {"type": "json_object"}},
]


@pytest.mark.parametrize("extra", RAW_REFUSED, ids=[next(iter(e)) for e in RAW_REFUSED])
def test_a_raw_completion_refuses_what_would_constrain_it_too(monkeypatch, extra):
    async def scenario(rig: Rig) -> None:
        body = {"model": "m", "prompt": "2+2=", **extra}
        status, _, answer = await _send(rig, "/v1/completions", "g/0", body)
        assert status == 400 and next(iter(extra)) in answer["error"]["message"], answer
        assert rig.engine.calls == 0
        # a chat-template field means nothing to a raw prompt: it is not looked at
        body = {"model": "m", "prompt": "2+2=", "add_generation_prompt": False}
        assert (await _send(rig, "/v1/completions", "g/0", body))[0] == 200

    _serve(monkeypatch, scenario)


def test_a_streamed_reply_written_whole_is_seen(monkeypatch):
    async def scenario(rig: Rig) -> None:
        status, _, _ = await _send(
            rig, "/v1/chat/completions", "g/0", {"model": "m", "messages": [USER]}
        )
        assert status == 200 and not rig.session().unseen
        body = {"model": "m", "messages": [USER, USER], "stream": True}
        headers = {"Authorization": "Bearer g/0"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{rig.base}/v1/chat/completions", json=body, headers=headers) as r,
        ):
            assert r.status == 200 and b"[DONE]" in await r.read()
        await asyncio.sleep(0.05)
        assert not rig.session().unseen and rig.session().episode.turns == 2

    _serve(monkeypatch, scenario)
