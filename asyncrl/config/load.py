"""Reading a run config: YAML file + veRL/Hydra-style dotted overrides -> :class:`Config`.

``load_config("configs/cpu_demo.yaml", ["staleness.max_policy_lag=4"])`` merges the
overrides into the YAML, validates the result against the schema and the cross-field rules,
and raises :class:`ConfigError` with one line per problem, each naming the key and, for a
misspelt key, the nearest valid one.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.errors import ConfigError as ConfigError
from asyncrl.config.explain import explain, not_deletable
from asyncrl.config.interpolate import InterpolationError, leaves, resolve_references
from asyncrl.config.overrides import our_dotted, parse_override
from asyncrl.config.recipes import gspo_defaults
from asyncrl.config.resolved import (
    PATH_KEY,
    WRITTEN,
    absolute_paths,
    restore_written,
    written_keys,
)
from asyncrl.config.rules import capacity_needed, cross_field_problems
from asyncrl.config.schema import Config
from asyncrl.config.verl_compat import (
    RENAMED,
    apply_verl_keys,
    default_gaps,
    drop_verl_loggers,
    dtype_line,
    epochs_imply_steps,
    null_filter_metric,
    plan_verl_keys,
    pop_dotted,
    speaks_verl,
)
from asyncrl.config.verl_groups import (
    applied_spellings,
    drop_hydra_entries,
    flatten_verl_groups,
    respelled,
    unknown_verl_children,
    unknown_verl_leaves,
    verl_spellings,
)
from asyncrl.config.verl_key import lookup, our_key
from asyncrl.config.verl_table import VERL_KEYS, unsampled_validation
from asyncrl.config.yaml_read import DuplicateKeyError, dump_yaml, read_yaml

log = logging.getLogger(__name__)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (or the built-in defaults when None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    loaded: dict[str, Any] | None = None
    recorded: list[str] | None = None  # the keys a resolved config.yaml says were written
    hydra: str | None = None
    if path is not None:
        path = Path(path)
        loaded = _read_file(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                [f"{path} must hold a mapping of groups, not {type(loaded).__name__}"]
            )
        recorded = _recorded(path, loaded)
        if loaded:  # veRL's own layout: its Hydra entries configure Hydra, not a run
            loaded, hydra = drop_hydra_entries(loaded)
            if hydra:
                log.info("%s", hydra)
        raw = flatten_verl_groups(loaded or {})
    spelled = verl_spellings(loaded, overrides)
    given, deleted = _apply_overrides(raw, overrides)
    # Which of our keys veRL's mapped keys set, before ${...} resolve: a reference reads the
    # value the run will use (${data.max_response_length} reads veRL's response_length).
    plan = plan_verl_keys(raw, frozenset(given))
    spelled = applied_spellings(spelled, plan)
    try:
        resolve_references(raw, _defaults(), plan, RENAMED)
    except InterpolationError as e:
        raise ConfigError([str(e)]) from None
    _expand_home(raw)
    greedy = unsampled_validation(raw, spelled)  # before the table takes do_sample out
    notes, problems = apply_verl_keys(raw, plan)
    problems += [greedy] if greedy else []
    if metric_problem := null_filter_metric(raw):
        problems.append(metric_problem)
    if problems:
        raise ConfigError(problems)
    for note in notes:
        log.info("%s", note)
    if loggers := drop_verl_loggers(raw):
        log.warning("%s", loggers)
    if hydra or speaks_verl(loaded if path is not None else None, overrides):
        _verl_defaults(raw)
    elif note := epochs_cap_steps(raw):
        log.info("%s", note)
    if problems := unknown_verl_children(raw):
        raise ConfigError(problems)
    stray = unknown_verl_leaves(raw, spelled)  # taken out: the schema names the rest
    try:
        cfg = validate(raw)
    except ConfigError as e:  # an unknown key is named as the user wrote it
        raise ConfigError(stray + [respelled(p, spelled) for p in e.problems]) from None
    if stray:
        raise ConfigError(stray)
    if recorded is not None:  # what the user wrote, not every key the file sets
        mapped = [t for k, r in VERL_KEYS.items() if our_key(k) in given for t in r.target]
        kept = [k for k in recorded if not _under(k, deleted)]  # ~key: back to its default
        restore_written(cfg, [*kept, *given, *mapped])
    return cfg


def _recorded(path: Path, loaded: dict[str, Any] | None) -> list[str] | None:
    """Take :data:`WRITTEN` out of a resolved config (None for the user's own file)."""
    if not loaded or WRITTEN not in loaded:
        return None
    keys = loaded.pop(WRITTEN)
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ConfigError([f"{path}: {WRITTEN} must list dotted keys (write_resolved writes it)"])
    return keys


def _read_file(path: Path) -> Any:
    """The file's YAML, read as an override's value is (:mod:`asyncrl.config.yaml_read`);
    a folder, a missing file, text that is not UTF-8, bad YAML and a key given twice are
    refused in one line each."""
    if path.is_dir():
        some = ", ".join(str(p) for p in sorted(path.glob("*.yaml"))[:3])
        return _refuse(
            f"config {path} is a directory; pass a YAML file" + (f" ({some}, ...)" if some else "")
        )
    if not path.is_file():
        return _refuse(f"config file {path} not found; pass an existing YAML file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return _refuse(
            f"{path} is not UTF-8 text (line {line}: byte {data[e.start]:#04x}); save it as UTF-8"
        )
    try:
        return read_yaml(text, lambda dotted: _text_key(our_key(dotted)))
    except DuplicateKeyError as e:
        return _refuse(f"{path} {e}")
    except yaml.YAMLError as e:
        return _refuse(f"{path} is not valid YAML: {e}")


def _refuse(problem: str) -> Any:
    raise ConfigError([problem])


def _apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> tuple[set[str], set[str]]:
    """Apply the command line to ``raw``; return the dotted leaves it set (they win over the
    file's values when veRL keys are mapped) and the keys it deleted (``~key``)."""
    given: set[str] = set()
    deleted: set[str] = set()
    for item in overrides:
        if item.strip().startswith("~"):  # Hydra's "~key": remove it
            written, eq, expected = item.strip()[1:].partition("=")
            written = written.strip()
            key = our_dotted(written)
            found, old = pop_dotted(raw, key)
            if not found and (problem := not_deletable(written, key)):
                raise ConfigError([problem])
            if found and eq and (want := parse_override(f"{key}={expected}")[1]) != old:
                raise ConfigError(  # Hydra's rule: ~key=value deletes only that value
                    [
                        f"{item.strip()}: {written} is {old!r}, not {want!r}; write "
                        f"~{written} to delete it whatever its value"
                    ]
                )
            given.difference_update({g for g in given if _under(g, {key})})
            deleted.add(key)
            continue
        key, value = parse_override(item)
        if _is_number(value) and _text_key(key):  # the text typed: 1.10 is not 1.1
            value = item.split("=", 1)[1].strip()
        for group, sub in _verl_group_items(key, value):
            # A mapping merges into the group (set_dotted), so each of its leaves is what was
            # given: a leaf of the file's left beside them must not count as the command
            # line's.
            set_here = _override_leaves(group, sub)
            for leaf, leaf_value in set_here:
                if leaf in given and lookup(raw, leaf)[1] != leaf_value:
                    log.warning(
                        "%s is given twice on the command line: the last, %r, wins",
                        leaf,
                        leaf_value,
                    )
            set_dotted(raw, group, sub)
            given.update(leaf for leaf, _ in set_here)
    return given, deleted


def _verl_group_items(key: str, value: Any) -> list[tuple[str, Any]]:
    """An override as (group, value) pairs of our layout: a whole veRL group given on the
    command line (``actor_rollout_ref={rollout: {n: 4}}``, as Hydra merges it) moves to our
    groups as a file's does; any other override is itself."""
    if key in ("actor_rollout_ref", "custom_reward_function") and isinstance(value, dict):
        return list(flatten_verl_groups({key: value}).items())
    return [(key, value)]


def _under(key: str, groups: set[str]) -> bool:
    """Whether dotted ``key`` is one of ``groups`` or inside one."""
    return any(key == g or key.startswith(g + ".") for g in groups)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text_key(key: str) -> bool:
    """Whether the schema types ``key`` (dotted, ours) as text, optional or not: a number
    given for it is kept as typed (``trainer.experiment_name=1.10`` would otherwise name
    the run ``1.1``, the folder of another run that ``auto`` would resume)."""
    model: type[BaseModel] = Config
    *groups, name = key.split(".")
    for group in groups:
        sub = model.model_fields.get(group)
        if sub is None or not (
            isinstance(sub.annotation, type) and issubclass(sub.annotation, BaseModel)
        ):
            return False
        model = sub.annotation
    field = model.model_fields.get(name)
    if field is None:
        return False
    kinds = set(typing.get_args(field.annotation)) or {field.annotation}
    return str in kinds and kinds <= {str, type(None)}


def _override_leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of each leaf one override sets (a mapping sets several)."""
    if not isinstance(value, dict) or not value:
        return [(key, value)]
    return [(".".join((key, *path)), group[name]) for group, name, path in leaves(value)]


def _verl_defaults(raw: dict[str, Any]) -> None:
    """A config written for veRL: its epochs without steps count the steps as veRL does,
    and a key it leaves out whose default differs here gets this project's default: say
    so, once, naming veRL's (and the dtype veRL generates in, on CUDA)."""
    from asyncrl.config.verl_doc import verl_leaves  # here: `python -m` runs that module

    if note := epochs_imply_steps(raw):
        log.info("%s", note)
    gaps = default_gaps(raw, _defaults_for(raw), verl_leaves())
    if gaps:
        key, _, theirs = gaps[0]
        ranks = lookup(raw, "trainer.nproc")[1]
        cpu_ranks = (
            f"; on the CPU, trainer.n_gpus_per_node={ranks} is {ranks} CPU ranks"
            if key == "trainer.device" and isinstance(ranks, int) and ranks > 1
            else ""
        )
        log.warning(
            "this config is written for veRL but leaves out keys whose default differs here: "
            "%s; set them to run as veRL would (e.g. %s=%s)%s",
            ", ".join(f"{k}={ours!r} (veRL: {v!r})" for k, ours, v in gaps),
            key,
            "null" if theirs is None else theirs,
            cpu_ranks,
        )
    if line := dtype_line(raw, _defaults()):
        log.warning("%s", line)


def epochs_cap_steps(raw: dict[str, Any]) -> str | None:
    """In this project's layout ``trainer.total_epochs`` only ends a run sooner: given
    without ``trainer.total_training_steps`` the default step count still holds, which a
    user who meant epochs (as veRL counts them) should hear; the note to log, or None."""
    epochs_given, epochs = lookup(raw, "trainer.total_epochs")
    if not epochs_given or lookup(raw, "trainer.total_training_steps")[0]:
        return None
    steps = lookup(_defaults(), "trainer.total_training_steps")[1]
    return (
        f"trainer.total_epochs={epochs} without trainer.total_training_steps: the run lasts "
        f"the default {steps} steps, or less where {epochs} epochs of the data end sooner; "
        f"set trainer.total_training_steps=null to train {epochs} epochs"
    )


def _defaults_for(raw: dict[str, Any]) -> dict[str, Any]:
    """Every key at the default it takes under ``raw``: with GSPO, the clip range is GSPO's
    (:func:`~asyncrl.config.recipes.gspo_defaults`), not the plain default (the warning of
    veRL's defaults named 0.28 where 4e-4 ran)."""
    actor = raw.get("actor")
    if not isinstance(actor, dict):
        return _defaults()
    filled = {k: v for k, v in gspo_defaults(actor).items() if k not in actor}
    if not filled:
        return _defaults()
    ours = copy.deepcopy(_defaults())
    ours["actor"].update(filled)
    return ours


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
        elif isinstance(k, str) and PATH_KEY.search(k):  # no shell expands ~ in a file
            if isinstance(v, str) and v.startswith("~"):
                node[k] = os.path.expanduser(v)
            elif isinstance(v, list):
                node[k] = [
                    os.path.expanduser(x) if isinstance(x, str) and x.startswith("~") else x
                    for x in v
                ]


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw[a][b][c] = value`` for ``key == "a.b.c"``, creating groups as needed.

    A mapping given for a group merges into it key by key, as Hydra merges it:
    ``actor.optim={weight_decay: 0.1}`` keeps the file's ``actor.optim.lr``."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError([f"override {key}: {prefix} is a value, not a group"])
        node = child
    old = node.get(parts[-1])
    if isinstance(value, dict) and isinstance(old, dict):
        _merge_over(old, value)
    else:
        node[parts[-1]] = value


def _merge_over(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """Merge ``src`` into ``dst`` recursively; a value of ``src`` wins over ``dst``'s."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge_over(dst[k], v)
        else:
            dst[k] = v


def validate(raw: dict[str, Any]) -> Config:
    """Schema and cross-field validation of a nested dict."""
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError([explain(err) for err in e.errors()]) from None
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
    data = cfg.model_dump(mode="json")
    absolute_paths(data)  # a role restarted by hand elsewhere reads the same files
    data[WRITTEN] = written_keys(cfg)  # its advisories then read as the launcher's
    tmp.write_text(dump_yaml(data))  # text such as '1e5' quoted: it reads back as text
    tmp.replace(out)  # atomic: a role reading it never sees half a file
    return out
