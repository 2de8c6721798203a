"""One tool call inside a tool worker process: build the tools, run ``create`` ->
``execute`` -> ``release`` on the worker's event loop, and read the answer the way veRL's
tool agent reads it (a str, a dict's ``"text"``, a ``ToolResponse``), cut to the pool's
length and made valid UTF-8 before it leaves the worker. The pool that sends the calls and
reads the answers is :mod:`asyncrl.tools.pool`."""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, Literal

from asyncrl.rewards.registry import finite_number
from asyncrl.sandbox.workers import Handler
from asyncrl.tools.config import ToolSpec, instantiate_tools

TruncateSide = Literal["left", "middle", "right"]


def truncate_response(text: str, max_length: int, side: TruncateSide = "middle") -> str:
    """Cut ``text`` to ``max_length`` characters, marking the cut as veRL's tool agent does.

    ``"left"`` keeps the start (``...(truncated)`` appended), ``"right"`` keeps the end
    (``(truncated)...`` prepended), ``"middle"`` keeps half of each around
    ``...(truncated)...``. The marker is not counted in ``max_length``.
    """
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[len(text) - max_length :]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half :]


def valid_text(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (lone surrogates, from subprocess output decoded
    with ``surrogateescape``) replaced by ``?``: a tokenizer refuses such text, and the
    episode would end as if its chat template could not render tool answers."""
    return text.encode("utf-8", "replace").decode("utf-8")


_NO_TEXT = object()  # a response without a text field, as opposed to a text of None


def response_text(response: Any) -> str | None:
    """The text of a tool response (a str, a dict's ``"text"``, or a
    :class:`~asyncrl.tools.ToolResponse`'s ``.text``); None when it is no response.

    A text of None is an empty answer, not an error: veRL's agent loop sends ``text or ""``
    (its tools return ``ToolResponse()`` with nothing to say). A dict with no ``"text"`` key
    and no image or video is a mistake (``{"result": ...}``) and stays one."""
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        text = response.get("text", _NO_TEXT)
        media = response.get("image") or response.get("video")
    else:
        text = getattr(response, "text", _NO_TEXT)
        media = getattr(response, "image", None) or getattr(response, "video", None)
    if text is None or (text is _NO_TEXT and media):
        return ""  # no text, or an image-only response: this text-only pool passes on none
    return text if isinstance(text, str) else None


def create_arguments(create: Any, create_kwargs: dict) -> dict[str, Any]:
    """The keywords a tool's ``create`` takes the trajectory's ``create_kwargs`` as. veRL's
    agent loop passes them as one keyword (``create(create_kwargs=...)``, what its tools
    read), its older rollouts spread them (``create(**create_kwargs)``): a ``create`` that
    takes any keyword gets both, one that names its parameters gets those it names."""
    params = inspect.signature(create).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return {**create_kwargs, "create_kwargs": create_kwargs}
    named = {p.name for p in params}
    out = {k: v for k, v in create_kwargs.items() if k in named}
    if "create_kwargs" in named:
        out["create_kwargs"] = create_kwargs
    return out


def call_once(
    tool: Any, arguments: dict[str, Any], create_kwargs: dict, loop: asyncio.AbstractEventLoop
) -> Any:
    """One call: ``create``, ``execute``, ``release`` (:func:`_step` each, on ``loop``)."""
    created = _step(loop, tool.create, **create_arguments(tool.create, create_kwargs))
    # Newer veRL tools return (instance_id, response) from create.
    instance_id = created[0] if isinstance(created, tuple) else created
    try:
        return _step(loop, tool.execute, instance_id, arguments)
    finally:
        _step(loop, tool.release, instance_id)


def _step(loop: asyncio.AbstractEventLoop, method: Any, *args: Any, **kwargs: Any) -> Any:
    """A tool method's result. veRL's are coroutines, run to their end on ``loop`` (the
    worker's, which outlives calls: a client a tool opened stays usable); a ported tool
    may define a plain ``def``, called with no loop running, so that it may run one of its
    own (``asyncio.run``: inside the worker's loop every such call failed)."""
    value = method(*args, **kwargs)
    return loop.run_until_complete(value) if inspect.isawaitable(value) else value


def run_call(
    tools: dict[str, Any],
    loop: asyncio.AbstractEventLoop,
    max_length: int,
    side: TruncateSide,
    job: tuple,
) -> tuple[str, Any]:
    """Run one call on its tool; a tool that raises is reported by the pool as exception.
    The answer leaves the worker cut to ``max_length`` and valid UTF-8 (see the module
    docstring)."""
    name, arguments, create_kwargs = job
    result = call_once(tools[name], arguments, create_kwargs, loop)
    if not isinstance(result, tuple | list) or len(result) != 3:
        return "bad_return", f"{type(result).__name__} {result!r:.80}, not a 3-tuple"
    text = response_text(result[0])
    if text is None:
        return "bad_return", f"a response of type {type(result[0]).__name__} without text"
    # None is no step reward (veRL's SandboxFusionTool returns (response, None, None)); the
    # metrics, None or not, are not read. A step reward that is not a number is read as 0
    # (the scorer gets it in extra_info["tool_rewards"]): a count, never the answer.
    reward: float | None = None if result[1] is None else 0.0
    note = None
    try:  # numpy scalars and bools, 0-d arrays and tensors too, as for scores
        if result[1] is not None:
            reward = finite_number(result[1], "step reward ")
    except (TypeError, ValueError) as e:
        note = str(e)
    return "ok", (valid_text(truncate_response(text, max_length, side)), reward, note)


def load_tools(specs: tuple[ToolSpec, ...], max_length: int, side: TruncateSide) -> Handler:
    """Worker setup: build every tool once; calls share one event loop for the worker's life,
    so a tool may keep loop-bound state (a client session, a semaphore) between calls. Answers
    are cut to ``max_length`` characters on ``side``'s terms (:func:`truncate_response`)."""
    # The loop exists before the tools, so one that looks up the loop in __init__ gets it.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    tools = instantiate_tools(list(specs))
    return functools.partial(run_call, tools, loop, max_length, side)
