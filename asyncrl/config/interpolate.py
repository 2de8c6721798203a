"""Resolving veRL's (OmegaConf's) ``${...}`` references in a raw config, before validation.

veRL's ``ppo_trainer.yaml`` and its users' files write ``critic.ppo_epochs:
${actor_rollout_ref.actor.ppo_epochs}`` and ``default_local_dir:
checkpoints/${trainer.project_name}/${trainer.experiment_name}``. Left as text, the first
fails validation and the second names a folder ``${trainer.project_name}``. Here:

- ``${a.b.c}`` is the value of key ``a.b.c`` of this config, in veRL's spelling or ours;
  a key the config leaves out reads as its default. A value that is exactly one reference
  keeps the referenced value's type; a reference inside text is formatted into it.
- ``${.x}`` is key ``x`` of the same group (``${..x}`` of the group above).
- ``${oc.select:a.b,default}`` is ``a.b``'s value, or ``default`` (read as YAML; quoted or
  empty, text) when the config has no such key; ``${oc.env:NAME}`` and ``${oc.env:NAME,default}`` read an
  environment variable.
- Any other resolver (``eval``, custom ones) is refused with a line that names the key:
  write the value out.

A reference reads the value the run will use. A key whose value another key gives instead
(a veRL key mapped to ours, :class:`Moved`: ``actor_rollout_ref.rollout.response_length``
sets ``data.max_response_length``) reads that key's value, converted; a veRL key that is
another name for ours (``aliases``: ``${trainer.n_gpus_per_node}``) reads ours, given or
not. Inside the value of the key that moves, a reference to its own target reads the
target's own value (veRL's ``response_length: ${oc.select:data.max_response_length,512}``
is no cycle); inside our key's, a reference to its other name reads that one as written.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from asyncrl.config.verl_key import lookup, our_key
from asyncrl.config.yaml_read import read_yaml

_REF = re.compile(r"\$\{([^${}]*)\}")
_MAX_DEPTH = 16  # references of references; deeper means a cycle


class InterpolationError(ValueError):
    """One line: which key, which reference, and what to write instead."""


class Moved(Protocol):
    """Another key gives this key's value: ``source`` (dotted, as the raw config holds it)."""

    @property
    def source(self) -> str: ...

    @property
    def null_is_unset(self) -> bool:
        """A null source sets nothing (the key keeps its own value)."""
        ...

    def value(self, given: Any, read: Callable[[str], Any]) -> Any:
        """This key's value from ``source``'s resolved one (``read``: another key's)."""
        ...


def resolve_references(
    raw: dict[str, Any],
    defaults: dict[str, Any],
    moved: Mapping[str, Moved] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Replace every ``${...}`` in ``raw``'s string values, in place. ``defaults``: the
    config's defaults (our spelling), read for a key ``raw`` leaves out. ``moved``: our
    dotted key -> where its value comes from instead; ``aliases``: a key that is another
    name for one of ours, read as ours (module docstring)."""
    resolver = _Resolver(raw, defaults, moved or {}, aliases or {})
    sources = {m.source for m in resolver.moved.values()}
    for node, name, path in list(leaves(raw)):
        key, value = ".".join(path), node[name]
        # A moving key's own references read its targets' own values, as when it is read
        # through a target (there, it is active for the same reason).
        resolver.active = {key} & sources
        node[name] = resolver.resolved(key, value, 0)


class _Resolver:
    """The references of one raw config. ``active``: the moving keys whose value is being
    resolved, ``naming``: the renamed veRL keys being read as ours; a reference from inside
    reads the key's own value, not the same way round again."""

    def __init__(
        self,
        raw: dict[str, Any],
        defaults: dict[str, Any],
        moved: Mapping[str, Moved],
        aliases: Mapping[str, str],
    ):
        self.raw, self.defaults, self.moved, self.aliases = raw, defaults, moved, aliases
        self.active: set[str] = set()
        self.naming: set[str] = set()

    def resolved(self, key: str, value: Any, depth: int) -> Any:
        """``value`` (of ``key``) with its references resolved: text, or a list of texts."""
        if isinstance(value, str) and "${" in value:
            return self._text(key, value, depth)
        if isinstance(value, list) and any(isinstance(v, str) and "${" in v for v in value):
            return [self._text(key, v, depth) if isinstance(v, str) else v for v in value]
        return value

    def _text(self, key: str, text: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise InterpolationError(f"{key}: {text!r} refers to itself (a cycle of ${{...}})")
        whole = _REF.fullmatch(text.strip())
        if whole:  # one reference: the value keeps its type
            return copy.deepcopy(self._value(key, whole.group(1), depth))  # no shared lists

        def one(m: re.Match[str]) -> str:
            value = self._value(key, m.group(1), depth)
            return "None" if value is None else str(value)  # as OmegaConf formats it

        out = _REF.sub(one, text)
        if "${" in out:
            raise InterpolationError(f"{key}: {text!r} has a ${{...}} this loader cannot read")
        return out

    def _value(self, key: str, ref: str, depth: int) -> Any:
        ref = ref.strip()
        resolver, colon, args = ref.partition(":")
        if not colon:
            return self._lookup(key, ref, depth)
        name, comma, default = (part.strip() for part in args.partition(","))
        fallback = _default(default) if comma else None  # no default: None, as OmegaConf
        if resolver.strip() == "oc.select":
            try:
                return self._lookup(key, name, depth)
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

    def _lookup(self, key: str, ref: str, depth: int) -> Any:
        """Key ``ref`` (absolute, or relative to ``key``'s group with leading dots) resolved,
        as the run will have it: where another key gives its value, that one's; a renamed
        veRL key as the key of ours it names; else as the config spells it, as veRL spells
        it, or at its default."""
        if ref.startswith("."):
            level = len(ref) - len(ref.lstrip("."))
            group = key.split(".")[:-level]
            ref = ".".join([*group, ref.lstrip(".")])
        spellings = list(dict.fromkeys((ref, our_key(ref))))
        for spelling in spellings:
            moved = self.moved.get(spelling)
            if moved is not None and moved.source not in self.active:
                value = self._moved(moved, depth)
                if value is not _UNSET:
                    return value
            ours = self.aliases.get(spelling)
            # Read through ours already: from our key's own value (veRL's n_gpus_per_node
            # lost to it, and it refers to it), the veRL key as written.
            if ours is not None and spelling not in self.naming:
                with _holding(self.naming, spelling):
                    return self._lookup(key, ours, depth + 1)
            found, value = lookup(self.raw, spelling)
            if found:  # its own references are relative to it, as OmegaConf reads them
                return self.resolved(spelling, value, depth + 1)
        for spelling in spellings:
            found, value = lookup(self.defaults, spelling)
            if found:
                return value
        raise InterpolationError(
            f"{key}: ${{{ref}}} refers to a key this config does not have; set {ref} or write "
            "the value out"
        )

    def _moved(self, moved: Moved, depth: int) -> Any:
        """The value a moved key takes: its source's, resolved with the source active;
        :data:`_UNSET` when the source resolves to null and that sets nothing
        (``null_is_unset``: the key keeps its own value, which the caller reads)."""
        source = moved.source
        with _holding(self.active, source):
            given = self.resolved(source, lookup(self.raw, source)[1], depth + 1)
            if given is None and moved.null_is_unset:
                return _UNSET
            return moved.value(given, lambda dotted: self._lookup(source, dotted, depth + 1))


#: What :meth:`_Resolver._moved` gives for a source that sets nothing.
_UNSET = object()


def _default(text: str) -> Any:
    """A resolver's default as OmegaConf reads it: quoted, the text inside (``'1'`` is
    text); nothing (``${oc.env:NAME,}``), the empty text; else as a config value is read
    (``null``, ``8``; ``0615`` and ``off`` stay text, as in Hydra's grammar)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return read_yaml(text) if text else ""


@contextlib.contextmanager
def _holding(keys: set[str], key: str) -> Iterator[None]:
    """``key`` in ``keys`` for the block (not yet there: the callers check)."""
    keys.add(key)
    try:
        yield
    finally:
        keys.discard(key)


def leaves(node: dict[str, Any], path: tuple[str, ...] = ()):
    """``(group, name, path)`` of every value of ``node`` that is not a group."""
    for k, v in node.items():
        if isinstance(v, dict):
            yield from leaves(v, (*path, str(k)))
        else:
            yield node, k, (*path, str(k))
