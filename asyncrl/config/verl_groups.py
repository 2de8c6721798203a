"""veRL's spelling of a config: its groups (``actor_rollout_ref.{actor,rollout,model,ref}``,
a top-level ``custom_reward_function``, the overlong buffer's two homes) merged into ours as
Hydra merges, and an error about a key named the way the user typed it."""

from __future__ import annotations

import copy
import difflib
import functools
import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from asyncrl.config.errors import ConfigError
from asyncrl.config.interpolate import leaves
from asyncrl.config.overrides import our_dotted
from asyncrl.config.schema import Config
from asyncrl.config.verl_compat import pop_dotted
from asyncrl.config.verl_key import VERL_PREFIXES, our_key
from asyncrl.config.verl_table import VERL_KEYS


def verl_spellings(loaded: dict[str, Any] | None, overrides: Iterable[str]) -> dict[str, str]:
    """Our dotted key -> the veRL spelling the user gave it in (``actor_rollout_ref.*``,
    ...): a typo there must be reported as typed, not as a key the user never wrote."""
    keys = [o.strip().lstrip("~+").split("=", 1)[0] for o in overrides]
    if isinstance(loaded, dict):
        keys += [".".join(path) for _, _, path in leaves(loaded)]
    spelled = {our_dotted(k): k for k in keys if our_dotted(k) != k}
    for k in keys:  # a mapped key's value is checked under its one target: named as given
        rule = VERL_KEYS.get(k)
        if rule is not None and rule.kind == "mapped" and len(rule.target) == 1:
            spelled.setdefault(rule.target[0], k)
    return spelled


def applied_spellings(spelled: dict[str, str], plan: dict[str, Any]) -> dict[str, str]:
    """``spelled`` without a mapped veRL key whose value its target did not take (``plan``:
    :func:`~asyncrl.config.verl_compat.plan_verl_keys`): an error about that target is
    about the value the user gave it under our name, and must name that key (it named
    ``trainer.n_gpus_per_node`` for a ``trainer.nproc=0`` that won over it)."""
    out = {}
    for ours, typed in spelled.items():
        rule = VERL_KEYS.get(typed)
        if rule is not None and rule.kind == "mapped":
            move = plan.get(ours)
            if move is None or move.key != typed:
                continue
        out[ours] = typed
    return out


def unknown_verl_children(raw: dict[str, Any]) -> list[str]:
    """One line per key of veRL's ``actor_rollout_ref`` that is none of its groups or keys
    (those known have moved to ours by now), named as typed with the nearest veRL key:
    ``actor_rollout_ref.acotr`` was reported as an unknown ``actor_rollout_ref``, or moved
    to a top-level ``acotr`` the user never wrote."""
    left = raw.get("actor_rollout_ref")
    if not isinstance(left, dict):
        return []
    known = [p.split(".")[1] for p in VERL_PREFIXES if p.startswith("actor_rollout_ref.")]
    known += [k.split(".")[1] for k in VERL_KEYS if k.startswith("actor_rollout_ref.")]
    lines = []
    for name in left:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f"; did you mean actor_rollout_ref.{close[0]}?" if close else ""
        lines.append(f"unknown key actor_rollout_ref.{name}{hint}")
    return lines


#: veRL's groups whose keys are the user's own (handed on as keyword arguments): a key
#: under one is not misspelt, and the schema's line says where such arguments go here.
OPEN_GROUPS = ("reward_model.reward_kwargs",)


def unknown_verl_leaves(raw: dict[str, Any], spelled: dict[str, str]) -> list[str]:
    """One line per key left under a group of veRL's that is none of ours, once the table's
    keys are taken out (so it is none of veRL's either), named as typed with the nearest
    key of that group; each is taken out of ``raw``, for the schema to name the rest. The
    schema named the group instead, with our keys beside it (``actor_rollout_ref.actor.
    checkpoint.x``: "unknown key actor_rollout_ref.actor.checkpoint; valid keys in actor:
    ..."; ``reward_model.x``: "unknown key reward_model; did you mean reward?")."""
    groups = _verl_only_groups()
    lines = []
    for _, _, path in list(leaves(raw)):
        first = next((i for i in range(1, len(path)) if not _ours(path[:i])), None)
        if first is None or ".".join(path[:first]) not in groups:
            continue  # a key of ours, or an unknown group the schema names
        key = ".".join(path)
        if any(key.startswith(g + ".") for g in OPEN_GROUPS):
            continue
        depth = max(i for i in range(first, len(path)) if ".".join(path[:i]) in groups)
        group, name = ".".join(path[:depth]), path[depth]
        theirs = spelled.get(key, key)
        theirs_group = theirs[: len(theirs) - len(key) + len(group)]  # the user's prefix
        names = sorted(groups[group] - {name})
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        fix = (
            f"did you mean {theirs_group}.{close[0]}?"
            if close
            else f"veRL's {theirs_group} holds {', '.join(names)}"
        )
        lines.append(f"unknown key {theirs}; {fix}")
        pop_dotted(raw, key)
    return lines


@functools.cache
def _verl_only_groups() -> dict[str, set[str]]:
    """Each group of veRL's table that is none of ours (our spelling) -> the names in it."""
    groups: dict[str, set[str]] = {}
    for verl_key in VERL_KEYS:
        parts = tuple(our_key(verl_key).split("."))
        for i in range(1, len(parts)):
            if not _ours(parts[:i]):
                groups.setdefault(".".join(parts[:i]), set()).add(parts[i])
    return groups


def _ours(path: tuple[str, ...]) -> bool:
    """Whether ``path`` is a key or group of the schema (or inside a mapping of ours)."""
    model: type[BaseModel] = Config
    for part in path:
        field = model.model_fields.get(part)
        if field is None:
            return False
        sub = field.annotation
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            return True  # a value, or a mapping of the user's own keys
        model = sub
    return True


def respelled(problem: str, spelled: dict[str, str]) -> str:
    """``unknown key rollout.x; did you mean rollout.y?`` in the user's veRL spelling; for
    an unknown group, the spelling of a key given under it; and a wrong value's key."""
    m = re.match(r"unknown key (\S+?); (did you mean (\S+)\?)?", problem)
    if m is None:  # "key: what is wrong (got ...)": the key as the user wrote it
        key, sep, rest = problem.partition(": ")
        return f"{spelled[key]}: {rest}" if sep and key in spelled else problem
    ours = m.group(1)
    theirs = spelled.get(ours) or next(
        (t[: len(t) - len(o) + len(ours)] for o, t in spelled.items() if o.startswith(ours + ".")),
        None,
    )
    if theirs is None:
        return problem
    close = m.group(3)
    out = problem.replace(f"unknown key {ours}", f"unknown key {theirs}", 1)
    given = re.search(r"\(given: (\S+)\)", out)
    if given and given.group(1) in spelled:
        out = out.replace(given.group(0), f"(given: {spelled[given.group(1)]})")
    for old, new in VERL_PREFIXES.items():  # the suggestion with the user's prefix too
        if close and theirs.startswith(old) and close.startswith(new):
            return out.replace(f"did you mean {close}?", f"did you mean {old}{close[len(new) :]}?")
    return out


def flatten_verl_groups(loaded: dict[str, Any]) -> dict[str, Any]:
    """Move ``actor_rollout_ref.{actor,rollout,model,ref}``, a top-level
    ``custom_reward_function`` and veRL's overlong buffer to our groups, merged key by key
    (as Hydra merges) into what the file gives in our spelling. One key given in both
    spellings with two values is refused: which of the two was meant cannot be told."""
    loaded = copy.deepcopy(loaded)  # the caller reads the file's own layout afterwards
    out: dict[str, Any] = {}
    for k, v in loaded.items():
        if k not in ("actor_rollout_ref", "custom_reward_function"):
            # A group whose keys are all commented out reads as null: it sets nothing.
            out[k] = {} if v is None and k in Config.model_fields else v
    conflicts: list[str] = []
    for name, sub in _mapping(loaded.get("actor_rollout_ref"), "actor_rollout_ref").items():
        theirs = f"actor_rollout_ref.{name}"
        if f"{theirs}." in VERL_PREFIXES:
            _merge_group(out, name, sub, theirs, conflicts)
        else:  # hybrid_engine, nccl_timeout (the group's own keys), or a misspelt group
            out.setdefault("actor_rollout_ref", {})[name] = sub
    if "custom_reward_function" in loaded:
        crf = _mapping(loaded["custom_reward_function"], "custom_reward_function")
        if "overlong_buffer" in crf:  # DAPO's scripts put the overlong penalty here
            buffer = crf.pop("overlong_buffer")
            theirs = "custom_reward_function.overlong_buffer"
            _merge_group(out, "reward.overlong_buffer", buffer, theirs, conflicts)
        theirs = "custom_reward_function"
        _merge_group(out, "reward.custom_reward_function", crf, theirs, conflicts)
    _move_verl_overlong(out, conflicts)
    if conflicts:
        raise ConfigError(conflicts)
    return out


def _move_verl_overlong(out: dict[str, Any], conflicts: list[str]) -> None:
    """``reward_model.overlong_buffer`` and ``reward_model.reward_kwargs.overlong_buffer_cfg``
    (veRL's DAPO and GSPO recipes) -> ``reward.overlong_buffer``; a group this empties goes."""
    verl_reward = out.get("reward_model")
    if not isinstance(verl_reward, dict):
        return
    kwargs = verl_reward.get("reward_kwargs")
    moved = False
    if isinstance(kwargs, dict) and "overlong_buffer_cfg" in kwargs:
        buffer, moved = kwargs.pop("overlong_buffer_cfg"), True
        theirs = "reward_model.reward_kwargs.overlong_buffer_cfg"
        _merge_group(out, "reward.overlong_buffer", buffer, theirs, conflicts)
        if not kwargs:
            del verl_reward["reward_kwargs"]
    if "overlong_buffer" in verl_reward:
        buffer, moved = verl_reward.pop("overlong_buffer"), True
        _merge_group(
            out, "reward.overlong_buffer", buffer, "reward_model.overlong_buffer", conflicts
        )
    if moved and not verl_reward:
        del out["reward_model"]


def _mapping(value: Any, name: str) -> dict[str, Any]:
    """A group's keys: YAML's null (every key commented out) is none; a list or a value where
    a group belongs is refused in one line, not a traceback from the merge."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError([f"{name} must be a mapping of keys, not {type(value).__name__}"])
    return value


def _merge_group(
    out: dict[str, Any], ours: str, src: Any, theirs: str, conflicts: list[str]
) -> None:
    """Merge the veRL group ``theirs`` (``src``) into our dotted group ``ours`` of ``out``,
    creating it (or an empty one, null) where the file leaves it out."""
    node = out
    parts = ours.split(".")
    for i, part in enumerate(parts):
        node[part] = _mapping(node.get(part), ".".join(parts[: i + 1]))
        node = node[part]
    _merge_spellings(node, _mapping(src, theirs), ours, theirs, conflicts)


def _merge_spellings(
    dst: dict[str, Any], src: dict[str, Any], ours: str, theirs: str, conflicts: list[str]
) -> None:
    """Merge ``src`` (spelt ``theirs``) into ``dst`` (spelt ``ours``) recursively; one line in
    ``conflicts`` per key the two give different values."""
    group = (dict, type(None))  # null where a group is: an empty one
    for k, v in src.items():
        old = dst.get(k)
        if k not in dst or old == v:
            dst[k] = v
        elif isinstance(old, group) and isinstance(v, group):
            dst[k] = old if old is not None else {}
            _merge_spellings(dst[k], v or {}, f"{ours}.{k}", f"{theirs}.{k}", conflicts)
        else:
            conflicts.append(
                f"{ours}.{k}={old!r} and {theirs}.{k}={v!r} are one key in two spellings, "
                "with different values: keep one of them"
            )


#: Top-level keys of veRL's recipe files that configure Hydra itself: where to look for
#: configs, and which to build on (``defaults: [ppo_trainer, _self_]``).
HYDRA_GROUPS = ("hydra", "defaults")


def drop_hydra_entries(loaded: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``loaded`` without Hydra's own entries (veRL's ``_target_`` class names, at any
    depth, and a recipe file's top-level ``hydra`` and ``defaults``), and the one note
    saying what was dropped (None when nothing was). They name Python classes and config
    files to build veRL's objects from; a key left out reads as this project's default,
    which the loader warns about where it differs from veRL's."""
    targets = 0

    def strip(node: dict[str, Any]) -> dict[str, Any]:
        nonlocal targets
        out = {}
        for k, v in node.items():
            if k == "_target_":
                targets += 1
            else:
                out[k] = strip(v) if isinstance(v, dict) else v
        return out

    top = [k for k in HYDRA_GROUPS if k in loaded]
    cleaned = strip({k: v for k, v in loaded.items() if k not in top})
    if not top and not targets:
        return cleaned, None
    what = [f"{k}:" for k in top] + ([f"{targets} _target_ entries"] if targets else [])
    return cleaned, (
        f"veRL's Hydra entries dropped ({', '.join(what)}): they tell Hydra which classes and "
        "config files to build veRL from; keys this config leaves out take this project's "
        "defaults"
    )
