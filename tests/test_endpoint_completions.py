"""``POST /v1/completions`` as agents that write their own prompt text call it: the real
endpoint served on 127.0.0.1 (a character tokenizer and a stand-in engine, no vLLM), asked
with openai-python. Each request is a new sample of its session, tokenized as it came."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from rollout_servers import endpoint_turns
from tests.standins.chat import ReplyEngine
from tests.test_endpoint_clients import _post
from tests.test_endpoint_faults import USER, Rig, _serve


class BudgetEngine(ReplyEngine):
    """Keeps the token budget each request was sampled with (``turn_params`` is patched
    to pass it through as the parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.budgets: list[Any] = []

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        self.budgets.append(params)
        return await super().generate(prompt_ids, params, request_id)


def _client(rig: Rig, key: str = "g/0") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{rig.base}/v1", api_key=key, max_retries=0)


def _budget_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_turns, "turn_params", lambda *args: args[-1])


def test_a_completion_is_a_new_sample_of_its_session_with_its_logprobs(monkeypatch):
    async def scenario(rig: Rig) -> None:
        _budget_through(monkeypatch)
        engine = rig.endpoint.turns.engine = BudgetEngine()  # type: ignore[assignment]
        async with _client(rig) as client:
            first = await client.completions.create(model="m", prompt="1+1=", logprobs=0)
            again = await client.completions.create(
                model="m", prompt=[49, 43, 50, 61], max_tokens=300, stop=["k"]
            )
        choice = first.choices[0]
        assert (choice.text, choice.finish_reason) == ("ok", "stop")
        assert first.object == "text_completion" and first.usage.prompt_tokens == 4
        ep = rig.session().episode
        assert [p.prompt_ids for p in ep.pieces] == [[ord(c) for c in "1+1="], [49, 43, 50, 61]]
        assert choice.logprobs is not None
        assert choice.logprobs.token_logprobs == ep.pieces[0].logprobs
        assert choice.logprobs.text_offset == [0, 1, 2]
        # the API's default of 16 tokens; an asked budget is kept; stop cuts the sample
        assert engine.budgets == [16, 300]
        assert again.choices[0].text == "o" and ep.pieces[1].token_ids == [ord("o"), ord("k")]
        assert rig.endpoint.metrics["rollout/openai/raw_samples"] == 2
        # a chat request after them starts a sample of its own, rendered by the template
        status, body = await rig.chat([USER])
        assert status == 200 and len(ep.pieces) == 2, body
        assert len(rig.session().episode.pieces) == 3
        assert (await rig.reward({"reward": 1.0}))[0] == 200

    _serve(monkeypatch, scenario)


def test_a_resent_completion_gets_the_same_reply_and_a_stream_carries_it(monkeypatch):
    async def scenario(rig: Rig) -> None:
        body = {"model": "m", "prompt": "2+2="}
        status, first = await _post(rig, body, path="/v1/completions")
        assert status == 200, first
        retry = {"Authorization": "Bearer g/0", "x-stainless-retry-count": "1"}
        assert await _post(rig, body, retry, path="/v1/completions") == (200, first)
        assert len(rig.session().episode.pieces) == 1
        async with _client(rig, "g/1") as client:
            stream = await client.completions.create(
                model="m", prompt="3+3=", stream=True, stream_options={"include_usage": True}
            )
            chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "ok"
        assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "stop"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3

    _serve(monkeypatch, scenario)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"n": 2}, "n must be 1"),
        ({"n": 0}, "n must be 1"),
        ({"best_of": 3}, "best_of must be 1"),
        ({"echo": True}, "echo is not supported"),
        ({"suffix": "x"}, "suffix is not supported"),
        ({"logprobs": 5}, "logprobs=5: only 0 is served"),
        ({"prompt": ""}, "prompt must be a non-empty string"),
        ({"prompt": [1, -2]}, "prompt must be a non-empty string"),
        ({"prompt": ["a", "b"]}, "prompt must be a non-empty string"),
        ({"prompt": "x" * 600}, "exceeds data.max_prompt_length=512"),
        ({"prompt": [1, 10**9]}, "not in the tokenizer's vocabulary of 1114112"),
        ({"stop": ["x"] * 33}, "stop takes at most 32 strings of at most 512 characters"),
        ({"stop": "x" * 513}, "(got 1, the longest 513)"),
    ],
)
def test_what_a_completion_cannot_serve_is_a_400_naming_why(monkeypatch, extra, says):
    async def scenario(rig: Rig) -> None:
        status, body = await _post(
            rig, {"model": "m", "prompt": "1=", **extra}, path="/v1/completions"
        )
        assert status == 400 and says in body["error"]["message"], body
        assert not rig.endpoint.groups.by_name  # nothing holds a slot

    _serve(monkeypatch, scenario)
