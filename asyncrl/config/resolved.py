"""What the resolved ``config.yaml`` in the run directory keeps beyond the values.

- Which keys the user wrote (:data:`WRITTEN`, a top-level list): the file sets every key,
  so without it a role given that file would read every key as given, and its advisories
  (:mod:`asyncrl.config.advisories`, which read ``model_fields_set``) would differ from the
  launcher's.
- Local paths as absolute (:func:`absolute_paths`): a role restarted by hand from another
  directory reads the same model, data and run directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

#: The top-level entry of a resolved config listing the dotted keys the user wrote.
WRITTEN = "_written_"

#: Keys holding paths (``~`` is expanded in them, and they are made absolute).
PATH_KEY = re.compile(r"(path|paths|files?|dir)$")


def written_keys(section: BaseModel, prefix: tuple[str, ...] = ()) -> list[str]:
    """The dotted keys under ``section`` that were given (a group given empty is named)."""
    out: list[str] = []
    for name in sorted(section.model_fields_set):
        value, dotted = getattr(section, name), (*prefix, name)
        sub = written_keys(value, dotted) if isinstance(value, BaseModel) else []
        out += sub or [".".join(dotted)]
    return out


def restore_written(section: BaseModel, keys: Iterable[str]) -> None:
    """Set each section's ``model_fields_set`` to the keys in ``keys`` (dotted), as if only
    they had been given; a key the schema lacks is passed over."""
    tree: dict[str, Any] = {}
    for key in keys:
        node = tree
        for part in key.split("."):
            node = node.setdefault(part, {})
    _restore(section, tree)


def _restore(section: BaseModel, tree: dict[str, Any]) -> None:
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            _restore(value, tree.get(name, {}))
    given = {name for name in type(section).model_fields if name in tree}
    object.__setattr__(section, "__pydantic_fields_set__", given)  # pydantic's own record


def absolute_paths(node: dict[str, Any]) -> None:
    """In place: a relative path key's value that exists here becomes absolute (a hub id
    such as ``Qwen/Qwen2.5-0.5B`` does not exist and stays); ``default_local_dir`` always."""
    for k, v in node.items():
        if isinstance(v, dict):
            absolute_paths(v)
        elif isinstance(k, str) and PATH_KEY.search(k):
            always = k == "default_local_dir"
            if isinstance(v, str):
                node[k] = _absolute(v, always)
            elif isinstance(v, list):
                node[k] = [_absolute(x, always) if isinstance(x, str) else x for x in v]


def _absolute(value: str, always: bool) -> str:
    if value and not os.path.isabs(value) and (always or os.path.exists(value)):
        return os.path.abspath(value)
    return value


def same_path(a: Any, b: Any) -> bool:
    """Whether two ``model.path`` values name one model: ``./x``, ``x/`` and its absolute
    path are one; a hub id is compared as written."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return a == b
    return a == b or os.path.abspath(os.path.expanduser(a)) == os.path.abspath(
        os.path.expanduser(b)
    )
