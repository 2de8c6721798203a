"""What a resumed start says about the settings it changed since its checkpoint.

A checkpoint keeps the values of :data:`COMPARED` it was trained under (in its state
file's ``extra.settings``). A resume that changes one goes on under the new value, as
veRL's does, but says so in one line: a batch size, group size, learning rate or model
changed by an override left on the command line would otherwise pass unseen, and the
curves after the resume would be read as the same run's. The data and its order are not
here: a resume over other data is refused (``task_source.load_state_dict``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import reduce
from pathlib import Path
from typing import Any

from asyncrl.config.inputs import STATE_FILE
from asyncrl.config.schema import Config

#: The settings a resume compares with its checkpoint's: those that change what a step
#: trains on or how (the model, the batch and group sizes, the update, the estimator).
COMPARED = (
    "model.path",
    "model.lora_rank",
    "model.lora_alpha",
    "model.target_modules",
    "data.train_batch_size",
    "data.max_response_length",
    "rollout.n",
    "actor.ppo_mini_batch_size",
    "actor.ppo_epochs",
    "actor.optim.lr",
    "actor.loss_agg_mode",
    "actor.policy_loss.loss_mode",
    "algorithm.adv_estimator",
    "staleness.max_policy_lag",
)


def settings_of(cfg: Config) -> dict[str, Any]:
    """The values of :data:`COMPARED` under ``cfg`` (plain data, for the state file)."""
    return {key: reduce(getattr, key.split("."), cfg) for key in COMPARED}


def changed_settings(saved: Mapping[str, Any] | None, cfg: Config) -> list[str]:
    """``"<key> <saved> -> <now>"`` for each compared setting ``cfg`` changed since the
    checkpoint saved ``saved`` (None: a checkpoint from before they were kept: nothing)."""
    if not saved:
        return []
    now = settings_of(cfg)
    return [f"{k} {saved[k]} -> {now[k]}" for k in COMPARED if k in saved and saved[k] != now[k]]


def changed_line(changes: list[str], step: int, lora: bool = False) -> str | None:
    """One line for the resume's log (None when nothing changed). Under LoRA (``lora``)
    a checkpoint holds the adapters only, loaded onto ``model.path``'s weights and scaled
    by ``model.lora_alpha``: a change of either changes the resumed policy itself, which
    the line says."""
    if not changes:
        return None
    policy = [c.split()[0] for c in changes if c.split()[0] in ("model.path", "model.lora_alpha")]
    note = (
        f" Under LoRA the checkpoint holds the adapters only: with the new {' and '.join(policy)} "
        "the resumed policy is not the one saved."
        if lora and policy
        else ""
    )
    return (
        f"resuming step {step} with settings changed since its checkpoint: "
        f"{'; '.join(changes)}.{note} The run goes on under the new values; put them back to "
        "continue it as it was, or start over with trainer.resume_mode=disable"
    )


def saved_settings(checkpoint: Path) -> dict[str, Any] | None:
    """The settings a checkpoint folder's state file kept (None: none kept, or unreadable:
    the learner's load says what is wrong with it)."""
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
        settings = state["extra"]["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return settings if isinstance(settings, dict) else None


def launch_line(cfg: Config) -> str | None:
    """:func:`changed_line` for a launch under ``cfg`` that resumes its run's last checkpoint
    (``resume_mode=auto``), said before any role starts; None when it resumes none."""
    from asyncrl.config.ending import resumed_checkpoint

    if (resumed := resumed_checkpoint(cfg)) is None:
        return None
    step, folder = resumed
    changes = changed_settings(saved_settings(folder), cfg)
    return changed_line(changes, step, lora=cfg.model.lora_rank > 0)
