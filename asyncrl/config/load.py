"""Reading a run config: YAML file + veRL/Hydra-style dotted overrides -> :class:`Config`.

``load_config("configs/cpu_demo.yaml", ["staleness.max_policy_lag=4"])`` merges the
overrides into the YAML, validates the result against the schema and the cross-field rules,
and raises :class:`ConfigError` with one line per problem, each naming the key and, for a
misspelt key, the nearest valid one.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from asyncrl.config.interpolate import InterpolationError, leaves, resolve_references
from asyncrl.config.rules import capacity_needed, cross_field_problems
from asyncrl.config.schema import Config
from asyncrl.config.verl_compat import apply_verl_keys, default_gaps, pop_dotted, speaks_verl
from asyncrl.config.verl_table import VERL_PREFIXES, lookup, our_key

log = logging.getLogger(__name__)

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
#: Keys holding paths: a leading ``~`` is the user's home (veRL's defaults write
#: ``~/data/...``, and no shell expands it inside a YAML file).
_PATH_KEY = re.compile(r"(path|paths|files?|dir)$")


class _OverrideLoader(yaml.SafeLoader):
    """YAML for one override value, read as Hydra reads it: ``true``/``false`` are the
    only booleans (``on``, ``off``, ``yes``, ``no`` stay text) and nothing is a date
    (``experiment_name=2025-01-20`` is text)."""


_HYDRA_ONLY = (":bool", ":timestamp", ":int", ":float")  # YAML 1.1's readings these replace
_OverrideLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith(_HYDRA_ONLY)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_OverrideLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|false)$", re.IGNORECASE), list("tTfF")
)
# Decimal numbers only: YAML 1.1 also reads 0615 (octal), 0x1f and 12:30 (base 60) as
# numbers, which would rename trainer.experiment_name=0615 to 397 without a word.
_OverrideLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789")
)
_OverrideLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)?\.[0-9]+(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9][0-9_]*\.(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


class ConfigError(ValueError):
    """A config that cannot run; ``str(err)`` lists every problem with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n  - " + "\n  - ".join(problems))


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (or the built-in defaults when None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    loaded: dict[str, Any] | None = None
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file {path} not found; pass an existing YAML file"])
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError([f"{path} is not valid YAML: {e}"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                [f"{path} must hold a mapping of groups, not {type(loaded).__name__}"]
            )
        raw = _flatten_verl_groups(loaded or {})
    given: set[str] = set()  # keys set on the command line: they win over the file's
    spelled = _verl_spellings(loaded, overrides)
    for item in overrides:
        if item.strip().startswith("~"):  # Hydra's "~key": remove it
            key = our_key(item.strip()[1:].split("=", 1)[0])
            pop_dotted(raw, key)
            given.discard(key)
            continue
        key, value = parse_override(item)
        if key in given and lookup(raw, key)[1] != value:
            log.warning("%s is given twice on the command line: the last, %r, wins", key, value)
        set_dotted(raw, key, value)
        given.add(key)
    try:
        resolve_references(raw, _defaults())
    except InterpolationError as e:
        raise ConfigError([str(e)]) from None
    _expand_home(raw)
    notes, problems = apply_verl_keys(raw, frozenset(given))
    if problems:
        raise ConfigError(problems)
    for note in notes:
        log.info("%s", note)
    if speaks_verl(loaded if path is not None else None, overrides):
        _warn_default_gaps(raw)
    try:
        return validate(raw)
    except ConfigError as e:  # an unknown key is named as the user wrote it
        raise ConfigError([_respelled(p, spelled) for p in e.problems]) from None


def _verl_spellings(loaded: dict[str, Any] | None, overrides: Iterable[str]) -> dict[str, str]:
    """Our dotted key -> the veRL spelling the user gave it in (``actor_rollout_ref.*``,
    ...): a typo there must be reported as typed, not as a key the user never wrote."""
    keys = [o.strip().lstrip("~+").split("=", 1)[0] for o in overrides]
    if isinstance(loaded, dict):
        keys += [".".join(path) for _, _, path in leaves(loaded)]
    return {our_key(k): k for k in keys if our_key(k) != k}


def _respelled(problem: str, spelled: dict[str, str]) -> str:
    """``unknown key rollout.x; did you mean rollout.y?`` in the user's veRL spelling."""
    m = re.match(r"unknown key (\S+?); (did you mean (\S+)\?)?", problem)
    if m is None or m.group(1) not in spelled:
        return problem
    ours, theirs, close = m.group(1), spelled[m.group(1)], m.group(3)
    out = problem.replace(f"unknown key {ours}", f"unknown key {theirs}", 1)
    for old, new in VERL_PREFIXES.items():  # the suggestion with the user's prefix too
        if close and theirs.startswith(old) and close.startswith(new):
            return out.replace(f"did you mean {close}?", f"did you mean {old}{close[len(new) :]}?")
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=1"`` -> ``("a.b", 1)``; values are YAML (numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError([f"override {item!r} is not key=value (e.g. rollout.n=8)"])
    key, text = item.split("=", 1)
    key = key.strip().lstrip("+")  # Hydra's "+key=" / "++key=" (add, force) mean "key=" here
    if not key:
        raise ConfigError([f"override {item!r} has an empty key"])
    try:
        value = yaml.load(text, Loader=_OverrideLoader) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # a plain string such as a path with a colon
    if isinstance(value, str) and _FLOAT.fullmatch(value):
        value = float(value)  # YAML 1.1 reads "1e-5" (no dot) as a string
    return our_key(key), value


def _warn_default_gaps(raw: dict[str, Any]) -> None:
    """A config written for veRL that leaves out a key whose default differs here gets
    this project's default: say so, once, naming veRL's."""
    from asyncrl.config.verl_doc import verl_leaves  # here: `python -m` runs that module

    gaps = default_gaps(raw, _defaults(), verl_leaves())
    if gaps:
        key, _, theirs = gaps[0]
        log.warning(
            "this config is written for veRL but leaves out keys whose default differs here: "
            "%s; set them to run as veRL would (e.g. %s=%s)",
            ", ".join(f"{k}={ours!r} (veRL: {v!r})" for k, ours, v in gaps),
            key,
            "null" if theirs is None else theirs,
        )


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every key at its default (what a ``${...}`` to a key left out reads); built once,
    and only read (a resolved reference is copied)."""
    return Config().model_dump(mode="json")


def _expand_home(node: dict[str, Any]) -> None:
    """``~/x`` -> the home folder's ``x``, in the values of path keys (lists too)."""
    for k, v in node.items():
        if isinstance(v, dict):
            _expand_home(v)
        elif isinstance(k, str) and _PATH_KEY.search(k):
            if isinstance(v, str) and v.startswith("~"):
                node[k] = os.path.expanduser(v)
            elif isinstance(v, list):
                node[k] = [
                    os.path.expanduser(x) if isinstance(x, str) and x.startswith("~") else x
                    for x in v
                ]


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw[a][b][c] = value`` for ``key == "a.b.c"``, creating groups as needed."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError([f"override {key}: {prefix} is a value, not a group"])
        node = child
    node[parts[-1]] = value


def validate(raw: dict[str, Any]) -> Config:
    """Schema and cross-field validation of a nested dict."""
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError([_explain(err) for err in e.errors()]) from None
    needed = capacity_needed(cfg)
    if "capacity_groups" not in cfg.buffer.model_fields_set and cfg.buffer.capacity_groups < needed:
        # Left at its default, the buffer is sized for the run (a veRL script with
        # train_batch_size=1024 and save_freq=20 needs 23552 groups); given, it is checked.
        log.info(
            "buffer.capacity_groups raised from its default %d to %d: the batches between "
            "checkpoints and the admission window (set it to choose)",
            cfg.buffer.capacity_groups,
            needed,
        )
        cfg.buffer.capacity_groups = needed
    problems = cross_field_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def run_dir(cfg: Config) -> Path:
    """``trainer.default_local_dir/project_name/experiment_name``: logs, checkpoints, plots.

    A ``default_local_dir`` that already ends in ``project_name/experiment_name`` is the run
    directory itself: veRL's default, ``checkpoints/${trainer.project_name}/
    ${trainer.experiment_name}``, and the scripts written after it name the run's own folder
    there, which must not be nested twice."""
    t = cfg.trainer
    root = Path(t.default_local_dir)
    if root.parts[-2:] == (t.project_name, t.experiment_name):
        return root
    return root / t.project_name / t.experiment_name


def write_resolved(cfg: Config, directory: Path | None = None) -> Path:
    """Write the resolved config as ``config.yaml`` in the run dir; a role restarted by hand
    passes this file back as its CONFIG."""
    directory = directory or run_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "config.yaml"
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tmp.replace(out)  # atomic: a role reading it never sees half a file
    return out


def _flatten_verl_groups(loaded: dict[str, Any]) -> dict[str, Any]:
    """Move ``actor_rollout_ref.{actor,rollout,model}`` and a top-level
    ``custom_reward_function`` to our groups."""
    out = {
        k: v for k, v in loaded.items() if k not in ("actor_rollout_ref", "custom_reward_function")
    }
    for name, sub in (loaded.get("actor_rollout_ref") or {}).items():
        if isinstance(sub, dict):
            out.setdefault(name, {}).update(sub)
        else:  # hybrid_engine, nccl_timeout: veRL keys of the group itself
            out.setdefault("actor_rollout_ref", {})[name] = sub
    if "custom_reward_function" in loaded:
        crf = dict(loaded["custom_reward_function"] or {})
        if "overlong_buffer" in crf:  # DAPO's scripts put the overlong penalty here
            out.setdefault("reward", {})["overlong_buffer"] = crf.pop("overlong_buffer")
        out.setdefault("reward", {})["custom_reward_function"] = crf
    verl_reward = out.get("reward_model")
    kwargs = verl_reward.get("reward_kwargs") if isinstance(verl_reward, dict) else None
    if (
        isinstance(verl_reward, dict)
        and isinstance(kwargs, dict)
        and "overlong_buffer_cfg" in kwargs
    ):
        out.setdefault("reward", {})["overlong_buffer"] = kwargs.pop("overlong_buffer_cfg")
        if not kwargs:
            del verl_reward["reward_kwargs"]
        if not verl_reward:
            del out["reward_model"]
    if isinstance(verl_reward, dict) and "overlong_buffer" in verl_reward:
        rest = {k: v for k, v in verl_reward.items() if k != "overlong_buffer"}
        out.setdefault("reward", {})["overlong_buffer"] = verl_reward["overlong_buffer"]
        if rest:
            out["reward_model"] = rest
        else:
            del out["reward_model"]
    return out


def _explain(err: ErrorDetails) -> str:
    """One line per pydantic error: the dotted key, what is wrong, the nearest valid key."""
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
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
        if isinstance(given, dict):  # a whole unknown group: say which keys were under it
            names = [".".join((key, *path)) for _, _, path in leaves(given)][:4]
            under = f" (given: {', '.join(names)})"
        fix = hint or f"valid keys in {group}: {', '.join(valid)}"
        return f"unknown key {key}; {fix}{under}"
    got = err.get("input")
    shown = repr(got) if not isinstance(got, dict) else "a mapping"
    return f"{key}: {err['msg'].lower()} (got {shown})"


def _valid_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
