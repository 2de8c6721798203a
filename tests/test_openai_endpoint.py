"""An outside agent drives a real rollout server (CPU vLLM) through the ``openai`` client:
a group of two-turn episodes with tool calls is recorded token for token, is held to the
staleness budget (429 while it is spent), reaches the buffer when both episodes have their
reward, and trains the learner with on-policy logprobs on the sampled tokens."""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from asyncrl.config import run_dir
from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import config_endpoint
from asyncrl.tasks import prepare_task_data
from asyncrl.tools import load_tool_config, schemas
from asyncrl.tools.tokens import render
from rollout_servers.chat_bodies import assistant_reply
from tests.helpers import check_on_policy_and_trains, kill_session, log_tails, wait_until
from tests.standins.learner import StandInLearner, loopback_config, model_weights, spawn_buffer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_wait = functools.partial(wait_until, timeout_s=180.0, every_s=0.2)
TOOLS = schemas(load_tool_config("configs/tools/calculator.yaml"))
MAX_RESPONSE = 200


class Rig:
    """A stand-in learner's coordinator, the buffer, and one rollout server that serves only
    the endpoint: one slot per version (train_batch_size 1, max_policy_lag 0)."""

    def __init__(self, tmp: Path, model: Path):
        prepare_task_data("arithmetic", tmp / "data", seed=0)
        self.cfg, config = loopback_config(
            tmp,
            [
                f"model.path={model}",
                f"data.train_files={tmp}/data/train.parquet",
                f"data.val_files={tmp}/data/val.parquet",
                "data.train_batch_size=1",
                "actor.ppo_mini_batch_size=1",
                "rollout.n=2",
                "staleness.max_policy_lag=0",
                "data.max_prompt_length=256",
                f"data.max_response_length={MAX_RESPONSE}",
                "rollout.max_inflight=8",
                "rollout.openai_endpoint.enable=true",
                "rollout.openai_endpoint.take_tasks=false",
                "rollout.openai_endpoint.slot_wait_s=0",  # the 429 below comes at once
                "trainer.val_before_train=false",
                "trainer.test_freq=-1",
                "control.heartbeat_s=0.5",
                "launch.start_timeout_s=120",
                "sync.timeout_s=60",
                "reward.num_workers=1",
            ],
        )
        self.tmp = tmp
        self.learner = StandInLearner(self.cfg, tensors=model_weights(str(model))).start()
        self.buffer = spawn_buffer(config, tmp / "buffer.log")
        log = open(tmp / "r0.log", "a")  # noqa: SIM115
        cmd = [sys.executable, "-m", "rollout_servers.main", str(config), "--server-id", "r0"]
        self.server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.consumer = BufferClient(config_endpoint(self.cfg.endpoints, "batches"), "test")
        try:  # a rig that fails to start leaves no process behind (its buffer outlived it)
            self.consumer.hello(wait_s=60)
            url_file = Path(run_dir(self.cfg)) / "openai_endpoints" / "r0.json"
            _wait(url_file.exists, "the server's endpoint URL", details=self.logs)
            self.url = json.loads(url_file.read_text())["base_url"]
        except BaseException:
            self.close()
            raise

    def logs(self) -> str:
        return log_tails(self.tmp, 3000)

    def chat(self, key: str, messages: list[dict]):
        client = openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)
        return client.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]  # plain dicts, as agents send them
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=60,
        )

    def reward(self, key: str, value: float) -> httpx.Response:
        root = self.url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.post(f"{root}/rl/reward", json={"reward": value}, headers=headers)

    def close(self) -> None:
        for proc in (self.server, self.buffer):
            kill_session(proc)
        self.consumer.close()
        self.learner.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory, agent_model):
    rig = Rig(tmp_path_factory.mktemp("openai"), agent_model)
    yield rig
    rig.close()


def _tool_answer(call) -> str:
    """What the agent's own tool says (the agent runs its tools, not the server)."""
    try:
        args = json.loads(call.function.arguments)
        a, b = int(args["a"]), int(args["b"])
    except (ValueError, KeyError, TypeError) as e:
        return f"Error: {e}"
    return str(a * b if call.function.name == "mul" else a + b)


def _episode(rig: Rig, key: str) -> list:
    """Two assistant turns: the agent answers a tool call with its result, anything else
    with a nudge; returns both replies."""
    messages: list[dict] = [{"role": "user", "content": "47*29="}]
    first = rig.chat(key, messages).choices[0].message
    messages.append(first.model_dump(exclude_none=True))
    for call in first.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_answer(call)})
    if not first.tool_calls:
        messages.append({"role": "user", "content": "Use the calculator."})
    second = rig.chat(key, messages).choices[0].message
    return [first, second]


def test_an_outside_agent_trains_through_the_endpoint(rig, agent_model, single_rank):
    from learner.loop import to_rollouts

    replies = {key: _episode(rig, key) for key in ("g0/a", "g0/b")}
    # The group holds the only slot of this version: a new group waits (429, retried by
    # clients that are allowed to retry).
    with pytest.raises(openai.RateLimitError) as refused:
        rig.chat("g1/a", [{"role": "user", "content": "3+4="}])
    assert refused.value.response.headers.get("Retry-After")
    assert "staleness budget (staleness.max_policy_lag=0) is full" in refused.value.message
    assert "g0' idle" in refused.value.message  # what holds it
    assert rig.reward("g0/a", 1.0).json()["group_complete"] is False
    done = rig.reward("g0/b", 0.0).json()
    assert done["group_complete"] and done["rewarded"] == 2
    # The group has left; another reward is final (409), the same one gets its answer again.
    assert rig.reward("g0/b", 1.0).status_code == 409
    assert rig.reward("g0/b", 0.0).json() == done

    batch = _wait(
        lambda: rig.consumer.request_batch(0, wait_s=1.0), "the external group", details=rig.logs
    )
    trajs = batch.trajectories
    (slot,) = {t.meta.task_id for t in trajs}  # one group: the coordinator's first slot
    assert slot.startswith("ext/") and slot.endswith("/1")
    assert {t.meta.data_source for t in trajs} == {"external"}
    assert sorted({(t.meta.episode_index, t.meta.reward) for t in trajs}) == [(0, 1.0), (1, 0.0)]
    tok = AutoTokenizer.from_pretrained(str(agent_model))
    for episode, key in enumerate(("g0/a", "g0/b")):
        samples = [t for t in trajs if t.meta.episode_index == episode]
        first = samples[0]
        end = first.meta.masked_spans[0][0] if first.meta.masked_spans else len(first.response_ids)
        sampled = list(first.response_ids[:end])
        # The reply the agent got is the one the recorded tokens say (tool calls included).
        written = tok.decode(_without_eos(sampled, tok), skip_special_tokens=False)
        shown, _ = assistant_reply(written)
        got = replies[key][0]
        assert (got.content or "") == shown["content"]
        # Arguments as sent: a malformed block's (a call cut off, say) are its raw text.
        calls = [(c.function.name, c.function.arguments) for c in got.tool_calls or []]
        assert calls == [
            (c["function"]["name"], c["function"]["arguments"]) for c in shown.get("tool_calls", [])
        ]
        # Token in, token out: the next turn extends the sample unless the chat template
        # itself does not keep the sampled tokens as a prefix of the history re-rendered
        # (the model's turn as it wrote it, as the server renders it: a call cut off, or
        # JSON spaced otherwise than json.dumps spaces it, reads back only so).
        history = [{"role": "user", "content": "47*29="}, {"role": "assistant", "content": written}]
        before = render(tok, history, TOOLS, gen=False)
        held = list(first.prompt_ids) + sampled
        if before[: len(held)] == held:  # the agent's message (and markup) inserted
            assert len(samples) == 1, "a turn the template keeps was re-rendered"
            start, length = first.meta.masked_spans[0]
            assert all(lp == 0 for lp in first.logprobs[start : start + length])
            assert "<|im_start|>" in tok.decode(list(first.response_ids[start : start + length]))
        else:  # the template rewrote the sampled tokens: a new sample, by necessity
            assert len(samples) == 2 and not first.meta.masked_spans
            assert "<|im_start|>assistant" in tok.decode(list(samples[1].prompt_ids))

    rollouts = to_rollouts(type("Batch", (), {"trajectories": trajs})())
    check_on_policy_and_trains(rollouts, agent_model, 256, MAX_RESPONSE)

    # Trained and pushed: the next version's slot opens for the waiting group.
    rig.learner.coordinator.trained(batch.task_ids)
    assert not rig.learner.push().failed
    reply = _wait(lambda: _try_chat(rig, "g1/a"), "a slot after the push", details=rig.logs)
    assert reply is not None and reply.choices[0].message.role == "assistant"
    # The same session asks with a raw prompt (/v1/completions, no chat template): a new
    # sample from the real tokenizer and engine, with its behaviour logprobs.
    client = openai.OpenAI(base_url=rig.url, api_key="g1/a", max_retries=0, timeout=120)
    raw = client.completions.create(model="tiny", prompt="3+4=", max_tokens=8, logprobs=0)
    lp = raw.choices[0].logprobs
    assert raw.usage is not None and 0 < raw.usage.completion_tokens <= 8
    assert lp is not None and len(lp.token_logprobs or []) == raw.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs or [])


def _without_eos(ids: list[int], tok) -> list[int]:
    return ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids


def _try_chat(rig: Rig, key: str):
    with contextlib.suppress(openai.RateLimitError):
        return rig.chat(key, [{"role": "user", "content": "3+4="}])
    return None


def test_bad_requests_get_one_line_errors_and_the_server_serves_on(rig):
    url, auth = rig.url, {"Authorization": "Bearer g9/a"}
    unseen = {"Authorization": "Bearer g8/a"}  # a key that sent no request
    cases = [
        (httpx.post(f"{url}/chat/completions", content=b"{not json", headers=auth), 400, "JSON"),
        (httpx.post(f"{url}/chat/completions", json={"messages": []}, headers=auth), 400, "list"),
        (
            httpx.post(
                f"{url}/chat/completions",
                json={"messages": [{"role": "user", "content": "1+1="}], "tool_choice": "required"},
                headers=auth,
            ),
            400,
            "tool_choice",
        ),
        (
            httpx.post(
                f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            ),
            401,
            "API key",
        ),
        (
            httpx.post(
                f"{url}/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}]},
                headers={"Authorization": "Bearer solo"},
            ),
            400,
            "GROUP/MEMBER",
        ),
        # g9/a was refused, so it is kept (its reward counts): a reward it lacks is a 400
        (httpx.post(f"{url.removesuffix('/v1')}/rl/reward", json={}, headers=auth), 400, "finite"),
        (httpx.post(f"{url.removesuffix('/v1')}/rl/reward", json={}, headers=unseen), 404, "g8/a"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        assert words in response.json()["error"]["message"]
    models = httpx.get(f"{url}/models").json()
    assert models["data"][0]["id"] == str(rig.cfg.model.path)
    assert rig.server.poll() is None
