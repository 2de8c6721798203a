"""Tool configs and the ToolPool on well-behaved and misbehaving tools, with real worker
processes (the text between a model and its tools: tests/test_tool_text.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncrl.tools import (
    ENVIRONMENT_ERRORS,
    TOOL_ERROR_KINDS,
    ToolCall,
    ToolPool,
    ToolResult,
    import_tool_class,
    load_tool_config,
    schemas,
)

ROOT = Path(__file__).resolve().parents[1]
CALCULATOR = ROOT / "configs" / "tools" / "calculator.yaml"
TIMEOUT_S = 1.0

HOSTILE = """
import os
import time

import numpy as np

from asyncrl.tools import BaseTool


class EchoTool(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.prefixes = {}

    async def create(self, instance_id=None, prefix="", **kwargs):
        instance_id = await super().create(instance_id)
        self.prefixes[instance_id] = prefix
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        text = self.prefixes[instance_id] + parameters["text"] * parameters.get("times", 1)
        # A numpy step reward, as tools computing one with numpy return it.
        return {"text": text}, np.float32(0.5), {"length": len(text)}

    async def release(self, instance_id, **kwargs):
        del self.prefixes[instance_id]


class HangTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(100)


class DieTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        os._exit(3)


class RaiseTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("boom")


class BadReturnTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return 42
"""


def schema(name: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    properties = {key: {"type": "string"} for key in required}
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {
        "type": "function",
        "function": {"name": name, "description": name, "parameters": parameters},
    }


def entry(class_name: str, name: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "class_name": class_name,
        "config": {"type": "native"},
        "tool_schema": schema(name, required),
    }


def write_config(path: Path, tools: list[Any]) -> Path:
    path.write_text(yaml.safe_dump({"tools": tools}))
    return path


@pytest.fixture(scope="module")
def hostile_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tools")
    (folder / "hostile.py").write_text(textwrap.dedent(HOSTILE))
    calculator = yaml.safe_load(CALCULATOR.read_text())["tools"]
    tools = calculator + [
        entry("hostile.py:EchoTool", "echo", ("text",)),  # relative to the config's folder
        *(entry(f"hostile.py:{name.title()}Tool", name) for name in ("hang", "die", "raise")),
        entry("hostile.py:BadReturnTool", "bad_return"),
    ]
    return write_config(folder / "tools.yaml", tools)


@pytest.fixture(scope="module")
def pool(hostile_config: Path):
    with ToolPool(hostile_config, num_workers=2, timeout_s=TIMEOUT_S) as pool:
        yield pool


# ------------------------------------------------------------------------------- config


def test_calculator_config_loads() -> None:
    specs = load_tool_config(CALCULATOR)
    assert [(s.name, s.class_name) for s in specs] == [
        ("add", "asyncrl.tools.calculator.AddTool"),
        ("mul", "asyncrl.tools.calculator.MulTool"),
    ]
    assert specs[0].config == {"type": "native"}
    tools = schemas(specs)
    assert [t["function"]["name"] for t in tools] == ["add", "mul"]
    assert tools[1]["function"]["parameters"]["required"] == ["a", "b"]
    tools[0]["function"]["name"] = "changed"  # a copy: the specs stay as read
    assert specs[0].schema["function"]["name"] == "add"


def test_file_class_names_resolve_from_the_config_folder(hostile_config: Path) -> None:
    echo = next(s for s in load_tool_config(hostile_config) if s.name == "echo")
    assert echo.class_name == f"{hostile_config.parent.resolve() / 'hostile.py'}:EchoTool"
    assert import_tool_class(echo.class_name).__name__ == "EchoTool"


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        (None, "non-empty 'tools:' list"),
        ([["not", "a", "mapping"]], r"tools\[0\]: each tool must be a mapping"),
        ([{"tool_schema": schema("x")}], "class_name is missing"),
        ([entry("NoDots", "x")], "must be 'package.module.ClassName'"),
        ([entry("missing.py:Tool", "x")], "tool file 'missing.py' not found.*fix class_name"),
        ([{**entry("a.B", "x"), "tool_schema": {"type": "retrieval"}}], "type: function"),
        ([{**entry("a.B", "x"), "tool_schema": {"type": "function"}}], "function must be a"),
        ([{**entry("a.B", "x"), "config": {"type": "mcp"}}], "only native tools"),
        (
            [entry("a.B", "x"), entry("a.C", "y"), entry("a.D", "x")],
            r"tools\[2\]: duplicate .*'x' .*tools\[0\]",
        ),
    ],
)
def test_bad_configs_name_the_fix(tmp_path: Path, tools: Any, message: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    with pytest.raises(ValueError, match=message) as info:
        load_tool_config(path)
    assert "\n" not in str(info.value)


def test_missing_and_unparsable_config_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a file; set rollout.multi_turn.tool_config_path"):
        load_tool_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("tools: [\n  - {class_name: a.B\n")
    with pytest.raises(ValueError, match="not valid YAML") as info:
        load_tool_config(broken)
    assert "\n" not in str(info.value)


def test_classes_that_cannot_be_imported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no module named 'no_such_package'"):
        import_tool_class("no_such_package.tools.Tool")
    with pytest.raises(ValueError, match="has no class 'DivTool'; fix class_name"):
        import_tool_class("asyncrl.tools.calculator.DivTool")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency\n")
    with pytest.raises(ValueError, match="importing tool class .*ModuleNotFoundError"):
        import_tool_class(f"{broken}:Tool")


# ----------------------------------------------------------------------------- ToolPool


def test_calculator_through_the_pool(pool: ToolPool) -> None:
    assert pool.names[:2] == ["add", "mul"]
    assert pool.call(ToolCall("add", {"a": 2, "b": "40"})) == ToolResult("42")
    big = pool.call(ToolCall("mul", {"a": "123456789", "b": 10**9}))
    assert big == ToolResult("123456789000000000")
    bad = pool.call(ToolCall("mul", {"a": 1.5, "b": 2}))
    assert bad == ToolResult("Error: a must be an integer, got 1.5")
    results = pool.call_many([ToolCall("mul", {"a": n, "b": n}) for n in range(12)])
    assert [r.text for r in results] == [str(n * n) for n in range(12)]


def test_create_kwargs_reach_create_and_rewards_come_back(pool: ToolPool) -> None:
    result = pool.call(ToolCall("echo", {"text": "hi"}), {"prefix": "> "})
    assert result == ToolResult("> hi", None, 0.5)
    calls = [ToolCall("echo", {"text": "a"}), ToolCall("add", {"a": 1, "b": 1})]
    results = pool.call_many(calls, {"echo": {"prefix": "$"}})
    assert [r.text for r in results] == ["$a", "2"]


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("left", "abababab...(truncated)"),
        ("middle", "abab...(truncated)...abab"),
        ("right", "(truncated)...abababab"),
    ],
)
def test_long_responses_are_truncated(hostile_config: Path, side: Any, expected: str) -> None:
    with ToolPool(
        hostile_config, num_workers=1, max_response_length=8, truncate_side=side
    ) as small:
        assert small.call(ToolCall("echo", {"text": "ab", "times": 50})).text == expected
        assert small.call(ToolCall("echo", {"text": "ab", "times": 4})).text == "abababab"


@pytest.mark.parametrize(
    ("call", "kind", "text"),
    [
        (
            ToolCall("div", {"a": 1}),
            "unknown_tool",
            "Error: unknown tool 'div'; available: add, mul, echo, hang, die, raise, bad_return",
        ),
        (
            ToolCall("add", {"a": 1}),
            "bad_arguments",
            "Error: tool 'add' is missing required argument(s): b",
        ),
        (
            ToolCall("add", [1, 2]),  # type: ignore[arg-type]  # what a caller might pass
            "bad_arguments",
            "Error: the arguments of tool 'add' must be a JSON object, not list",
        ),
        (ToolCall("raise", {}), "exception", "Error: tool 'raise' failed: RuntimeError: boom"),
        (
            ToolCall("bad_return", {}),
            "bad_return",
            "Error: tool 'bad_return' returned an invalid response",
        ),
    ],
)
def test_model_and_tool_errors_come_back_as_text(
    pool: ToolPool, call: ToolCall, kind: str, text: str
) -> None:
    assert kind not in ENVIRONMENT_ERRORS
    before = pool.counters[kind]
    assert pool.call(call) == ToolResult(text, kind)
    assert pool.counters[kind] == before + 1
    assert pool.call(ToolCall("add", {"a": 1, "b": 2})) == ToolResult("3")


LOUD = """
from asyncrl.tools import BaseTool


class LoudTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("sandbox connection refused " + "x" * parameters["pad"])
"""


def test_error_lines_are_never_cut_only_what_the_tool_said(
    hostile_config: Path, tmp_path: Path
) -> None:
    """A short max_tool_response_length cut the pool's own error lines like answers
    ("Error: tool 'code_interpreter' f...(truncated)...rror: sandbox connection refused"):
    the model could not read what had happened. veRL cuts only the tool's answer. The
    line's head is whole now; a raise's message (the tool's words) is cut as answers are,
    however long it was."""
    (tmp_path / "loud.py").write_text(LOUD)
    available = "available: echo, raise, bad_return, hang, loud"
    hostile = hostile_config.parent / "hostile.py"
    tools = [
        entry(f"{hostile}:EchoTool", "echo", ("text",)),
        entry(f"{hostile}:RaiseTool", "raise"),
        entry(f"{hostile}:BadReturnTool", "bad_return"),
        entry(f"{hostile}:HangTool", "hang"),
        entry("loud.py:LoudTool", "loud"),
    ]
    config = write_config(tmp_path / "tools.yaml", tools)
    expected = [
        (ToolCall("raise", {}), "Error: tool 'raise' failed: Runt...(truncated)...boom"),
        (
            ToolCall("loud", {"pad": 30_000_000}),
            "Error: tool 'loud' failed: Runt...(truncated)...xxxx",
        ),
        (ToolCall("bad_return", {}), "Error: tool 'bad_return' returned an invalid response"),
        (ToolCall("echo", {}), "Error: tool 'echo' is missing required argument(s): text"),
        (ToolCall("div", {}), f"Error: unknown tool 'div'; {available}"),
        (ToolCall("hang", {}), f"Error: tool 'hang' timed out after {TIMEOUT_S:g}s"),
    ]
    with ToolPool(
        config, num_workers=1, timeout_s=TIMEOUT_S, max_response_length=8, truncate_side="middle"
    ) as small:
        for call, text in expected:
            assert small.call(call).text == text
        # A name the model made up is quoted only so far: the line is never cut.
        long_name = small.call(ToolCall("n" * 10_000, {}))
        assert long_name.error == "unknown_tool" and len(long_name.text) < 200
        assert long_name.text.endswith(f"...(truncated)'; {available}")
        # Answers are cut as before.
        echoed = small.call(ToolCall("echo", {"text": "ab", "times": 50}))
        assert echoed.text == "abab...(truncated)...abab"


@pytest.mark.parametrize(("name", "kind"), [("hang", "timeout"), ("die", "worker_died")])
def test_environment_errors_kill_the_worker_and_the_pool_recovers(
    pool: ToolPool, name: str, kind: str
) -> None:
    assert kind in ENVIRONMENT_ERRORS and kind in TOOL_ERROR_KINDS
    before = pool.counters[kind]
    start = time.monotonic()
    result = pool.call(ToolCall(name, {}))
    elapsed = time.monotonic() - start
    assert result.error == kind
    assert result.text.startswith(f"Error: tool '{name}'")
    assert elapsed < TIMEOUT_S + 2.0
    assert pool.counters[kind] == before + 1
    # The surviving worker and the replacement both keep serving.
    for n in range(4):
        assert pool.call(ToolCall("add", {"a": n, "b": 1})) == ToolResult(str(n + 1))


def test_a_tool_that_fails_to_import_fails_the_constructor(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('bad import')\n")
    config = write_config(tmp_path / "tools.yaml", [entry("broken.py:Tool", "x")])
    start = time.monotonic()
    with pytest.raises(ValueError, match="importing tool class .*RuntimeError: bad import"):
        ToolPool(config, num_workers=1)
    missing = write_config(tmp_path / "missing.yaml", [entry("no_such_package.Tool", "x")])
    with pytest.raises(ValueError, match="no module named 'no_such_package'"):
        ToolPool(missing, num_workers=1)
    assert time.monotonic() - start < 20


BAD_REWARDS = """
from asyncrl.tools import BaseTool


class Tool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        how = parameters["how"]
        return "answer " + how, {"nan": float("nan"), "str": "0.5"}[how], {}
"""


def test_an_unreadable_step_reward_keeps_the_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Step rewards are not used: a NaN or a string one is counted and read as 0, and the
    # model still reads the tool's answer (it used to become an "invalid response" error).
    from asyncrl.tools.pool import BAD_REWARD

    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    config = write_config(tmp_path / "tools.yaml", [entry("bad_rewards.py:Tool", "t", ("how",))])
    with ToolPool(config, num_workers=1) as small:
        for how in ("nan", "str"):
            assert small.call(ToolCall("t", {"how": how})) == ToolResult(f"answer {how}", None, 0.0)
        assert small.counters[BAD_REWARD] == 2
        assert small.counters["bad_return"] == 0
    assert "step reward" in caplog.text and "reward is read as 0" in caplog.text


def test_close_stops_the_pool(hostile_config: Path) -> None:
    small = ToolPool(hostile_config, num_workers=2)
    processes = [worker.process for worker in small._pool._workers]
    assert len(processes) == 2 and all(process.is_alive() for process in processes)
    assert small.call(ToolCall("add", {"a": 1, "b": 2})) == ToolResult("3")
    small.close()
    assert not any(process.is_alive() for process in processes)
    small.close()  # idempotent
    with pytest.raises(RuntimeError, match="ToolPool is closed"):
        small.call(ToolCall("add", {"a": 1, "b": 2}))


def test_imports_stay_light() -> None:
    # Tool workers import these; they must not pull in torch, vLLM or transformers.
    script = (
        "import sys, asyncrl.tools\n"
        "heavy = ('torch', 'vllm', 'transformers', 'pyarrow', 'pandas')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
