"""Tools for multi-turn rollouts: a veRL-format tool config, hermes tool-call parsing, and a
killable worker pool that runs the tools.

- :func:`load_tool_config` reads ``rollout.multi_turn.tool_config_path`` (veRL's YAML
  format) without importing any tool; :func:`schemas` gives the chat template's ``tools=``.
- :class:`BaseTool` has veRL's method names, and :class:`ToolResponse` and
  :class:`OpenAIFunctionToolSchema` are veRL's (``verl.tools.schemas``), so a veRL tool
  ports by changing its imports from ``verl.tools.*`` to ``asyncrl.tools``.
- :func:`parse_tool_calls` finds ``<tool_call>`` blocks in an assistant message.
- :class:`ToolPool` runs calls in worker processes with a timeout: a stuck or crashing
  tool costs one call (an environment error, see :data:`ENVIRONMENT_ERRORS`), never the
  rollout's progress.

Importing this package loads no torch, vLLM or transformers.
"""

from asyncrl.tools.base import BaseTool
from asyncrl.tools.calls import truncate_response
from asyncrl.tools.config import ToolSpec, import_tool_class, load_tool_config, schemas
from asyncrl.tools.hermes import ParsedToolCalls, ToolCall, parse_tool_calls
from asyncrl.tools.pool import (
    BAD_REWARD,
    ENVIRONMENT_ERRORS,
    TOOL_ERROR_KINDS,
    ToolPool,
    ToolResult,
)
from asyncrl.tools.schema import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "BAD_REWARD",
    "ENVIRONMENT_ERRORS",
    "TOOL_ERROR_KINDS",
    "BaseTool",
    "OpenAIFunctionToolSchema",
    "ParsedToolCalls",
    "ToolCall",
    "ToolPool",
    "ToolResponse",
    "ToolResult",
    "ToolSpec",
    "import_tool_class",
    "load_tool_config",
    "parse_tool_calls",
    "schemas",
    "truncate_response",
]
