"""veRL tools ported by their imports alone, run in real tool workers.

veRL's tools import ``ToolResponse`` and ``OpenAIFunctionToolSchema`` from
``verl.tools.schemas`` and read their schema by attribute (``self.tool_schema.function.name``);
``asyncrl.tools`` exported neither and handed tools a plain dict, so a tool "ported by
changing its import" failed at its first line. And a ``ToolResponse`` with no text (veRL's
tools return ``ToolResponse()`` with nothing to say) reached the model as an "invalid
response" error with a 0 step reward, where veRL's agent loop sends an empty answer.
"""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from asyncrl.tools import OpenAIFunctionToolSchema, ToolCall, ToolPool, ToolResponse, ToolResult

# veRL's gsm8k tool, in its current shape (create -> (id, ToolResponse), execute ->
# ToolResponse), written anew; its imports are what a port changes: from verl.tools.base_tool
# and verl.tools.schemas to asyncrl.tools, its scorer from verl.utils.reward_score to
# asyncrl.tasks.
GSM8K_TOOL = '''
import logging
import os
from typing import Any, Optional
from uuid import uuid4

from asyncrl.tasks import gsm8k
from asyncrl.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))


class Gsm8kTool(BaseTool):
    """Scores the model's gsm8k answer against the row's ground truth."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        # What veRL's tools read of their schema, by attribute.
        self.described = (
            self.tool_schema.function.name,
            self.tool_schema.function.parameters.required,
            sorted(self.tool_schema.function.parameters.properties),
        )

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(
        self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instance_dict[instance_id] = {
            "response": "", "ground_truth": ground_truth, "reward": 0.0
        }
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step = 0.0 if reward > state["reward"] else -0.05  # no better than before: a penalty
        state["reward"] = reward
        if answer == "describe":
            return ToolResponse(text=repr(self.described)), step, {}
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(
            state["response"], state["ground_truth"], method="flexible", format_score=0.0,
            score=1.0,
        )

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''

# veRL's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, in its shape.
GSM8K_CONFIG = {
    "tools": [
        {
            "class_name": "gsm8k_tool.py:Gsm8kTool",
            "config": {"type": "native"},
            "tool_schema": {
                "type": "function",
                "function": {
                    "name": "calc_gsm8k_reward",
                    "description": "A tool for calculating the reward of gsm8k",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "answer": {"type": "string", "description": "The model's answer"}
                        },
                        "required": ["answer"],
                    },
                },
            },
        }
    ]
}

EMPTY_ANSWERS = """
from asyncrl.tools import BaseTool, ToolResponse


class QuietTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        how = parameters["how"]
        if how == "model":
            return ToolResponse(), None, None
        if how == "text_none":
            return ToolResponse(text=None), 0.5, {}
        if how == "dict_none":
            return {"text": None}, None, {}
        if how == "no_text_key":
            return {"result": 7}, None, {}
        return ToolResponse(text="said"), None, {}
"""


def _config(folder: Path, tools: dict[str, Any]) -> Path:
    path = folder / "tools.yaml"
    path.write_text(yaml.safe_dump(tools))
    return path


@pytest.fixture(scope="module")
def gsm8k_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolPool]:
    folder = tmp_path_factory.mktemp("gsm8k")
    (folder / "gsm8k_tool.py").write_text(GSM8K_TOOL)
    with ToolPool(_config(folder, GSM8K_CONFIG), num_workers=1, timeout_s=10.0) as pool:
        yield pool


def test_verls_gsm8k_tool_runs_ported_by_its_imports(gsm8k_pool: ToolPool) -> None:
    truth = {"calc_gsm8k_reward": {"ground_truth": "72"}}  # the row's create_kwargs
    right, wrong, described = gsm8k_pool.call_many(
        [
            ToolCall("calc_gsm8k_reward", {"answer": "72"}),
            ToolCall("calc_gsm8k_reward", {"answer": "#### 71"}),
            ToolCall("calc_gsm8k_reward", {"answer": "describe"}),
        ],
        truth,
    )
    assert right == ToolResult("Current parsed answer='72' reward=1.0", None, 0.0)
    assert wrong == ToolResult("Current parsed answer='#### 71' reward=0.0", None, -0.05)
    # The schema as the tool read it, by attribute, in its worker.
    assert described.text == repr(("calc_gsm8k_reward", ["answer"], ["answer"]))
    assert gsm8k_pool.counters["exception"] == 0 and gsm8k_pool.counters["bad_return"] == 0


def test_a_response_without_text_is_an_empty_answer(tmp_path: Path) -> None:
    (tmp_path / "quiet.py").write_text(EMPTY_ANSWERS)
    schema = GSM8K_CONFIG["tools"][0]["tool_schema"]
    quiet = copy.deepcopy(schema)
    quiet["function"].update(name="quiet", parameters={"type": "object", "required": ["how"]})
    config = {"tools": [{"class_name": "quiet.py:QuietTool", "tool_schema": quiet}]}
    with ToolPool(_config(tmp_path, config), num_workers=1) as pool:
        calls = [ToolCall("quiet", {"how": how}) for how in ("model", "text_none", "dict_none")]
        model, text_none, dict_none = pool.call_many(calls)
        # veRL's agent loop sends `text or ""`: no error, and the step reward is the tool's.
        assert model == ToolResult("", None, None)
        assert text_none == ToolResult("", None, 0.5)
        assert dict_none == ToolResult("", None, None)
        assert pool.counters["bad_return"] == 0
        # A dict that names no text at all is still the tool's mistake.
        assert pool.call(ToolCall("quiet", {"how": "no_text_key"})).error == "bad_return"
        assert pool.call(ToolCall("quiet", {"how": "say"})) == ToolResult("said", None, None)


def test_tool_response_has_verls_fields() -> None:
    assert set(ToolResponse.model_fields) == {"text", "image", "video"}
    empty = ToolResponse()
    assert (empty.text, empty.image, empty.video) == (None, None, None) and empty.is_empty()
    assert not ToolResponse(text="hi").is_empty()
    assert ToolResponse(image=["img"]).image == ["img"]
    with pytest.raises(pydantic.ValidationError, match="must be a list"):
        ToolResponse(image="img")  # type: ignore[arg-type]  # the mistake refused


def test_the_schema_reads_as_verls_model_and_as_the_configs_dict() -> None:
    raw = copy.deepcopy(GSM8K_CONFIG["tools"][0]["tool_schema"])
    raw["function"]["parameters"]["properties"]["answer"]["items"] = {"type": "string"}
    schema = OpenAIFunctionToolSchema.model_validate(raw)
    assert schema == raw and isinstance(schema, dict)  # the config's dict, every key kept
    assert schema.type == "function" and schema.function.name == "calc_gsm8k_reward"
    assert schema["function"]["name"] == schema.function["name"] == "calc_gsm8k_reward"
    answer = schema.function.parameters.properties["answer"]
    assert answer.type == "string" and answer.enum is None and answer["items"]
    assert schema.function.parameters.required == ["answer"]
    assert schema.function.strict is False  # veRL's default, read but not stored
    assert "strict" not in schema["function"]
    # veRL's tools dump it for the chat template and print it as JSON.
    dumped = schema.model_dump(exclude_unset=True, exclude_none=True)
    assert dumped == raw and type(dumped["function"]) is dict
    assert json.loads(schema.model_dump_json(indent=2)) == raw
    # A copy, not a view: the config stays as read.
    raw["function"]["name"] = "changed"
    assert schema.function.name == "calc_gsm8k_reward"
    # Built as veRL's tools build it, and as the pool sends it around.
    built = OpenAIFunctionToolSchema(type="function", function={"name": "f"})
    assert built.function.parameters.properties == {} and built.function.description is None
    for copied in (copy.deepcopy(schema), pickle.loads(pickle.dumps(schema))):
        assert copied == schema and copied.function.parameters.required == ["answer"]
    assert OpenAIFunctionToolSchema.model_validate(schema) is schema
    with pytest.raises(AttributeError, match="no field 'nope'"):
        _ = schema.nope


def test_a_tool_built_from_a_plain_dict_reads_its_schema_both_ways() -> None:
    from asyncrl.tools import BaseTool

    tool = BaseTool({}, {"type": "function", "function": {"name": "f", "parameters": {}}})
    assert tool.name == "f" == tool.tool_schema["function"]["name"]
    assert tool.get_openai_tool_schema().function.parameters.required == []


def test_a_tool_config_a_server_would_refuse_is_named_before_any_role_starts(tmp_path):
    """veRL's own tool config names ``verl.workers.tool...``: it passed every launch check
    and each rollout server then failed at its start. The launcher now names it (and a
    config the servers cannot read) in one line with the fix, importing nothing."""
    from asyncrl.config import load_config
    from asyncrl.config.inputs import REWARD, input_problems

    schema = {"type": "function", "function": {"name": "calc_gsm8k_reward", "parameters": {}}}
    entry = {"class_name": "verl.workers.tool.gsm8k_tool.Gsm8kTool", "config": {}}
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{**entry, "tool_schema": schema}]}))
    on = ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={path}"]

    def problems() -> list[str]:
        return input_problems(load_config(None, on), [REWARD])

    (line,) = problems()
    assert "tool class 'verl.workers.tool.gsm8k_tool.Gsm8kTool': no module named 'verl'" in line
    assert "change its imports from verl.tools.* to asyncrl.tools" in line
    path.write_text("tools: []\n")
    assert problems() == [f"tool config {path} needs a non-empty 'tools:' list at the top level"]
    ported = tmp_path / "gsm8k_tool.py"
    ported.write_text(GSM8K_TOOL)
    entry["class_name"] = f"{ported}:Gsm8kTool"
    path.write_text(yaml.safe_dump({"tools": [{**entry, "tool_schema": schema}]}))
    assert problems() == []
