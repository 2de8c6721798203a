"""vLLM's own chat extensions at the OpenAI endpoint: prefill continuation, template kwargs,
guided decoding. Ignored, an agent would be served another prompt (a closed assistant
message, a thinking turn it switched off) or another distribution than it asked for, with
a 200. Refused with a 400 naming why, over HTTP on 127.0.0.1 (stand-in engine, no vLLM),
and at their no-op values they change nothing."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_endpoint_faults import USER, Rig, _serve
from tests.test_endpoint_mends import _chat

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
