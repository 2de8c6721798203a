"""Agent episodes and their tools where the tools or the data misbehave.

A tool that printed hundreds of megabytes sent it all to the server before it was cut. A
veRL tool returning ``None`` as its step reward (SandboxFusionTool does) lost its answer. A
call nested too deeply for the JSON parser failed the whole group. A malformed
``extra_info.tools_kwargs`` failed every deal of its row at the first call. An answer
holding a lone surrogate ended its episode blaming the chat template. A weight-sync pause
during a tool call counted against the episode's deadline. A tool module that loads much on
import could not be given more start-up time. And episodes ignored ``data.truncation``.

Real worker pools, the real agent runner, a character tokenizer and scripted engines."""

from __future__ import annotations

import asyncio
import logging
import pickle
import textwrap
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from asyncrl.config import load_config
from asyncrl.control.messages import Task
from asyncrl.sandbox import workers
from asyncrl.tasks.parquet import read_rows, row_problem, write_rows
from asyncrl.tools import ToolCall, ToolPool, ToolResult, parse_tool_calls, truncate_response
from rollout_servers.agent import AgentRunner, AgentSettings
from rollout_servers.episodes import Episode
from rollout_servers.groups import PromptTooLong, SamplingSettings
from rollout_servers.samples import Sample
from rollout_servers.task_groups import gather_or_cancel
from tests.standins.chat import EOT, CharTokenizer
from tests.standins.server_parts import make_task

LIMIT = 64  # the pool's max_response_length
SIDE = "right"  # not the default, so the worker is seen to cut on the configured side
HUGE_CHARS = 8 * 1024 * 1024

TOOLS = f"""
import time

from asyncrl.tools import BaseTool


class HugeTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "head" + "x" * {HUGE_CHARS} + "the end of a huge answer", 0.0, {{}}


class SandboxLikeTool(BaseTool):  # veRL's SandboxFusionTool: (ToolResponse, None, None)
    async def execute(self, instance_id, parameters, **kwargs):
        return {{"text": "hello from the sandbox"}}, None, None


class SurrogateTool(BaseTool):  # subprocess output decoded with surrogateescape
    async def execute(self, instance_id, parameters, **kwargs):
        return b"ls: \\xff\\xfe file".decode("utf-8", "surrogateescape"), 0.0, {{}}


class NapTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(float(parameters.get("s", 1.0)))
        return "rested", 0.0, {{}}


class PlainTool(BaseTool):  # a ported tool whose execute is a plain function
    def execute(self, instance_id, parameters, **kwargs):
        return "plain answer", 0.0, {{}}


class KwTool(BaseTool):
    async def create(self, instance_id=None, **kwargs):
        self.seen = kwargs.get("create_kwargs", {{}})
        return "id"

    async def execute(self, instance_id, parameters, **kwargs):
        return repr(self.seen), 0.0, {{}}
"""
NAMES = {"huge": "HugeTool", "noner": "SandboxLikeTool", "surr": "SurrogateTool"}
NAMES |= {"nap": "NapTool", "kw": "KwTool", "plain": "PlainTool"}


def _entry(cls: str, name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {}}
    function = {"name": name, "description": name, "parameters": parameters}
    schema = {"type": "function", "function": function}
    return {"class_name": cls, "config": {"type": "native"}, "tool_schema": schema}


def _write_tools(folder: Path, source: str, names: dict[str, str]) -> Path:
    (folder / "mended.py").write_text(textwrap.dedent(source))
    tools = [_entry(f"mended.py:{cls}", name) for name, cls in names.items()]
    path = folder / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    return path


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory):
    config = _write_tools(tmp_path_factory.mktemp("tools"), TOOLS, NAMES)
    with ToolPool(
        config, num_workers=1, timeout_s=5.0, max_response_length=LIMIT, truncate_side=SIDE
    ) as tools:
        yield tools


class Utf8Tokenizer(CharTokenizer):
    """Encodes as a real tokenizer must: through UTF-8, which refuses lone surrogates."""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate, as HF's tokenizers
        return super().encode(text)


class Scripted:
    """Answers each turn with the next of ``turns`` (the last one again after that); calls
    ``on_turn(i)`` first, if given. Records each turn's prompt."""

    version, partial = 0, False

    def __init__(self, turns: list[str], on_turn: Any = None) -> None:
        self.turns, self.on_turn = turns, on_turn
        self.prompts: list[list[int]] = []
        self.paused = 0.0

    def paused_s(self) -> float:
        return self.paused

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> Sample:
        if self.on_turn is not None:
            self.on_turn(len(self.prompts))
        self.prompts.append(list(prompt_ids))
        text = self.turns[min(len(self.prompts) - 1, len(self.turns) - 1)] + EOT
        ids = [ord(c) for c in text]
        return Sample(ids, [-0.1] * len(ids), [(0, len(ids))], "stop")


def call(name: str, arguments: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def _runner(
    engine: Any,  # a stand-in: only the GenerationEngine parts an episode uses
    tools: ToolPool | None,
    tok: CharTokenizer | None = None,
    overrides: tuple[str, ...] = (),
) -> AgentRunner:
    cfg = load_config(
        None,
        [
            "rollout.multi_turn.enable=true",
            "data.max_prompt_length=512",
            "data.max_response_length=512",
            *overrides,
        ],
    )
    settings = AgentSettings.from_config(cfg)
    return AgentRunner(
        settings, SamplingSettings.from_config(cfg), engine, tok or CharTokenizer(), tools
    )


def _task(**fields: Any) -> Task:
    return msgspec.structs.replace(make_task("t"), n=1, agent_name="tool_agent", **fields)


def _tool_answers(ep: Episode) -> list[str]:
    return [m["content"] for m in ep.messages if m["role"] == "tool"]


# ------------------------------------------------------------------- 1. huge answers


def test_a_huge_answer_is_cut_in_the_worker_before_it_reaches_the_server(
    pool: ToolPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    replies: list[int] = []  # the pickled size of each reply the server received
    run = workers.Worker.run

    def measured(self: workers.Worker, job: Any, timeout_s: float) -> tuple[str, Any]:
        answer = run(self, job, timeout_s)
        replies.append(len(pickle.dumps(answer)))
        return answer

    monkeypatch.setattr(workers.Worker, "run", measured)
    result = pool.call(ToolCall("huge", {}))
    full = "head" + "x" * HUGE_CHARS + "the end of a huge answer"
    assert result == ToolResult(truncate_response(full, LIMIT, SIDE))  # the rule of old
    assert result.text.endswith("the end of a huge answer")
    assert replies and max(replies) < 4096  # not the 8 MB


# -------------------------------------------------------------- 2. a None step reward


def test_a_none_step_reward_and_metrics_keep_the_answer(pool: ToolPool) -> None:
    before = pool.counters["bad_return"]
    assert pool.call(ToolCall("noner", {})) == ToolResult("hello from the sandbox", None, None)
    assert pool.counters["bad_return"] == before


# ------------------------------------------------------------- 3. deeply nested calls


def test_a_call_nested_too_deeply_is_the_models_malformed_call_not_the_groups_end() -> None:
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"  # past the parser's recursion limit
    parsed = parse_tool_calls(deep)
    assert not parsed.calls and "nested too deeply" in parsed.errors[0]
    long_int = call("kw", '"{\\"a\\": ' + "1" * 5000 + '}"')  # past int()'s digit limit
    assert "not valid JSON" in parse_tool_calls(long_int).errors[0]

    engine = Scripted([deep, "done"])  # one episode calls so, the others answer at once
    runner = _runner(engine, None, overrides=("data.max_response_length=16384",))
    task = msgspec.structs.replace(_task(), n=3)

    async def group() -> list[Episode]:
        return await gather_or_cancel(*[runner.episode(task, i) for i in range(task.n)])

    episodes = asyncio.run(group())
    assert [ep.ended for ep in episodes] == ["done"] * 3
    assert any("nested too deeply" in a for ep in episodes for a in _tool_answers(ep))


# ------------------------------------------------------------ 4. malformed tools_kwargs


def _row(extra_info: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_source": "x",
        "prompt": [{"role": "user", "content": "hi"}],
        "reward_model": {"ground_truth": "1", "style": "rule"},
        "extra_info": extra_info,
    }


@pytest.mark.parametrize(
    ("tools_kwargs", "where"),
    [
        ('{"kw": {"create_kwargs": {"a": 1}}}', "tools_kwargs is a str"),
        ({"kw": {"create_kwargs": "abc"}}, "tools_kwargs['kw']['create_kwargs'] is a str"),
        ({"kw": "abc"}, "tools_kwargs['kw'] is a str"),
    ],
)
def test_a_malformed_tools_kwargs_is_refused_when_the_data_is_read(
    tmp_path: Path, tools_kwargs: Any, where: str
) -> None:
    path = write_rows([_row({"index": 0, "tools_kwargs": tools_kwargs})], tmp_path / "t.parquet")
    with pytest.raises(ValueError) as refused:
        read_rows(path)
    line = str(refused.value)
    assert line.startswith(f"drop or mend row 0 of {path}: its extra_info.{where}")
    assert "write it as a struct" in line and "\n" not in line


def test_well_formed_tools_kwargs_pass(tmp_path: Path) -> None:
    good = {"kw": {"create_kwargs": {"a": 1}}, "other": None}
    assert read_rows(write_rows([_row({"tools_kwargs": good})], tmp_path / "a.parquet"))
    as_map = [("kw", [("create_kwargs", [("a", 1)])])]  # how parquet maps read
    assert row_problem(_row({"tools_kwargs": as_map}), 0, "f", "prompt") is None
    assert (
        row_problem(_row({"tools_kwargs": {"kw": {"create_kwargs": None}}}), 0, "f", "prompt")
        is None
    )


def test_an_episode_runs_its_tools_past_a_malformed_tools_kwargs(
    pool: ToolPool, caplog: pytest.LogCaptureFixture
) -> None:
    """A task from elsewhere than the checked data: the tool runs without the keywords."""
    for bad in ('{"kw": {"create_kwargs": {"a": 1}}}', {"kw": {"create_kwargs": "abc"}}):
        runner = _runner(Scripted([call("kw"), "done"]), pool)
        with caplog.at_level(logging.WARNING, logger="rollout_servers.agent"):
            ep = asyncio.run(runner.episode(_task(extra_info={"tools_kwargs": bad}), 0))
        assert ep.ended == "done" and _tool_answers(ep) == ["{}"]
    assert "extra_info.tools_kwargs" in caplog.text
    good = {"tools_kwargs": {"kw": {"create_kwargs": [["a", 1]]}}}  # a map sent on as lists
    ep = asyncio.run(
        _runner(Scripted([call("kw"), "done"]), pool).episode(_task(extra_info=good), 0)
    )
    assert _tool_answers(ep) == ["{'a': 1}"]


# ------------------------------------------------------------- 5. undecodable answers


def test_an_answer_with_a_lone_surrogate_reaches_the_model_as_valid_text(pool: ToolPool) -> None:
    result = pool.call(ToolCall("surr", {}))
    assert result == ToolResult("ls: ?? file")
    runner = _runner(Scripted([call("surr"), "done"]), pool, Utf8Tokenizer())
    ep = asyncio.run(runner.episode(_task(), 0))
    assert ep.ended == "done" and _tool_answers(ep) == ["ls: ?? file"]


# ------------------------------------------------------- 6. a sync during a tool call


def _nap_episode(pool: ToolPool, sync_s: float | None) -> Episode:
    """A 1 s tool call in a 0.5 s episode; a 5 s sync pause ``sync_s`` into it (None: none)."""
    engine = Scripted([call("nap", '{"s": 1.0}'), "done"])

    def on_turn(turn: int) -> None:
        if turn == 0 and sync_s is not None:

            def pause() -> None:
                engine.paused += 5.0

            asyncio.get_running_loop().call_later(sync_s, pause)

    engine.on_turn = on_turn
    runner = _runner(engine, pool, overrides=("rollout.multi_turn.episode_timeout_s=0.5",))
    return asyncio.run(runner.episode(_task(), 0))


def test_a_sync_pause_during_a_tool_call_moves_the_episode_deadline_on(pool: ToolPool) -> None:
    started = time.monotonic()
    assert _nap_episode(pool, None).ended == "timeout"  # the setting: the call outlasts it
    ep = _nap_episode(pool, 0.2)
    assert ep.ended == "done" and _tool_answers(ep) == ["rested"]
    assert time.monotonic() - started < 10


# ------------------------------------------------------- 7. the tools' start-up limit


def test_the_tool_start_up_limit_is_a_config_key_named_with_its_fix(tmp_path: Path) -> None:
    from rollout_servers.main import _tools

    source = "import time\ntime.sleep(30)  # a heavy import\n" + TOOLS
    config = _write_tools(tmp_path, source, {"nap": "NapTool"})
    assert load_config(None, []).rollout.multi_turn.tool_startup_timeout_s == 60.0
    with pytest.raises(ValueError):
        load_config(None, ["rollout.multi_turn.tool_startup_timeout_s=0"])
    keys = ["enable=true", f"tool_config_path={config}", "tool_startup_timeout_s=1.0"]
    cfg = load_config(None, [f"rollout.multi_turn.{kv}" for kv in keys])
    started = time.monotonic()
    with pytest.raises(ValueError) as refused:
        _tools(cfg)
    assert time.monotonic() - started < 15  # not the 60 s default
    assert (
        "move heavy loading out of the tool module's import, or raise "
        "rollout.multi_turn.tool_startup_timeout_s" in str(refused.value)
    )


# ------------------------------------------------------------------ 8. data.truncation


def _long_task(**fields: Any) -> Task:
    return _task(prompt=[{"role": "user", "content": "y" * 600}], **fields)


def test_an_episode_prompt_is_cut_as_data_truncation_says(pool: ToolPool) -> None:
    starts = "[" + ",".join(pool.names) + "]"  # the line naming the tools
    for mode, kept_start in (("left", False), ("right", True), ("middle", True)):
        engine = Scripted(["done"])
        runner = _runner(engine, pool, overrides=(f"data.truncation={mode}",))
        assert asyncio.run(runner.episode(_long_task(), 0)).ended == "done"
        prompt = "".join(map(chr, engine.prompts[0]))
        assert len(prompt) == 512 and prompt.startswith(starts) is kept_start, mode
        assert prompt.endswith("<assistant>") is (mode != "right"), mode


def test_an_episode_prompt_over_the_limit_is_refused_with_truncation_error(
    pool: ToolPool,
) -> None:
    engine = Scripted(["done"])
    runner = _runner(engine, pool, overrides=("data.truncation=error",))
    with pytest.raises(PromptTooLong, match="data.truncation=error: set data.filter_overlong"):
        asyncio.run(runner.episode(_long_task(), 0))
    assert not engine.prompts  # refused before any turn
    # A validation prompt with long prompts filtered is cut at the left, as single-turn's.
    filtering = ("data.truncation=error", "data.filter_overlong_prompts=true")
    runner = _runner(engine, pool, overrides=filtering)
    assert asyncio.run(runner.episode(_long_task(validation=True), 0)).ended == "done"


def test_a_tool_whose_execute_is_a_plain_function_answers(pool: ToolPool) -> None:
    """Found while mending the others: a tool defining ``def execute`` (not ``async``)
    failed every call on the ``await``."""
    assert pool.call(ToolCall("plain", {})) == ToolResult("plain answer", None, 0.0)


def test_a_call_the_parser_reads_but_too_deep_for_the_workers_pipe_is_malformed() -> None:
    """Found by a review: arguments nested about 500 to 980 levels deep parse, but
    pickling them for the sandbox's worker recursed too deeply. The error escaped the
    pool: the worker was replaced, the group cancelled and dealt again, and nothing was
    counted as a malformed call. Past 64 levels a call is the model's malformed one."""
    nested = '{"a": ' + "[" * 600 + "]" * 600 + "}"
    block = '<tool_call>{"name": "echo", "arguments": ' + nested + "}</tool_call>"
    parsed = parse_tool_calls(block)
    assert not parsed.calls and "nested too deeply" in parsed.errors[0]
    shallow = '{"a": ' + "[" * 60 + "]" * 60 + "}"
    ok = parse_tool_calls('<tool_call>{"name": "echo", "arguments": ' + shallow + "}</tool_call>")
    assert len(ok.calls) == 1 and not ok.errors

    engine = Scripted([block, "done"])
    runner = _runner(engine, None, overrides=("data.max_response_length=16384",))
    task = msgspec.structs.replace(_task(), n=2)

    async def group() -> list[Episode]:
        return await gather_or_cancel(*[runner.episode(task, i) for i in range(task.n)])

    episodes = asyncio.run(group())
    assert [ep.ended for ep in episodes] == ["done"] * 2
    assert any("nested too deeply" in a for ep in episodes for a in _tool_answers(ep))


OWN_LOOP_TOOLS = """
import asyncio

from asyncrl.tools import BaseTool


async def _fetch(text):
    await asyncio.sleep(0)
    return "fetched " + text


class SyncWrapperTool(BaseTool):  # a plain def over an async client, as ported tools are
    def create(self, instance_id=None, **kwargs):
        return asyncio.run(asyncio.sleep(0, result="id"))

    def execute(self, instance_id, parameters, **kwargs):
        return asyncio.run(_fetch(parameters.get("q", ""))), 0.0, {}

    def release(self, instance_id, **kwargs):
        asyncio.run(asyncio.sleep(0))


class AsyncTool(BaseTool):  # veRL's: coroutines on the worker's loop, which lasts
    async def execute(self, instance_id, parameters, **kwargs):
        loop = asyncio.get_running_loop()
        same = getattr(AsyncTool, "loop", loop) is loop
        AsyncTool.loop = loop
        return f"same loop: {same}", 0.0, {}
"""


def test_a_plain_tool_method_may_run_an_event_loop_of_its_own(tmp_path: Path) -> None:
    """Found by a review: plain ``def`` tool methods were called inside the worker's
    running loop, so one that ran its own (``asyncio.run`` over an async client) failed
    every call as an exception. They run with no loop running now; async methods still
    share the worker's one loop."""
    names = {"wrapped": "SyncWrapperTool", "native": "AsyncTool"}
    config = _write_tools(tmp_path, OWN_LOOP_TOOLS, names)
    with ToolPool(config, num_workers=1, timeout_s=5.0) as tools:
        assert tools.call(ToolCall("wrapped", {"q": "x"})) == ToolResult("fetched x", None, 0.0)
        for _ in range(2):
            assert tools.call(ToolCall("native", {})).text == "same loop: True"
        assert tools.counters["exception"] == 0
