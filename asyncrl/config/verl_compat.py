"""Reading veRL's keys: every key of the table (:mod:`asyncrl.config.verl_table`) that is
not ours is taken out of a raw config, what a mapped one maps to is set, and which have no
effect here and which are refused is said. In two steps, around the ``${...}`` references:

- :func:`plan_verl_keys`, before they are resolved: which of our keys take a mapped veRL
  key's value (the command line wins over the file, as any override does). A reference
  then reads the value the run will use (:mod:`asyncrl.config.interpolate`):
  ``${data.max_response_length}`` reads ``actor_rollout_ref.rollout.response_length``'s
  value, ``${trainer.n_gpus_per_node}`` reads ``trainer.nproc`` (:data:`RENAMED`).
- :func:`apply_verl_keys`, after: the values, converted and refused, once resolved.

Both run on the raw config (YAML and overrides, veRL's ``actor_rollout_ref.*`` prefixes
already moved to our groups) before validation; the keys veRL and this schema share need
nothing: the schema takes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from asyncrl.config.verl_key import VerlKey, lookup, our_key, refused_value
from asyncrl.config.verl_table import VERL_KEYS

log = logging.getLogger(__name__)

#: Keys whose default here differs from veRL's and changes what a run trains, or for how
#: long: a veRL script that leaves one out relied on veRL's (TinyZero's PPO script never
#: sets algorithm.adv_estimator, veRL's default being gae). veRL spelling; its defaults
#: are read from ``verl_ppo_trainer_keys.yaml``. The device comes first: the warning's
#: example names the first gap, and a run on the CPU is the gap that changes the most (a
#: veRL script's trainer.n_gpus_per_node=8 would be 8 CPU ranks).
RESULT_DEFAULTS = (
    "trainer.device",
    "algorithm.adv_estimator",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.clip_ratio_low",  # differs under GSPO (its own range)
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.truncation",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
)


def pop_dotted(raw: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """Remove ``raw[a][b]...`` for ``dotted`` (and the groups it empties); (found, value)."""
    parts = dotted.split(".")
    nodes = [raw]
    for part in parts[:-1]:
        child = nodes[-1].get(part)
        if not isinstance(child, dict):
            return False, None
        nodes.append(child)
    if parts[-1] not in nodes[-1]:
        return False, None
    value = nodes[-1].pop(parts[-1])
    for depth in range(len(parts) - 1, 0, -1):  # drop groups left empty
        if not nodes[depth]:
            del nodes[depth - 1][parts[depth - 1]]
    return True, value


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _given(dotted: str, given: frozenset[str]) -> bool:
    """Whether ``dotted``, or a group holding it, was set on the command line."""
    parts = dotted.split(".")
    return any(".".join(parts[:i]) in given for i in range(1, len(parts) + 1))


#: veRL's keys that are another name for one key of ours (our spelling of veRL's -> ours):
#: a reference to one the config leaves out reads ours, as the run has it.
RENAMED = {our_key(k): rule.renames for k, rule in VERL_KEYS.items() if rule.renames}


@dataclass(frozen=True)
class VerlMove:
    """Mapped veRL key ``key`` (``source``: where the raw config holds it) gives one of our
    keys its value (an :class:`~asyncrl.config.interpolate.Moved`)."""

    key: str
    source: str
    rule: VerlKey

    @property
    def null_is_unset(self) -> bool:
        """veRL's older global micro-batch at null sets nothing (see apply_verl_keys)."""
        return self.rule.per_rank

    def value(self, given: Any, read: Callable[[str], Any]) -> Any:
        """Our key's value from veRL's (``read``: another key's value, for the ranks)."""
        assert self.rule.convert is not None
        value = self.rule.convert(given)
        if self.rule.per_rank and isinstance(value, str) and value.isdigit():
            value = int(value)  # ${oc.env:...} gives text: a count all the same
        if not self.rule.per_rank or isinstance(value, bool) or not isinstance(value, int):
            return value
        if value <= 0:  # not a size: passed on for the schema to refuse under our key
            return value
        ranks = _count(read("trainer.nproc")) * _count(read("launch.ray.learner_nodes"))
        return max(1, value // ranks)


def plan_verl_keys(raw: dict[str, Any], given: frozenset[str] = frozenset()) -> dict[str, VerlMove]:
    """Which of our keys take a mapped veRL key's value: our dotted key -> the move. Decided
    before the references are resolved (so that they read the run's values), from which
    keys are present, not from their values.

    ``given``: the dotted keys set on the command line (our spelling). When a mapped key and
    its target are both in ``raw``, the command line wins over the config file, as any
    override does (``actor_rollout_ref.rollout.response_length=16`` on the command line
    replaces the file's ``data.max_response_length``); from the same source, ours wins (of
    two veRL keys mapped to one of ours, the first in the table)."""
    plan: dict[str, VerlMove] = {}
    for key, rule in VERL_KEYS.items():
        if rule.kind != "mapped":
            continue
        source = our_key(key)
        found, value = lookup(raw, source)
        if not found or (rule.per_rank and value is None):
            # veRL's older global micro-batch at its unset value (veRL's own yaml and DAPO's
            # scripts write it): veRL reads null as not given, so it sets nothing here.
            continue
        from_cli = _given(source, given)
        for target in rule.target:
            found, now = lookup(raw, target)
            # A target at null is not given where veRL reads null as unset (its own yaml
            # writes ppo_micro_batch_size_per_gpu: null beside ppo_micro_batch_size: 8).
            present = target in plan or (found and not (now is None and rule.null_target_unset))
            if not present or (from_cli and not _given(target, given)):
                plan[target] = VerlMove(key, source, rule)
    return plan


def apply_verl_keys(
    raw: dict[str, Any], plan: Mapping[str, VerlMove]
) -> tuple[list[str], list[str]]:
    """Take every veRL key that is not ours out of ``raw`` (its references resolved): set
    what :func:`plan_verl_keys` moved, and return ``(notes, problems)``: one line per key
    mapped or accepted with no effect, one per value refused."""
    notes: list[str] = []
    problems: list[str] = []
    popped: list[tuple[str, Any]] = []
    for key, rule in VERL_KEYS.items():
        if rule.kind == "implemented":
            continue
        found, value = pop_dotted(raw, our_key(key))
        if found:
            popped.append((key, value))
    values = {our_key(key): value for key, value in popped}
    replaced: dict[str, tuple[bool, Any]] = {}  # a target's own value, before it was set
    # The per-rank micro-batches last: trainer.n_gpus_per_node and nnodes set the rank count.
    for target, move in sorted(plan.items(), key=lambda item: item[1].rule.per_rank):
        if values[move.source] is None and move.rule.per_rank:
            continue  # null once resolved: not given, as above
        replaced[target] = lookup(raw, target)
        _set(raw, target, move.value(values[move.source], lambda k: lookup(raw, k)[1]))
    ranks = _count(lookup(raw, "trainer.nproc")[1])
    ranks *= _count(lookup(raw, "launch.ray.learner_nodes")[1])
    for key, value in popped:  # after popping all: a rule may read the rest of the config
        rule = VERL_KEYS[key]
        if rule.per_rank and value is None:
            continue
        if rule.kind == "refused":
            problem = refused_value(key, rule, value, raw)
            if problem:
                problems.append(problem)
            else:
                does = rule.accepted(value, raw) if rule.accepted else "it is what happens here"
                notes.append(f"veRL's {key}={value!r} is accepted: {does}")
        elif rule.kind == "mapped":
            assert rule.convert is not None
            for target in rule.target:
                move = plan.get(target)
                if move is None or move.key != key:
                    other = target if move is None else move.key
                    line = f"veRL's {key}={value!r} not applied: {other} is given too"
                    old = lookup(raw, target)[1]
                    if old != rule.convert(value):  # the user loses one of two values
                        log.warning("%s, and wins with %r (set one of the two)", line, old)
                    else:
                        notes.append(line)
                    continue
                found, old = replaced[target]
                over = f"; from the command line, over the config file's {old!r}" if found else ""
                notes.append(f"veRL's {key}={value!r} -> {target} ({rule.reason}){over}")
                if rule.per_rank and isinstance(value, int) and ranks > 1:
                    now = lookup(raw, target)[1]
                    notes.append(f"{target}={now}: {value} over {ranks} learner ranks")
        else:
            notes.append(f"veRL's {key}={value!r} has no effect here: {rule.reason}")
    return notes, problems


def _count(value: Any) -> int:
    """A rank count as given (``${oc.env:...}`` gives text); 1 when unset or not one."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def speaks_verl(loaded: dict[str, Any] | None, overrides: list[str] | tuple[str, ...]) -> bool:
    """Whether a config is written for veRL from the ground up: a file in veRL's layout
    (an ``actor_rollout_ref`` group); or veRL's spelling on the command line over no file,
    or over a file of only groups veRL has too (a user's own veRL-layout file, its actor's
    keys given on the command line: it counted as this project's, and its
    ``trainer.total_epochs`` and veRL's defaults were silently not veRL's)."""
    from asyncrl.config.verl_doc import verl_leaves  # here: `python -m` runs that module

    if loaded is not None and "actor_rollout_ref" in loaded:
        return True
    on_cli = any(o.lstrip("+~").startswith("actor_rollout_ref.") for o in overrides)
    if not loaded or not on_cli:
        return on_cli
    return set(loaded) <= {key.split(".")[0] for key in verl_leaves()}


def default_gaps(
    raw: dict[str, Any], ours: dict[str, Any], verl: dict[str, Any]
) -> list[tuple[str, Any, Any]]:
    """``(our key, our default, veRL's default)`` for each of :data:`RESULT_DEFAULTS` that
    ``raw`` (after the veRL keys were applied) leaves out and whose default here (``ours``:
    every key at its default) differs from veRL's (``verl``: veRL's leaves and defaults)."""
    out = []
    for key in RESULT_DEFAULTS:
        mine = our_key(key)
        if lookup(raw, mine)[0] or key not in verl:
            continue
        found, here = lookup(ours, mine)
        if found and here != verl[key]:
            out.append((mine, here, verl[key]))
    return out


#: veRL's metric backends (its ``Tracking``) that are not built here. The run's metrics do
#: not depend on them, and every metric is written to ``metrics.jsonl`` in the run directory
#: whatever the logger, so a veRL script naming one runs, with a warning, rather than fails.
VERL_ONLY_LOGGERS = (
    "tensorboard",
    "swanlab",
    "mlflow",
    "vemlp_wandb",
    "clearml",
    "trackio",
    "file",
    "localfile",
)


def drop_verl_loggers(raw: dict[str, Any]) -> str | None:
    """Take veRL's logger backends that are not built here (:data:`VERL_ONLY_LOGGERS`) out
    of ``trainer.logger``; the warning to give, or None. A name neither veRL nor this
    project knows stays, for the schema to refuse with the accepted values."""
    found, value = lookup(raw, "trainer.logger")
    names = [value] if isinstance(value, str) else value
    if not found or not isinstance(names, list):
        return None
    dropped = [n for n in names if isinstance(n, str) and n.lower() in VERL_ONLY_LOGGERS]
    if not dropped:
        return None
    # Left with nothing, the console keeps the progress visible, as each veRL backend does.
    kept = [n for n in names if n not in dropped] or ["console"]
    _set(raw, "trainer.logger", kept)
    return (
        f"trainer.logger: {', '.join(dropped)} not supported here (the accepted loggers are "
        f"console, jsonl and wandb), left out: logging with {kept}; every metric is written "
        "to metrics.jsonl in the run directory either way"
    )


def null_filter_metric(raw: dict[str, Any]) -> str | None:
    """``algorithm.filter_groups.metric: null`` (veRL's default, in its recipe yaml): with the
    filter off it is unset (the key is taken out); with it on, the problem line, since veRL
    then fails at its first batch (it reads the group's values under a metric named None)."""
    found, metric = lookup(raw, "algorithm.filter_groups.metric")
    if not found or metric is not None:
        return None
    _, enable = lookup(raw, "algorithm.filter_groups.enable")
    try:
        on = TypeAdapter(bool).validate_python(enable or False)
    except ValidationError:  # not a boolean: the schema names it
        on = False
    if on:
        return (
            "algorithm.filter_groups.enable=true with algorithm.filter_groups.metric=null: the "
            "filter needs a value to compare within a group (veRL fails here too); set "
            "algorithm.filter_groups.metric=acc"
        )
    pop_dotted(raw, "algorithm.filter_groups.metric")
    return None


def epochs_imply_steps(raw: dict[str, Any]) -> str | None:
    """A config written for veRL that gives ``trainer.total_epochs`` but no
    ``trainer.total_training_steps`` means epochs: the steps are counted from them, as veRL
    counts them (``total_training_steps: null``); the note to log, or None."""
    epochs_given, epochs = lookup(raw, "trainer.total_epochs")
    if not epochs_given or lookup(raw, "trainer.total_training_steps")[0]:
        return None
    _set(raw, "trainer.total_training_steps", None)
    return (
        f"trainer.total_epochs={epochs} given without trainer.total_training_steps: the run "
        "lasts that many epochs, as in veRL (trainer.total_training_steps=null: the whole "
        "batches in the training rows times the epochs)"
    )


def dtype_line(raw: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """A config written for veRL that runs on CUDA and leaves ``model.dtype`` at this
    project's float32: what veRL does instead (its rollout samples in bfloat16), or None.

    Here ``model.dtype`` is the dtype of the rollout servers' engines and of the weights
    pushed to them and exported; the learner keeps float32 weights and computes in bfloat16
    on CUDA (FSDP mixed precision) whatever it says, as veRL's actor does."""
    if lookup(raw, "model.dtype")[0]:
        return None
    found, device = lookup(raw, "trainer.device")
    device = device if found else lookup(ours, "trainer.device")[1]
    dtype = lookup(ours, "model.dtype")[1]
    if device != "cuda" or dtype != "float32":
        return None
    return (
        "trainer.device=cuda with model.dtype left at float32: the rollout servers would "
        "generate in float32 (slower, twice the memory); veRL generates in bfloat16 "
        "(actor_rollout_ref.rollout.dtype) and its learner, like this one, keeps float32 "
        "weights and computes in bfloat16 on the GPU; set model.dtype=bfloat16 to run as "
        "veRL does"
    )
