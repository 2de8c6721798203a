"""The veRL key table as documents: ``VERL_KEYS.md`` (:func:`markdown`) and the list of a
veRL version's keys (:func:`leaves_of`, written to ``verl_ppo_trainer_keys.yaml``).

    python -m asyncrl.config.verl_doc markdown > asyncrl/config/VERL_KEYS.md
    python -m asyncrl.config.verl_doc leaves PATH/TO/_generated_ppo_trainer.yaml
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from typing import Any

import yaml

from asyncrl.config.interpolate import resolve_references
from asyncrl.config.verl_key import VerlKey, our_key
from asyncrl.config.verl_table import VERL_KEYS

KEYS_FILE = Path(__file__).with_name("verl_ppo_trainer_keys.yaml")


def markdown() -> str:
    """``VERL_KEYS.md``: one row per key, with veRL's default."""
    defaults = verl_leaves()
    counts: dict[str, int] = {}
    rows = []
    for key in sorted(set(defaults) | set(VERL_KEYS)):
        rule = VERL_KEYS.get(key)
        kind = rule.kind if rule else "MISSING"
        counts[kind] = counts.get(kind, 0) + 1
        default = repr(defaults[key]) if key in defaults else "(recipe key)"
        rows.append(f"| `{key}` | `{default}` | {kind} | {_what(key, rule)} |")
    summary = ", ".join(f"{counts[k]} {k}" for k in sorted(counts))
    head = [
        "# veRL's trainer config, key by key",
        "",
        "Every leaf of veRL's `ppo_trainer.yaml` (at commit 035682e of volcengine/verl, "
        "listed in `verl_ppo_trainer_keys.yaml`), and the recipe keys (DAPO's "
        "`filter_groups` and `overlong_buffer`) veRL keeps outside it, with what each is "
        f"here: {summary}. Generated from `verl_table.py` "
        "(`python -m asyncrl.config.verl_doc markdown`); a test keeps both in step.",
        "",
        "| veRL key | veRL default | here | our key, or why |",
        "|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def _what(key: str, rule: VerlKey | None) -> str:
    if rule is None:
        return "not in the table"
    if rule.kind == "implemented":
        return f"`{our_key(key)}`" + (f" ({rule.reason})" if rule.reason else "")
    if rule.kind == "mapped":
        return ", ".join(f"`{t}`" for t in rule.target) + f": {rule.reason}"
    return rule.reason.replace("|", "/")


@functools.cache
def verl_leaves(path: Path = KEYS_FILE) -> dict[str, Any]:
    """The veRL keys and defaults of ``verl_ppo_trainer_keys.yaml`` (read once; callers
    only read it)."""
    return yaml.safe_load(path.read_text())


def leaves_of(tree: dict[str, Any]) -> dict[str, Any]:
    """The leaves of a veRL config tree (``_target_`` left out) as ``{dotted: default}``,
    each ``${key}`` / ``${oc.select:key,default}`` interpolation resolved. A key the tree
    writes as an interpolation is one leaf, whatever it resolves to: veRL's
    ``rollout.profiler.tool_config: ${oc.select:actor_rollout_ref.actor.profiler.tool_config,
    null}`` is one key (its default the actor's group), not the actor's keys again."""
    resolved = copy.deepcopy(tree)
    resolve_references(resolved, {})
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], values: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if k == "_target_":
                continue
            if isinstance(v, dict) and v:
                walk(v, values[k], f"{prefix}{k}.")
            else:
                flat[prefix + k] = _without_targets(values[k])

    walk(tree, resolved, "")
    return flat


def _without_targets(value: Any) -> Any:
    """``value`` with Hydra's ``_target_`` entries left out, at any depth."""
    if not isinstance(value, dict):
        return value
    return {k: _without_targets(v) for k, v in value.items() if k != "_target_"}


def main(argv: list[str]) -> int:
    """``markdown``: print the table; ``leaves PATH``: print a veRL yaml's leaves in the
    format of ``verl_ppo_trainer_keys.yaml``."""
    if argv[:1] == ["markdown"]:
        sys.stdout.write(markdown())
        return 0
    if argv[:1] == ["leaves"] and len(argv) == 2:
        flat = leaves_of(yaml.safe_load(Path(argv[1]).read_text()))
        for key, value in flat.items():
            line = yaml.safe_dump({key: value}, default_flow_style=True, width=sys.maxsize)
            sys.stdout.write(line[1:-2] + "\n")
        return 0
    sys.stderr.write("usage: python -m asyncrl.config.verl_doc markdown | leaves PATH\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
