"""Reading veRL's keys: :func:`apply_verl_keys` takes every key of the table
(:mod:`asyncrl.config.verl_table`) that is not ours out of a raw config, sets what it maps
to, and says which have no effect here and which are refused.

It runs on the raw config (YAML and overrides, veRL's ``actor_rollout_ref.*`` prefixes
already moved to our groups) before validation; the keys veRL and this schema share need
nothing: the schema takes them.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.config.verl_table import VERL_KEYS, lookup, our_key, refused_value

log = logging.getLogger(__name__)

#: Keys whose default here differs from veRL's and changes what a run trains, or for how
#: long: a veRL script that leaves one out relied on veRL's (TinyZero's PPO script never
#: sets algorithm.adv_estimator, veRL's default being gae). veRL spelling; its defaults
#: are read from ``verl_ppo_trainer_keys.yaml``.
RESULT_DEFAULTS = (
    "algorithm.adv_estimator",
    "actor_rollout_ref.rollout.n",
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


def apply_verl_keys(
    raw: dict[str, Any], given: frozenset[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """Take every veRL key that is not ours out of ``raw``: set what a mapped one maps to,
    and return ``(notes, problems)``: one line per key mapped or accepted with no effect,
    one per value refused.

    ``given``: the dotted keys set on the command line (our spelling). When a mapped key and
    its target are both in ``raw``, the command line wins over the config file, as any
    override does (``actor_rollout_ref.rollout.response_length=16`` on the command line
    replaces the file's ``data.max_response_length``); from the same source, ours wins."""
    notes: list[str] = []
    problems: list[str] = []
    popped: list[tuple[str, Any]] = []
    per_rank: list[tuple[str, Any]] = []  # global micro-batches set, to divide by the ranks
    for key, rule in VERL_KEYS.items():
        if rule.kind == "implemented":
            continue
        found, value = pop_dotted(raw, our_key(key))
        if found:
            popped.append((key, value))
    for key, value in popped:  # after popping all: a rule may read the rest of the config
        rule = VERL_KEYS[key]
        if rule.kind == "refused":
            problem = refused_value(key, rule, value, raw)
            if problem:
                problems.append(problem)
            else:
                notes.append(f"veRL's {key}={value!r} is accepted: it is what happens here")
        elif rule.kind == "mapped":
            assert rule.convert is not None
            from_cli = _given(our_key(key), given)
            for target in rule.target:
                found, old = lookup(raw, target)
                if found and (_given(target, given) or not from_cli):
                    line = f"veRL's {key}={value!r} not applied: {target} is given too"
                    if old != rule.convert(value):  # the user loses one of two values
                        log.warning("%s, and wins with %r (set one of the two)", line, old)
                    else:
                        notes.append(line)
                    continue
                _set(raw, target, rule.convert(value))
                if rule.per_rank:
                    per_rank.append((target, value))
                over = f"; from the command line, over the config file's {old!r}" if found else ""
                notes.append(f"veRL's {key}={value!r} -> {target} ({rule.reason}){over}")
        else:
            notes.append(f"veRL's {key}={value!r} has no effect here: {rule.reason}")
    # After every key: trainer.n_gpus_per_node and nnodes may have just set the rank count.
    ranks = _int(raw, "trainer.nproc") * _int(raw, "launch.ray.learner_nodes")
    for target, value in per_rank:
        if isinstance(value, int) and ranks > 1:
            _set(raw, target, max(1, value // ranks))
            notes.append(f"{target}={max(1, value // ranks)}: {value} over {ranks} learner ranks")
    return notes, problems


def _int(raw: dict[str, Any], dotted: str) -> int:
    found, value = lookup(raw, dotted)
    if found and isinstance(value, str) and value.isdigit():  # from ${oc.env:...}
        value = int(value)
    return value if found and isinstance(value, int) and value > 0 else 1


def speaks_verl(loaded: dict[str, Any] | None, overrides: list[str] | tuple[str, ...]) -> bool:
    """Whether a config is written for veRL from the ground up: a file in veRL's layout
    (an ``actor_rollout_ref`` group), or no file and veRL's spelling on the command line."""
    if loaded is not None:
        return "actor_rollout_ref" in loaded
    return any(o.lstrip("+~").startswith("actor_rollout_ref.") for o in overrides)


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
