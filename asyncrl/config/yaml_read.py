"""YAML read as Hydra reads it, for a config file and a command-line value alike.

One loader, so that ``lr: 1e-6`` in a file and ``actor.optim.lr=1e-6`` on the command line
are the same float: ``true``/``false`` (any case) are the only booleans (``on``, ``off``,
``yes``, ``no`` stay text, and a boolean key reads them as Hydra's typed configs do);
integers are decimal (``0615`` is text, not octal 397); ``1e-6`` is a float, as OmegaConf
reads it (plain YAML 1.1 reads it as text); nothing is a date (``2025-01-20`` is text).
Only an unquoted value is read so: ``'1e-3'`` stays text.

A mapping that gives one key twice is refused (OmegaConf refuses it too): plain YAML keeps
the last silently, so a group written twice would lose its first block.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_STR = "tag:yaml.org,2002:str"
_NUMBER = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_HYDRA_ONLY = (":bool", ":timestamp", ":int", ":float")  # YAML 1.1's readings replaced here


class HydraLoader(yaml.SafeLoader):
    """PyYAML's safe loader with Hydra's readings of plain scalars (module docstring)."""


HydraLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith(_HYDRA_ONLY)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
HydraLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|false)$", re.IGNORECASE), list("tTfF")
)
# Decimal numbers only: YAML 1.1 also reads 0615 (octal), 0x1f and 12:30 (base 60) as
# numbers, which would rename trainer.experiment_name=0615 to 397 without a word.
HydraLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789")
)
HydraLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)?\.[0-9]+(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9][0-9_]*\.(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"  # 1e-6: a float, as OmegaConf reads it
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


class HydraDumper(yaml.SafeDumper):
    """PyYAML's safe dumper quoting text by the loader's readings (:class:`HydraLoader`):
    text that :func:`read_yaml` would read as a number or a boolean (``'1e5'``, which plain
    YAML writes bare) is written quoted, so a written config reads back as it was."""


HydraDumper.yaml_implicit_resolvers = HydraLoader.yaml_implicit_resolvers


def dump_yaml(data: Any) -> str:
    """``data`` as YAML that :func:`read_yaml` reads back the same, in the given key order."""
    return yaml.dump(data, Dumper=HydraDumper, sort_keys=False)


class DuplicateKeyError(yaml.YAMLError):
    """One mapping gives ``key`` twice: ``str()`` is one line naming it and both lines."""

    def __init__(self, key: str, line: int, first: int):
        self.key, self.line, self.first = key, line, first
        super().__init__(
            f"line {line}: {key} is given twice (first at line {first}); YAML would keep "
            "only the last: write it once (merge the two blocks)"
        )


def read_yaml(text: str, text_key: Callable[[str], bool] | None = None) -> Any:
    """``text`` read as Hydra reads YAML. ``text_key(dotted)``: whether a key is text, so
    that a number written for it is kept as written (``experiment_name: 1.10`` is
    ``"1.10"``, not ``1.1``, the name of another run)."""
    loader = HydraLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check(node, (), text_key, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check(
    node: Node, path: tuple[str, ...], text_key: Callable[[str], bool] | None, seen: set[int]
) -> None:
    """Refuse a key given twice in one mapping (dotted, with its lines); retag a number
    written for a text key as text. ``seen``: nodes walked (an alias repeats one)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            dotted = ".".join((*path, key_node.value))
            line = key_node.start_mark.line + 1
            if key_node.value in first:
                raise DuplicateKeyError(dotted, line, first[key_node.value])
            first[key_node.value] = line
            _check(value_node, (*path, key_node.value), text_key, seen)
    elif isinstance(node, SequenceNode):
        for item in node.value:
            _check(item, path, text_key, seen)
    elif (
        isinstance(node, ScalarNode)
        and node.tag in _NUMBER
        and node.style is None
        and text_key is not None
        and path
        and text_key(".".join(path))
    ):
        node.tag = _STR
