"""One row of the veRL key table, and reading a veRL key here.

Each key of veRL's trainer config is, here (:mod:`asyncrl.config.verl_table` holds the
table, one :class:`VerlKey` per key):

- **implemented**: our key of the same name (after veRL's ``actor_rollout_ref.*`` prefixes
  move to our groups, :data:`VERL_PREFIXES`) means the same thing;
- **mapped**: set on one of our keys (``target``), converted where the units differ;
- **no_effect**: accepted, and logged once at start with the reason it does nothing here;
- **refused**: accepted only at the values that mean what this system does (``allowed``);
  any other value would be honoured differently and change results silently, so loading
  stops with a line naming what to use instead.

Here too: the dotted key a veRL key is read as (:func:`our_key`), a dotted key's value in a
raw config (:func:`lookup`), and a refused row's verdict on a value (:func:`refused_value`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["implemented", "mapped", "no_effect", "refused"]

# veRL nests actor, rollout, ref and model under ``actor_rollout_ref`` and puts the custom
# reward and DAPO's overlong buffer elsewhere; our groups of the same meaning.
VERL_PREFIXES = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.model.": "model.",
    "actor_rollout_ref.ref.": "ref.",
    "custom_reward_function.overlong_buffer.": "reward.overlong_buffer.",  # DAPO's scripts
    "custom_reward_function.": "reward.custom_reward_function.",
    "reward_model.overlong_buffer.": "reward.overlong_buffer.",
    # veRL's DAPO and GSPO recipes now pass it to the reward manager this way
    "reward_model.reward_kwargs.overlong_buffer_cfg.": "reward.overlong_buffer.",
}


def our_key(verl_key: str) -> str:
    """The dotted key a veRL key is read as here (its prefix moved to our group)."""
    for old, new in VERL_PREFIXES.items():
        if verl_key.startswith(old):
            return new + verl_key[len(old) :]
    return verl_key


@dataclass(frozen=True)
class VerlKey:
    """What one veRL key becomes here (see the module docstring for the kinds)."""

    kind: Kind
    reason: str = ""
    target: tuple[str, ...] = ()  # mapped: our dotted keys it sets
    convert: Callable[[Any], Any] | None = None  # mapped: veRL's value -> ours
    allowed: Callable[[Any, dict[str, Any]], bool] | None = None  # refused unless this holds
    # refused, yet allowed: what the accepted value does here (default: what veRL does)
    accepted: Callable[[Any, dict[str, Any]], str] | None = None
    bad: Any = None  # refused: a value that is refused (the table's test sets it)
    bad_with: tuple[str, ...] = ()  # refused: the overrides that make ``bad`` refused
    example: Any = ...  # a value the table's test sets instead of veRL's default
    per_rank: bool = False  # mapped: a global count, divided by the learner's ranks
    # mapped: a target at null is unset (veRL's yaml writes the per-GPU micro-batches and
    # the clip range's ends at null, and reads this key's value then)
    null_target_unset: bool = False

    @property
    def renames(self) -> str | None:
        """The one key of ours this mapped key is another name for (the same value, not
        divided by the ranks), else None: a reference to the veRL key reads it."""
        plain = self.kind == "mapped" and self.convert is unchanged and not self.per_rank
        return self.target[0] if plain and len(self.target) == 1 else None


def unchanged(value: Any) -> Any:
    """A mapped key's value as given (the units are ours)."""
    return value


def lookup(raw: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """``(found, value)`` of ``raw[a][b]...`` for ``dotted``."""
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def refused_value(key: str, rule: VerlKey, value: Any, raw: dict[str, Any]) -> str | None:
    """The one-line problem when ``rule`` refuses ``value`` in ``raw``, else None. A value
    its check cannot read (``num_cycles=half``) is refused in the same line, not raised."""
    if rule.kind != "refused":
        return None
    try:
        if rule.allowed and rule.allowed(value, raw):
            return None
    except (TypeError, ValueError, ArithmeticError):
        pass
    return f"{key}={value!r} is not supported here: {rule.reason}"
