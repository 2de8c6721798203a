"""Read a tool config file in veRL's format, and load the tool classes it names.

The file (``rollout.multi_turn.tool_config_path``) is YAML::

    tools:
      - class_name: "some.module.ClassName"   # or "path/to/file.py:ClassName"
        config: {type: native}                # passed to the class constructor
        tool_schema:                          # OpenAI function-calling JSON
          type: function
          function: {name: add, description: ..., parameters: {type: object, ...}}

:func:`load_tool_config` only reads and checks the file: it imports no tool code, so the
process that runs the model never executes a tool's module. The tool workers call
:func:`instantiate_tools`, which does.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncrl.sandbox.child import describe_exception
from asyncrl.sandbox.pyfile import import_file
from asyncrl.tools.schema import OpenAIFunctionToolSchema

_CONFIG_KEY = "rollout.multi_turn.tool_config_path"


@dataclass(frozen=True)
class ToolSpec:
    """One entry of a tool config.

    Attributes:
        name: The function name in the schema: what the model calls.
        class_name: ``"module.Class"``, or ``"/absolute/file.py:Class"`` (a relative file
            path in the config is made absolute when the config is read).
        config: The entry's ``config`` mapping, passed to the class constructor.
        schema: The OpenAI function-calling schema (``{"type": "function", ...}``).
    """

    name: str
    class_name: str
    config: dict[str, Any]
    schema: dict[str, Any]


def _fail(where: str, problem: str) -> ValueError:
    return ValueError(f"{where}: {problem}")


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(
            f"tool config {str(path)!r} is not a file; set {_CONFIG_KEY} to a YAML file "
            "with a 'tools:' list"
        )
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())  # one line: YAML errors span several
        raise ValueError(f"tool config {path} is not valid YAML ({detail}); fix it") from exc


def _resolve_class_name(class_name: str, config_dir: Path, where: str) -> str:
    """Check a ``file.py:Class`` path exists and make it absolute; leave dotted names be."""
    if ":" not in class_name:
        module, _, attr = class_name.rpartition(".")
        if not module or not attr:
            raise _fail(
                where,
                f"class_name {class_name!r} must be 'package.module.ClassName' "
                "or 'path/to/file.py:ClassName'",
            )
        return class_name
    file_part, _, attr = class_name.rpartition(":")
    if not attr.isidentifier():
        raise _fail(where, f"class_name {class_name!r} must end in ':ClassName'")
    file = Path(file_part).expanduser()
    candidates = [file] if file.is_absolute() else [Path.cwd() / file, config_dir / file]
    for candidate in candidates:
        if candidate.is_file():
            return f"{candidate.resolve()}:{attr}"
    tried = " or ".join(str(c) for c in candidates)
    raise _fail(where, f"tool file {file_part!r} not found (looked for {tried}); fix class_name")


def _check_schema(schema: Any, where: str) -> str:
    """Return the tool's name if ``schema`` is an OpenAI function schema; raise otherwise."""
    if not isinstance(schema, dict) or schema.get("type") != "function":
        raise _fail(
            where,
            "tool_schema must be a mapping with type: function (OpenAI function-calling format)",
        )
    function = schema.get("function")
    if not isinstance(function, dict):
        raise _fail(
            where, "tool_schema.function must be a mapping with name, description and parameters"
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(where, "tool_schema.function.name must be a non-empty string")
    parameters = function.get("parameters", {})
    if not isinstance(parameters, dict):
        raise _fail(
            where,
            f"tool {name!r}: tool_schema.function.parameters must be a mapping "
            "(a JSON schema with type: object)",
        )
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _fail(where, f"tool {name!r}: parameters.required must be a list of names")
    return name


def _read_entry(entry: Any, config_dir: Path, where: str) -> ToolSpec:
    if not isinstance(entry, dict):
        raise _fail(where, "each tool must be a mapping with class_name, config and tool_schema")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name.strip():
        raise _fail(where, "class_name is missing; set it to 'package.module.ClassName'")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise _fail(where, f"config must be a mapping, got {type(config).__name__}")
    kind = config.get("type", "native")
    if kind != "native":
        raise _fail(
            where,
            f"config.type {kind!r} is not supported; only native tools "
            "(Python classes) are, so set type: native",
        )
    name = _check_schema(entry.get("tool_schema"), where)
    resolved = _resolve_class_name(class_name.strip(), config_dir, where)
    return ToolSpec(name, resolved, dict(config), copy.deepcopy(entry["tool_schema"]))


def load_tool_config(path: str | Path) -> list[ToolSpec]:
    """Read and check a tool config file; import nothing from the tools themselves.

    Raises:
        ValueError: A one-line message naming the fix: a missing or unparsable file, an
            entry without class_name, a tool file that does not exist, a schema that is not
            of type function, a non-native tool, or two tools with the same name.
    """
    file = Path(path).expanduser()
    data = _read_yaml(file)
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tool config {file} needs a non-empty 'tools:' list at the top level")
    specs: list[ToolSpec] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(tools):
        where = f"tool config {file}: tools[{index}]"
        spec = _read_entry(entry, file.resolve().parent, where)
        if spec.name in seen:
            raise _fail(
                where,
                f"duplicate tool name {spec.name!r} (also tools[{seen[spec.name]}]);"
                " give each tool_schema.function.name a different name",
            )
        seen[spec.name] = index
        specs.append(spec)
    return specs


#: The fix for a veRL tool (``verl.workers.tool...``): veRL is not a dependency here.
VERL_TOOL_FIX = (
    "veRL's own tools need veRL, which is not installed here: copy the tool's file, change "
    "its imports from verl.tools.* to asyncrl.tools, and point class_name at it "
    "(path/to/tool.py:ClassName)"
)


def launch_problems(path: str | Path) -> list[str]:
    """What a rollout server's start would refuse in the tool config at ``path``, found
    before any role starts, one line each: the config's own errors, and a tool whose
    top-level package is not installed (looked up without importing anything: a tool's
    module may do work on import). Other import errors still show at the server's start."""
    try:
        specs = load_tool_config(path)
    except ValueError as e:
        return [str(e)]
    out = []
    for spec in specs:
        if ":" in spec.class_name:  # a file: load_tool_config found it
            continue
        top = spec.class_name.split(".")[0]
        if importlib.util.find_spec(top) is None:
            fix = VERL_TOOL_FIX if top == "verl" else "install the package that provides it"
            out.append(
                f"tool config {path}: tool class {spec.class_name!r}: no module named "
                f"{top!r}; {fix}, or fix class_name"
            )
    return out


def schemas(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """The tools' schemas, in config order: what a chat template's ``tools=`` argument takes."""
    return [copy.deepcopy(spec.schema) for spec in specs]


def _import_module(class_name: str) -> tuple[Any, str]:
    if ":" in class_name:
        file, _, attr = class_name.rpartition(":")
        return import_file(file, "asyncrl_tool"), attr
    module_name, _, attr = class_name.rpartition(".")
    return importlib.import_module(module_name), attr


def _is_named_module(class_name: str, missing: str | None) -> bool:
    """Whether a ModuleNotFoundError is about the named module (or a parent package), not
    about something that module imports."""
    module_name = class_name.rpartition(".")[0]
    return bool(missing) and (module_name == missing or module_name.startswith(f"{missing}."))


def import_tool_class(class_name: str) -> type:
    """Import the class a config entry names (``module.Class`` or ``file.py:Class``).

    Raises:
        ValueError: The module is missing or fails to import, or has no such class.
    """
    try:
        module, attr = _import_module(class_name)
    except ModuleNotFoundError as exc:
        if ":" not in class_name and _is_named_module(class_name, exc.name):
            raise ValueError(
                f"tool class {class_name!r}: no module named {exc.name!r}; fix class_name in "
                "the tool config or install the package that provides it"
            ) from exc
        raise _import_failed(class_name, exc) from exc
    # SystemExit too: a module that calls sys.exit() on import must name itself, not end
    # the worker with nothing said.
    except (Exception, SystemExit) as exc:
        raise _import_failed(class_name, exc) from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ValueError(
            f"tool class {class_name!r}: the module has no class {attr!r}; fix class_name in "
            "the tool config"
        )
    if not callable(getattr(cls, "execute", None)):
        raise ValueError(
            f"tool class {class_name!r} has no execute method; subclass "
            "asyncrl.tools.BaseTool and override execute"
        )
    return cls


def _import_failed(class_name: str, exc: BaseException) -> ValueError:
    return ValueError(
        f"importing tool class {class_name!r} failed: {describe_exception(exc)}; fix the "
        "tool's module (import it in a Python shell to see the full traceback)"
    )


def instantiate_tools(specs: list[ToolSpec]) -> dict[str, Any]:
    """Import each spec's class and build the tool: ``cls(config, tool_schema)``, by name;
    ``tool_schema`` is an :class:`~asyncrl.tools.OpenAIFunctionToolSchema` (veRL's tools read
    it by attribute, even those that do not pass it on to ``BaseTool.__init__``).

    Raises:
        ValueError: A class cannot be imported, or its constructor raised (``SystemExit``
            included).
    """
    tools: dict[str, Any] = {}
    for spec in specs:
        cls = import_tool_class(spec.class_name)
        try:
            schema = OpenAIFunctionToolSchema.model_validate(spec.schema)  # a copy
            tools[spec.name] = cls(copy.deepcopy(spec.config), schema)
        except (Exception, SystemExit) as exc:  # sys.exit() in __init__ too, named here
            raise ValueError(
                f"constructing tool {spec.name!r} ({spec.class_name}) failed: "
                f"{describe_exception(exc)}; fix the tool's __init__ or its config"
            ) from exc
    return tools
