"""One command-line override read as Hydra reads it: ``"a.b=1"`` -> ``("a.b", 1)``.

Values are YAML with Hydra's readings (:mod:`asyncrl.config.yaml_read`, as a config file
is read): ``true``/``false`` the only booleans, no dates, no octal or base-60 numbers, an
unquoted ``1e-5`` a float, and ``{k:v}`` (no space after the colon) a mapping. A veRL
spelling of the key (``actor_rollout_ref.actor.*``) becomes ours.
"""

from __future__ import annotations

from typing import Any

import yaml

from asyncrl.config.errors import ConfigError
from asyncrl.config.verl_key import our_key
from asyncrl.config.yaml_read import DuplicateKeyError, read_yaml


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=1"`` -> ``("a.b", 1)``; values are YAML (numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError([f"override {item!r} is not key=value (e.g. rollout.n=8)"])
    key, text = item.split("=", 1)
    key = key.strip().lstrip("+")  # Hydra's "+key=" / "++key=" (add, force) mean "key=" here
    if not key:
        raise ConfigError([f"override {item!r} has an empty key"])
    flow = _hydra_flow(text) if text.lstrip()[:1] in ("{", "[") else text
    try:
        value = read_yaml(flow) if text.strip() else ""
    except DuplicateKeyError as e:
        raise ConfigError([f"override {item!r} gives {e.key} twice; give it once"]) from None
    except yaml.YAMLError:
        value = text  # a plain string such as a path with a colon
    return our_dotted(key), value


def our_dotted(key: str) -> str:
    """:func:`our_key`, for a whole veRL group too: ``actor_rollout_ref.actor={...}`` sets
    ``actor`` (the prefixes in VERL_PREFIXES end with a dot)."""
    return our_key(key + ".")[:-1]


def _hydra_flow(text: str) -> str:
    """Hydra's ``{k:v}`` spelled as YAML reads it, ``{k: v}``. YAML takes ``k:v`` without a
    space for one key named ``"k:v"`` with no value; Hydra splits it at its first colon.

    Only the first colon of each key of a ``{...}`` gets a space: a colon in a value
    (``{url:http://h:80}``), in a quoted string or in a ``${...}`` reference stays as
    written. Quotes open a quoted string only at the start of a token, as in YAML."""
    out: list[str] = []
    stack: list[str] = []  # per open bracket: "{", "[" or "$" (inside a ${...})
    quote = ""  # the quote of the quoted string being read
    in_key = False  # before the key's colon, in the innermost {...}
    token_start = True  # a quote here opens a quoted string
    i = 0
    while i < len(text):
        ch, nxt = text[i], text[i + 1 : i + 2]
        out.append(ch)
        i += 1
        if quote:  # inside a quoted string: only its end (not an escaped quote) matters
            if (quote == '"' and ch == "\\") or (quote == "'" and ch == nxt == "'"):
                out.append(nxt)
                i += 1
            elif ch == quote:
                quote, token_start = "", False
            continue
        top = stack[-1] if stack else ""
        if ch in "'\"" and token_start:
            quote = ch
        elif ch in "{[":
            ref = top == "$" or (ch == "{" and text[i - 2 : i - 1] == "$")
            stack.append("$" if ref else ch)
            in_key, token_start = stack[-1] == "{", True
        elif ch in "}]":
            if stack:
                stack.pop()
            in_key, token_start = False, False
        elif ch == "," and top != "$":
            in_key, token_start = top == "{", True
        elif ch == ":" and in_key and top == "{":
            if nxt and not nxt.isspace():
                out.append(" ")
            in_key, token_start = False, True
        elif not ch.isspace():
            token_start = False
    return "".join(out)
