"""The settings a rollout server must share with the learner it serves.

Roles started by hand each read their own config; one given a different value for a key
below makes work the others reject or mis-train (a server with a longer
``data.max_response_length`` pushes groups the buffer refuses as oversize, over and over;
another ``model.path`` samples from another model). A server sends its values when it
registers and the coordinator refuses the registration, naming each key that differs
(the server exits 2, not restarted). Keys a server may set for itself (its speed settings,
its endpoint, its ports) are not among them, nor paths (``model.path``, the scorer's file),
which may differ from machine to machine for the same files.
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.config.schema import Config

#: Dotted keys whose values the server and the learner must agree on.
SHARED_KEYS = (
    "model.lora_rank",
    "model.lora_alpha",
    "sync.lora",
    "data.max_prompt_length",
    "data.max_response_length",
    "rollout.n",
    "rollout.multi_turn.enable",
    "algorithm.adv_estimator",
    "algorithm.filter_groups.enable",
    "algorithm.filter_groups.metric",
    "reward.custom_reward_function.name",
    "reward.overlong_buffer",
    "staleness.max_policy_lag",
)


def shared_settings(cfg: Config) -> dict[str, str]:
    """Each of :data:`SHARED_KEYS` -> its value in ``cfg``, as canonical JSON."""
    out = {}
    for key in SHARED_KEYS:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if hasattr(value, "model_dump"):
            value = value.model_dump(mode="json")
        out[key] = json.dumps(_whole_numbers(value), sort_keys=True, default=str)
    return out


def _whole_numbers(value: Any) -> Any:
    """``value`` with whole floats as ints, nested too: ``16`` and ``16.0`` are one setting
    (a float key given as an int, validated or assigned, keeps either form)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_whole_numbers(v) for v in value]
    return value


def settings_problems(learner: dict[str, str], server: dict[str, str]) -> list[str]:
    """One line per key both name with different values (a key only one side names, from
    another version of the code, is not judged)."""
    return [
        f"{key}={server[key]} on the server but {learner[key]} on the learner"
        for key in sorted(learner.keys() & server.keys())
        if learner[key] != server[key]
    ]
