"""Multi-turn episodes on the real CPU engine, with tools in worker processes: the tokens,
loss mask and behaviour logprobs line up across turns; the tokens between turns are the
chat template's; a template that rewrites history splits the sample; a hanging tool is
killed and the episode goes on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from asyncrl.control.messages import Task
from asyncrl.tools import ToolPool
from asyncrl.tools.tokens import render
from rollout_servers.agent import AgentRunner, AgentSettings, episode_trajectories
from rollout_servers.groups import SamplingSettings
from tests.helpers import LoopThread, check_on_policy_and_trains

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # starts vLLM engines

CALCULATOR = "configs/tools/calculator.yaml"
# Qwen3's way with thinking switched off: the generation prompt holds an empty think
# block, but a past assistant turn is rendered without one, so the history changes.
QWEN3_STYLE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + message['content'].split('</think>')[-1].lstrip('\\n') }}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def rig(agent_model):
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.engine_config import engine_args

    loop = LoopThread()
    engine = loop.run(RolloutEngine.start(engine_args(str(agent_model), max_model_len=512)))
    tok = AutoTokenizer.from_pretrained(str(agent_model))
    yield loop, engine, tok
    engine.shutdown()


def _runner(engine, tok, tools, agent_model: Path, **overrides: str) -> AgentRunner:
    args = [f"model.path={agent_model}", "data.max_prompt_length=256"]
    args += ["data.max_response_length=200", "rollout.multi_turn.enable=true"]
    cfg = load_config("configs/cpu_demo.yaml", args + [f"{k}={v}" for k, v in overrides.items()])
    sampling = SamplingSettings.from_config(cfg)
    return AgentRunner(AgentSettings.from_config(cfg), sampling, engine, tok, tools)


def _task(n: int = 6) -> Task:
    return Task(
        task_id="calc-0",
        data_source="calculator",
        prompt=[{"role": "user", "content": "47*29="}],
        ground_truth="1363",
        n=n,
        agent_name="tool_agent",
    )


def _episodes(loop, runner: AgentRunner, task: Task):
    import asyncio

    async def run():
        return await asyncio.gather(*[runner.episode(task, i) for i in range(task.n)])

    return loop.run(run())


def test_masks_logprobs_and_boundary_tokens_line_up_across_turns(rig, agent_model):
    loop, engine, tok = rig
    with ToolPool(CALCULATOR, num_workers=2, timeout_s=10) as tools:
        runner = _runner(engine, tok, tools, agent_model)
        episodes = _episodes(loop, runner, _task())
    # One sample per episode, unless the model wrote bytes that do not decode to text
    # (the re-rendered history then differs from the sampled tokens: a split).
    whole = [ep for ep in episodes if ep.tool_turns and not ep.splits]
    assert whole, "the warm-started model never called a tool"
    hf = AutoModelForCausalLM.from_pretrained(str(agent_model), dtype=torch.float32).eval()
    for piece in [p for ep in episodes for p in ep.pieces]:
        ids, n = piece.prompt_ids + piece.token_ids, len(piece.token_ids)
        assert len(piece.logprobs) == n and sum(k for _, k in piece.version_spans) == n
        masked = torch.zeros(n, dtype=torch.bool)
        for start, k in piece.masked_spans:
            masked[start : start + k] = True
        # Every sampled token's logprob is the model's (temperature 1), within 1e-4.
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids])).logits[0, len(piece.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(piece.token_ids)[:, None])
        got = torch.tensor(piece.logprobs)
        assert (got[~masked] - ref[~masked, 0]).abs().max() < 1e-4
        assert torch.all(got[masked] == 0)
    for ep in whole:
        [piece] = ep.pieces
        # Between turns: exactly the template's markup around the tool's answer.
        answers = [m["content"] for m in ep.messages if m["role"] == "tool"]
        assert len(piece.masked_spans) == len(answers) == ep.tool_turns
        for (start, k), answer in zip(piece.masked_spans, answers, strict=True):
            inserted = tok.decode(piece.token_ids[start : start + k])
            assert inserted == f"\n<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"
            assert piece.token_ids[start - 1] == tok.eos_token_id  # the sampled end of turn
        # Up to the last tool answer, the sample is the conversation as the template
        # renders it, token for token.
        start, k = piece.masked_spans[-1]
        upto = len(piece.prompt_ids) + start + k
        rendered = render(tok, ep.messages[: _last_tool(ep.messages) + 1], tools.schemas, True)
        assert rendered == (piece.prompt_ids + piece.token_ids)[:upto]
    assert runner.metrics["rollout/agent/episodes"] == len(episodes)
    group = episode_trajectories(_task(), episodes, _scores(episodes), server_id="s", created_at=0)
    assert [t.meta.episode for t in group] == [
        i for i, ep in enumerate(episodes) for _ in ep.pieces
    ]
    assert [t.loss_mask().sum() for t in group] == [
        len(p.token_ids) - sum(k for _, k in p.masked_spans) for ep in episodes for p in ep.pieces
    ]


@pytest.fixture(scope="module")
def qwen3_model(agent_model, tmp_path_factory):
    """The agent model taught, in a few steps, to write its call after the empty think
    block of the Qwen3-style generation prompt; saved with that template."""
    from asyncrl.prepare.agent_warmstart import episode_tokens, tool_schemas
    from asyncrl.prepare.warmstart import supervised
    from asyncrl.tasks import calculator

    out = tmp_path_factory.mktemp("models") / "tiny-agent-qwen3"
    tok = AutoTokenizer.from_pretrained(str(agent_model))
    tok.chat_template = QWEN3_STYLE
    model = AutoModelForCausalLM.from_pretrained(str(agent_model), dtype=torch.float32)
    train, _ = calculator.generate(n_train=500, n_val=0, seed=1)
    problems = [calculator.problem_of(r["prompt"][0]["content"]) for r in train]

    def first_turns(tok, batch):  # the call only: this template cannot carry on a sample
        rows = [episode_tokens(tok, calculator.conversation(p)[:2], tool_schemas()) for p in batch]
        width = max(len(r) for r, _ in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        for i, (r, lab) in enumerate(rows):
            ids[i, : len(r)], labels[i, : len(lab)] = torch.tensor(r), torch.tensor(lab)
        return ids, labels

    supervised(model, tok, problems, steps=60, batch_size=32, make_batch=first_turns)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_template_that_rewrites_history_splits_the_sample(qwen3_model):
    from rollout_servers.engine import RolloutEngine
    from rollout_servers.engine_config import engine_args

    loop = LoopThread()
    engine = loop.run(RolloutEngine.start(engine_args(str(qwen3_model), max_model_len=512)))
    qwen3 = AutoTokenizer.from_pretrained(str(qwen3_model))
    try:
        with ToolPool(CALCULATOR, num_workers=2, timeout_s=10) as tools:
            runner = _runner(engine, qwen3, tools, qwen3_model)
            episodes = _episodes(loop, runner, _task())
    finally:
        engine.shutdown()
    split = [ep for ep in episodes if ep.tool_turns]
    assert split, "the warm-started model never called a tool"
    for ep in split:
        assert ep.splits == ep.tool_turns and len(ep.pieces) == 1 + ep.splits
        assert not any(p.masked_spans for p in ep.pieces)  # nothing appended to a sample
        # Each new sample starts from the history as the template renders it now.
        turns = [i for i, m in enumerate(ep.messages) if m["role"] == "assistant"]
        for k, piece in enumerate(ep.pieces[1:], 1):
            upto = turns[k] if k < len(turns) else len(ep.messages)
            assert piece.prompt_ids == render(qwen3, ep.messages[:upto], tools.schemas, True)
    group = episode_trajectories(_task(), episodes, _scores(episodes), server_id="s", created_at=0)
    assert len(group) == sum(len(ep.pieces) for ep in episodes)
    assert {t.meta.episode for t in group} == set(range(len(episodes)))


def test_a_hanging_tool_is_killed_at_its_timeout_and_the_episode_goes_on(
    rig, agent_model, tmp_path
):
    loop, engine, tok = rig
    (tmp_path / "stuck.py").write_text(
        "import time\n"
        "from asyncrl.tools import BaseTool\n\n"
        "class Stuck(BaseTool):\n"
        "    async def execute(self, instance_id, parameters, **kwargs):\n"
        "        time.sleep(100)\n"
        "        return 'never', 0.0, {}\n"
    )
    config = "tools:\n" + "".join(
        f"  - class_name: {tmp_path / 'stuck.py'}:Stuck\n"
        f"    config: {{type: native}}\n"
        f"    tool_schema: {{type: function, function: {{name: {name}, description: x, "
        f"parameters: {{type: object, properties: {{}}, required: []}}}}}}\n"
        for name in ("add", "mul")
    )
    (tmp_path / "tools.yaml").write_text(config)
    with ToolPool(tmp_path / "tools.yaml", num_workers=2, timeout_s=1.0) as tools:
        runner = _runner(engine, tok, tools, agent_model)
        started = time.monotonic()
        episodes = _episodes(loop, runner, _task(n=2))
        took = time.monotonic() - started
    answers = [m["content"] for ep in episodes for m in ep.messages if m["role"] == "tool"]
    timeouts = [a for a in answers if "timed out after 1s" in a]
    assert timeouts, f"no call reached the stuck tool: {answers}"
    assert runner.metrics["rollout/agent/tool_errors/timeout"] == len(timeouts)
    for ep in episodes:  # told of the timeout, the model took its next turn
        if any("timed out" in m["content"] for m in ep.messages if m["role"] == "tool"):
            assert ep.turns >= 2 and ep.messages[-1]["role"] == "assistant"
    calls = sum(ep.tool_calls for ep in episodes)
    assert took < 30 + calls * 2.5, took  # each call costs its timeout (plus a respawn)


def _last_tool(messages) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "tool")


def _scores(episodes):
    from asyncrl.rewards import ScoreResult

    return [ScoreResult(float(i % 2)) for i in range(len(episodes))]


def test_episodes_reach_the_learner_on_policy_and_train(rig, agent_model, single_rank):
    """Through the wire into the learner: on sampled tokens the learner's logprobs are the
    engine's (same weights), and a step on the group trains."""
    from asyncrl import wire
    from learner.loop import to_rollouts

    loop, engine, tok = rig
    with ToolPool(CALCULATOR, num_workers=2, timeout_s=10) as tools:
        runner = _runner(engine, tok, tools, agent_model)
        episodes = _episodes(loop, runner, _task(n=4))
    group = episode_trajectories(
        _task(n=4), episodes, _scores(episodes), server_id="s", created_at=0
    )
    back = wire.decode_trajectories(wire.encode_trajectories(group))
    rollouts = to_rollouts(type("Batch", (), {"trajectories": back})())
    check_on_policy_and_trains(rollouts, agent_model, 256, 200)
