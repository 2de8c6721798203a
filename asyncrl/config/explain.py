"""Naming what is wrong with a key, against the schema: one line per pydantic error (the
dotted key, what is wrong, the nearest valid key) and Hydra's refusal of ``~key`` for a key
that does not exist. The loader raises them as :class:`~asyncrl.config.errors.ConfigError`
lines; here they are only worded."""

from __future__ import annotations

import difflib

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from asyncrl.config.interpolate import leaves
from asyncrl.config.schema import Config
from asyncrl.config.verl_elsewhere import elsewhere_fix
from asyncrl.config.verl_table import VERL_KEYS


def explain(err: ErrorDetails) -> str:
    """One line per pydantic error: the dotted key, what is wrong, the nearest valid key."""
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        if fix := elsewhere_fix(key):  # another veRL version's key: its own fix
            return f"unknown key {key}; {fix}"
        valid = _valid_keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join(loc[:-1] + close)}?" if close else ""
        group = ".".join(loc[:-1]) or "the top level"
        given = err.get("input")
        under = ""
        if key == "reward_model" and isinstance(given, dict) and "reward_kwargs" in given:
            names = [".".join((key, *path)) for _, _, path in leaves(given)][:4]
            return (
                f"{', '.join(names)}: veRL hands reward_model.reward_kwargs to its reward "
                "manager, which is not built here (only overlong_buffer_cfg and max_resp_len "
                "are read); give your scoring function's own arguments as "
                "custom_reward_function.reward_kwargs"
            )
        if key == "model.lora_dropout":  # peft's key: "did you mean lora_rank" misled
            return (
                "model.lora_dropout: adapters train without dropout here (peft's "
                "lora_dropout is not built); leave the key out"
            )
        if isinstance(given, dict):  # a whole unknown group: say which keys were under it
            names = [".".join((key, *path)) for _, _, path in leaves(given)][:4]
            under = f" (given: {', '.join(names)})"
        fix = hint or f"valid keys in {group}: {', '.join(valid)}"
        return f"unknown key {key}; {fix}{under}"
    got = err.get("input")
    shown = repr(got) if not isinstance(got, dict) else "a mapping"
    return f"{key}: {_worded(err['msg'])} (got {shown})"


def _worded(msg: str) -> str:
    """pydantic's message, its first letter lower-cased as the line goes on, and the
    "Value error, " it puts before a validator's own words left out (lower-casing the
    whole message turned a validator's ``None`` into ``none``)."""
    msg = msg.removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def _valid_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def not_deletable(written: str, key: str) -> str | None:
    """Hydra's refusal of ``~key`` for a key that does not exist, with the nearest one; None
    for a key of the schema or of veRL's table that the config leaves out (at its default,
    deleting it changes nothing). ``written``: the key as typed; ``key``: in our spelling."""
    if written in VERL_KEYS or any(k.startswith(written + ".") for k in VERL_KEYS):
        return None
    model: type[BaseModel] = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            close = difflib.get_close_matches(part, list(model.model_fields), n=1, cutoff=0.5)
            hint = f"; did you mean ~{'.'.join([*parts[:i], *close])}?" if close else ""
            return f"~{written}: could not delete {written}, it does not exist{hint}"
        sub = field.annotation
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return None  # a value, or a mapping of the user's own keys
        model = sub
    return None
