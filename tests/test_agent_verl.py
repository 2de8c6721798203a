"""Agent episodes as veRL's agent loop runs them. The tool messages answering one assistant
message come in the order of its ``<tool_call>`` blocks: hermes answers carry no ids, so
the model matches them to its calls by position (a malformed block between two calls had
its error answered first, and the model read every answer against the wrong call). A
tool's ``create`` gets the trajectory's ``create_kwargs`` as veRL passes them, and a
prompt over the limit is dropped when long prompts are filtered."""

from __future__ import annotations

import asyncio

from asyncrl.tools.hermes import in_block_order, parse_tool_calls

MESSAGE = (
    "Let me compute.\n"
    '<tool_call>{"name": "mul", "arguments": {"a": 29, "b": 47}}</tool_call>\n'
    "<tool_call>{not json}</tool_call>\n"
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
)


def test_answers_follow_the_blocks_order():
    parsed = parse_tool_calls(MESSAGE)
    assert [c.name for c in parsed.calls] == ["mul", "add"] and parsed.order == [True, False, True]
    answers = [a["content"] for a in in_block_order(parsed, ["1363", "5"])]
    assert answers[0] == "1363" and answers[2] == "5"
    assert answers[1].startswith("Error: tool call 2:")


def test_calls_past_the_parallel_limit_get_no_answer_and_an_open_block_its_error():
    parsed = parse_tool_calls(MESSAGE + '\n<tool_call>{"name": "add"')
    assert parsed.order == [True, False, True, False]
    answers = [a["content"] for a in in_block_order(parsed, ["1363"])]  # max_parallel_calls=1
    assert answers[0] == "1363" and len(answers) == 3
    assert answers[1].startswith("Error: tool call 2:") and "without </tool_call>" in answers[2]


def test_a_tools_create_gets_the_create_kwargs_as_verl_passes_them():
    """veRL's agent loop calls ``create(create_kwargs=...)`` and its tools read that key
    (a ported tool saw none of its ground truth: the keywords were only spread); a tool
    that names its parameters still gets them spread, as veRL's older rollouts did."""
    from asyncrl.tools.base import BaseTool
    from asyncrl.tools.calls import call_once

    class VerlTool(BaseTool):
        async def create(self, instance_id=None, **kwargs):
            self.seen = kwargs.get("create_kwargs", {})
            return await super().create(instance_id), None  # newer veRL: (id, response)

        async def execute(self, instance_id, parameters, **kwargs):
            return {"text": str(self.seen.get("ground_truth"))}, 0.0, {}

    class NamedTool(BaseTool):
        async def create(self, instance_id=None, prefix=""):
            self.prefix = prefix
            return "x"

        async def execute(self, instance_id, parameters, **kwargs):
            return self.prefix + "ok", 0.0, {}

    schema = {"type": "function", "function": {"name": "t", "parameters": {}}}
    verl = VerlTool({}, schema)
    loop = asyncio.new_event_loop()
    try:
        got = call_once(verl, {}, {"ground_truth": "42"}, loop)
        assert got[0] == {"text": "42"}
        named = call_once(NamedTool({}, schema), {}, {"prefix": "> ", "other": 1}, loop)
        assert named[0] == "> ok"
    finally:
        loop.close()


def test_an_episode_prompt_over_the_limit_is_dropped_when_long_prompts_are_filtered():
    """With data.filter_overlong_prompts an agent task's prompt was cut from the left like
    any other (through the system line naming the tools), trained, and the log said to
    filter long prompts: it is dropped now, as a single-turn prompt is."""
    import msgspec

    from asyncrl.config import load_config
    from rollout_servers import task_groups
    from rollout_servers.agent import AgentRunner, AgentSettings
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.lanes import Lanes
    from rollout_servers.server_stats import ServerStats
    from tests.standins.chat import CharTokenizer
    from tests.standins.server_parts import StandInEngine, StandInScorer, make_task

    async def scenario(filtering: bool) -> tuple[int, int, float]:
        engine, tok = StandInEngine(), CharTokenizer()
        engine.gate.set()
        limit = ["data.max_prompt_length=8", f"data.filter_overlong_prompts={filtering}"]
        cfg = load_config(None, ["rollout.n=2", *limit])
        sampling = SamplingSettings.from_config(cfg)
        agent = AgentRunner(AgentSettings(None, None, 1, 8, 64, 30.0), sampling, engine, tok, None)
        stats = ServerStats(tok)
        groups = task_groups.TaskGroups(
            cfg, "s", engine, tok, StandInScorer(), Lanes(), sampling, stats, agent
        )
        task = msgspec.structs.replace(make_task("t"), n=2, agent_name="tool_agent")
        assert agent.prompt_len(task) > 8  # the chat markup alone is longer
        group, _, _ = await groups.make(task, 0.0)
        return len(group), engine.requests, stats.metrics["rollout/prompts_filtered_too_long"]

    assert asyncio.run(scenario(True)) == (0, 0, 1)
    kept, requests, filtered = asyncio.run(scenario(False))
    assert kept == 2 and requests >= 2 and filtered == 0


def test_a_template_that_refuses_tool_turns_ends_the_episode_not_the_group(caplog):
    """Gemma-style templates refuse a 'tool' role: the render raised out of the episode,
    cancelled its siblings, and the task failed and was dealt again until given up, a
    traceback each time. The episode ends there now (template_error), said once."""
    from asyncrl.config import load_config
    from rollout_servers.agent import AgentRunner, AgentSettings
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.samples import Sample
    from tests.standins.chat import EOT, CharTokenizer
    from tests.standins.server_parts import make_task

    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' + EOT

    class CallEngine:
        version, partial = 0, False

        def paused_s(self) -> float:
            return 0.0  # never syncs

        async def generate(self, prompt_ids, params, request_id):
            ids = [ord(c) for c in call]
            return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], "stop")

    class NoToolRole(CharTokenizer):
        def apply_chat_template(self, conversation, **kwargs):
            if any(m["role"] == "tool" for m in conversation):
                raise ValueError("Conversation roles must alternate user/assistant")
            return super().apply_chat_template(conversation, **kwargs)

    sampling = SamplingSettings.from_config(load_config(None, []))
    settings = AgentSettings(None, None, 1, 512, 512, 30.0)
    runner = AgentRunner(settings, sampling, CallEngine(), NoToolRole(), None)
    task = make_task("t")

    async def two_episodes():
        return [await runner.episode(task, i) for i in range(2)]

    with caplog.at_level("ERROR", logger="rollout_servers.agent"):
        episodes = asyncio.run(two_episodes())
    assert [ep.ended for ep in episodes] == ["template_error", "template_error"]
    assert runner.metrics["rollout/agent/episodes_ended/template_error"] == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "rollout_servers.agent"]
    assert len(lines) == 1 and "takes 'tool' messages" in lines[0]


STEP_REWARD_TOOL = """
from asyncrl.tools import BaseTool

CALLS = 0


class NapTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        global CALLS
        CALLS += 1
        return "rested", (0.25 if CALLS == 1 else None), {}  # then no step reward
"""


def test_a_multi_turn_scorer_gets_the_extra_info_verl_gives_it(tmp_path):
    """veRL's reward loop hands a multi-turn sample's scorer ``extra_info["num_turns"]``
    (tool and assistant turns, plus one), ``["tool_rewards"]`` (the tools' step rewards,
    None left out), ``["turn_scores"]`` and ``["rollout_reward_scores"]``: a ported scorer
    that read them raised KeyError here and scored 0 on every sample."""
    import json

    import msgspec

    from asyncrl.config import load_config
    from asyncrl.tools import ToolPool
    from rollout_servers import task_groups
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.lanes import Lanes
    from rollout_servers.server_stats import ServerStats
    from tests.standins.chat import CharTokenizer
    from tests.standins.server_parts import (
        N,
        StandInScorer,
        ToolCallingEngine,
        agent_runner,
        make_task,
    )

    class Recording(StandInScorer):
        jobs: list = []

        def score_many(self, items):
            self.jobs.extend(items)
            return super().score_many(items)

    (tmp_path / "nap.py").write_text(STEP_REWARD_TOOL)
    schema = {"type": "function", "function": {"name": "nap", "parameters": {}}}
    tool = {"class_name": "nap.py:NapTool", "config": {}, "tool_schema": schema}
    (tmp_path / "tools.yaml").write_text(json.dumps({"tools": [tool]}))
    scorer = Recording()
    with ToolPool(tmp_path / "tools.yaml", num_workers=1) as pool:
        engine, cfg = ToolCallingEngine(), load_config(None, [f"rollout.n={N}"])
        agent = agent_runner(engine, pool)  # two assistant turns, one tool turn each
        sampling, tok = SamplingSettings.from_config(cfg), CharTokenizer()
        groups = task_groups.TaskGroups(
            cfg, "s", engine, tok, scorer, Lanes(), sampling, ServerStats(tok), agent
        )
        task = msgspec.structs.replace(
            make_task("t"), agent_name="tool_agent", extra_info={"index": 7, "num_turns": 99}
        )
        group, _, _ = asyncio.run(groups.make(task, 0.0))
    assert len(group) == N and len(scorer.jobs) == N
    infos = sorted((job.extra_info for job in scorer.jobs), key=lambda i: i["tool_rewards"])
    assert [i["tool_rewards"] for i in infos] == [[], [0.25]]
    for info in infos:
        assert info["index"] == 7 and info["num_turns"] == 2 + 1 + 1  # the row's replaced
        assert info["turn_scores"] == [] and info["rollout_reward_scores"] == {}
    assert task.extra_info == {"index": 7, "num_turns": 99}  # the task's own is untouched
