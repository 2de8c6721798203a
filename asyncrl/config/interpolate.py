"""Resolving veRL's (OmegaConf's) ``${...}`` references in a raw config, before validation.

veRL's ``ppo_trainer.yaml`` and its users' files write ``critic.ppo_epochs:
${actor_rollout_ref.actor.ppo_epochs}`` and ``default_local_dir:
checkpoints/${trainer.project_name}/${trainer.experiment_name}``. Left as text, the first
fails validation and the second names a folder ``${trainer.project_name}``. Here:

- ``${a.b.c}`` is the value of key ``a.b.c`` of this config, in veRL's spelling or ours;
  a key the config leaves out reads as its default. A value that is exactly one reference
  keeps the referenced value's type; a reference inside text is formatted into it.
- ``${.x}`` is key ``x`` of the same group (``${..x}`` of the group above).
- ``${oc.select:a.b,default}`` is ``a.b``'s value, or ``default`` (read as YAML) when the
  config has no such key; ``${oc.env:NAME}`` and ``${oc.env:NAME,default}`` read an
  environment variable.
- Any other resolver (``eval``, custom ones) is refused with a line that names the key:
  write the value out.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import yaml

from asyncrl.config.verl_table import lookup, our_key

_REF = re.compile(r"\$\{([^${}]*)\}")
_MAX_DEPTH = 16  # references of references; deeper means a cycle


class InterpolationError(ValueError):
    """One line: which key, which reference, and what to write instead."""


def resolve_references(raw: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Replace every ``${...}`` in ``raw``'s string values, in place. ``defaults``: the
    config's defaults (our spelling), read for a key ``raw`` leaves out."""
    for node, name, path in list(leaves(raw)):
        key, value = ".".join(path), node[name]
        if isinstance(value, str) and "${" in value:
            node[name] = _resolve(raw, defaults, key, value, 0)
        elif isinstance(value, list) and any(isinstance(v, str) and "${" in v for v in value):
            node[name] = [
                _resolve(raw, defaults, key, v, 0) if isinstance(v, str) else v for v in value
            ]


def _resolve(raw: dict[str, Any], defaults: dict[str, Any], key: str, text: str, depth: int):
    if depth > _MAX_DEPTH:
        raise InterpolationError(f"{key}: {text!r} refers to itself (a cycle of ${{...}})")
    whole = _REF.fullmatch(text.strip())
    if whole:
        value = copy.deepcopy(_value(raw, defaults, key, whole.group(1)))  # no shared lists
        if isinstance(value, str) and "${" in value:
            return _resolve(raw, defaults, key, value, depth + 1)
        if isinstance(value, list):  # a list not resolved yet (its key comes later)
            return [
                _resolve(raw, defaults, key, v, depth + 1) if isinstance(v, str) else v
                for v in value
            ]
        return value

    def one(m: re.Match[str]) -> str:
        value = _value(raw, defaults, key, m.group(1))
        if isinstance(value, str) and "${" in value:
            value = _resolve(raw, defaults, key, value, depth + 1)
        return "None" if value is None else str(value)  # as OmegaConf formats it

    out = _REF.sub(one, text)
    if "${" in out:
        raise InterpolationError(f"{key}: {text!r} has a ${{...}} this loader cannot read")
    return out


def _value(raw: dict[str, Any], defaults: dict[str, Any], key: str, ref: str) -> Any:
    ref = ref.strip()
    resolver, colon, args = ref.partition(":")
    if not colon:
        return _lookup(raw, defaults, key, ref)
    name, comma, default = (part.strip() for part in args.partition(","))
    fallback = yaml.safe_load(default.strip("\"'")) if default else None  # as OmegaConf
    if resolver.strip() == "oc.select":
        try:
            return _lookup(raw, defaults, key, name)
        except InterpolationError:
            return fallback
    if resolver.strip() != "oc.env":
        raise InterpolationError(
            f"{key}: the ${{{ref}}} resolver {resolver.strip()!r} is not supported; write "
            "the value out (oc.env and oc.select are read)"
        )
    found = os.environ.get(name)
    if found is None and not comma:
        raise InterpolationError(
            f"{key}: ${{{ref}}} reads environment variable {name}, which is not set; set it "
            "or give a default (${oc.env:NAME,default})"
        )
    return found if found is not None else fallback


def _lookup(raw: dict[str, Any], defaults: dict[str, Any], key: str, ref: str) -> Any:
    """Key ``ref`` (absolute, or relative to ``key``'s group with leading dots) as the
    config spells it, as veRL spells it, or at its default."""
    if ref.startswith("."):
        depth = len(ref) - len(ref.lstrip("."))
        group = key.split(".")[:-depth]
        ref = ".".join([*group, ref.lstrip(".")])
    for tree in (raw, defaults):
        for spelling in dict.fromkeys((ref, our_key(ref))):
            found, value = lookup(tree, spelling)
            if found:
                return value
    raise InterpolationError(
        f"{key}: ${{{ref}}} refers to a key this config does not have; set {ref} or write "
        "the value out"
    )


def leaves(node: dict[str, Any], path: tuple[str, ...] = ()):
    """``(group, name, path)`` of every value of ``node`` that is not a group."""
    for k, v in node.items():
        if isinstance(v, dict):
            yield from leaves(v, (*path, str(k)))
        else:
            yield node, k, (*path, str(k))
