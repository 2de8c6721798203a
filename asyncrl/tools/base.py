"""The base class of a tool, with veRL's method names and signatures.

A veRL tool ports by changing its imports from ``verl.tools.base_tool`` and
``verl.tools.schemas`` to ``asyncrl.tools`` (``BaseTool``, ``OpenAIFunctionToolSchema``,
``ToolResponse``). ``tool_schema`` is an :class:`~asyncrl.tools.OpenAIFunctionToolSchema`:
read by attribute as veRL's pydantic model is (``self.tool_schema.function.name``) or as
the config's dict (``self.tool_schema["function"]["name"]``). One difference:
:meth:`BaseTool.execute` has no useful default, since a tool that does nothing is a config
mistake.

A tool lives in a tool worker process (see :class:`asyncrl.tools.ToolPool`): it is built
once per worker, and each call is ``create`` -> ``execute`` -> ``release`` on a fresh
instance id. So an instance lives for one call, not for a trajectory as in veRL (where
``create`` runs once per trajectory and later calls reuse its id): the next call of the same
episode gets a new id, perhaps in another worker. State kept in a dict keyed by the id (veRL's
habit, which still works) lasts from ``create`` to ``release`` of that one call; nothing
carries state from one call of an episode to the next, so a tool must read what it needs
from its ``create_kwargs`` (the row's) and the call's arguments.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from asyncrl.tools.schema import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """A tool the model can call.

    Attributes:
        config: The ``config`` mapping of the tool's config entry.
        tool_schema: The OpenAI function-calling schema (``{"type": "function", ...}``), a
            dict whose keys read as attributes too (see the module docstring).
        name: ``tool_schema.function.name``: what the model calls.
    """

    def __init__(
        self, config: dict, tool_schema: OpenAIFunctionToolSchema | Mapping[str, Any]
    ) -> None:
        self.config = config
        # A plain dict (a test's, or an older tool's) reads by attribute too once wrapped.
        self.tool_schema: OpenAIFunctionToolSchema = OpenAIFunctionToolSchema.model_validate(
            tool_schema
        )
        self.name: str = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema shown to the model (veRL's name for it)."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start an instance of the tool for one call (see the module docstring); return its id.

        The trajectory's ``create_kwargs`` (veRL's
        ``extra_info.tools_kwargs[name]["create_kwargs"]``, e.g. a ground truth) come both
        as ``kwargs["create_kwargs"]``, as veRL's agent loop passes them, and spread as
        keywords, as its older rollouts did (a ``create`` without ``**kwargs`` gets the
        keywords it names)."""
        return instance_id if instance_id is not None else uuid.uuid4().hex

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str | dict | ToolResponse, float | None, dict | None]:
        """Run the tool on the model's arguments.

        Returns:
            ``(response, step_reward, metrics)``: the response is the text the model sees,
            a :class:`~asyncrl.tools.ToolResponse` or a dict with a ``"text"`` key (a text
            of None is an empty answer, as in veRL); errors the model should fix are best
            returned as text too, so it can learn from them.
        """
        raise NotImplementedError(f"{type(self).__name__} must override BaseTool.execute")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward from its state (0.0 unless a tool keeps score). Not
        called here: an instance lives for one call, so veRL's end-of-trajectory rewards
        have no state to read; return the step reward from :meth:`execute` instead."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the instance's state; called after every execute, even one that raised."""
