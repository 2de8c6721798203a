"""What a resumed start says about the settings it changed since its checkpoint.

A checkpoint keeps the values of :data:`COMPARED` it was trained under (in its state
file's ``extra.settings``). A resume that changes one goes on under the new value, as
veRL's does, but says so in one line: a batch size, group size, learning rate or model
changed by an override left on the command line would otherwise pass unseen, and the
curves after the resume would be read as the same run's. The data and its order are not
here: a resume over other data is refused (``task_source.load_state_dict``).

The learning-rate schedule's settings (:data:`SCHEDULE`) are kept beside them but said
apart: raising the run's length is how a complete run trains on, yet under a decaying
schedule it moves the rate of the very next step, which the learner's line gives
(:func:`schedule_changes` names what moved it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import reduce
from pathlib import Path
from typing import Any

from asyncrl.config.critic import OptimConfig
from asyncrl.config.inputs import STATE_FILE, total_training_steps
from asyncrl.config.resolved import same_path
from asyncrl.config.schema import Config

#: The settings a resume compares with its checkpoint's: those that change what a step
#: trains on or how (the model, the batch and group sizes, the update, the estimator).
COMPARED = (
    "model.path",
    "critic.model.path",
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
    "algorithm.importance.mode",
    "algorithm.importance.cap",
    "algorithm.importance.level",
    "staleness.max_policy_lag",
    "staleness.sync_every",  # a replay after a change counts versions by the new one
    "staleness.controller",
    "staleness.min_policy_lag",
)


#: The optimizers with a learning-rate schedule: the actor's, and the critic's under GAE.
OPTIMIZERS = ("actor.optim", "critic.optim")

#: What sets the run's length, the total a decaying schedule ends at (the last two count
#: only when ``trainer.total_training_steps`` is null: the total is then derived).
LENGTH = ("trainer.total_training_steps", "trainer.total_epochs", "data.train_batch_size")

#: Each optimizer's schedule settings besides its rate (which :data:`COMPARED` holds).
SCHEDULE_KEYS = ("lr_scheduler_type", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio")

#: The settings a checkpoint keeps so that a resume can say how its schedule moved.
SCHEDULE = (*LENGTH, *(f"{o}.{k}" for o in OPTIMIZERS for k in SCHEDULE_KEYS))


def _value(cfg: Config, key: str) -> Any:
    """The value of a dotted key (``"actor.optim.lr"``) under ``cfg``."""
    return reduce(getattr, key.split("."), cfg)


def settings_of(cfg: Config) -> dict[str, Any]:
    """The values of :data:`COMPARED` and :data:`SCHEDULE` under ``cfg`` (plain data, for
    the state file)."""
    return {key: _value(cfg, key) for key in dict.fromkeys((*COMPARED, *SCHEDULE))}


def with_saved(cfg: Config, saved: Mapping[str, Any], keys: list[str]) -> Config:
    """``cfg`` with the checkpoint's values (``saved``) for ``keys``: the config it was
    trained under, as far as those settings go. ``cfg`` itself is left as it is."""

    def replaced(section: Any, parts: list[str], value: Any) -> Any:
        head, rest = parts[0], parts[1:]
        new = replaced(getattr(section, head), rest, value) if rest else value
        return section.model_copy(update={head: new})

    for key in keys:
        cfg = replaced(cfg, key.split("."), saved[key])
    return cfg


def optim_of(cfg: Config, optimizer: str) -> OptimConfig:
    """The section of ``cfg`` that :data:`OPTIMIZERS` names by ``optimizer``."""
    return cfg.actor.optim if optimizer == "actor.optim" else cfg.critic.optim


def schedule_of(cfg: Config, optimizer: str) -> tuple[Any, ...]:
    """What shapes ``optimizer``'s schedule under ``cfg`` (``"actor.optim"``): its kind,
    warmup steps, and for a decay its total and floor. Two configs with the same give the
    same rate at every step, for the same base rate. Counts the training rows only when
    the total matters and is derived."""
    optim = optim_of(cfg, optimizer)
    decays = optim.lr_scheduler_type != "constant"
    by_ratio = optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0
    total = total_training_steps(cfg) if decays or by_ratio else None
    warmup = optim.warmup_steps(total)
    kind = optim.lr_scheduler_type
    return (kind, warmup, total, optim.min_lr_ratio) if decays else (kind, warmup)


def schedule_settings(optimizer: str) -> list[str]:
    """The settings that shape ``optimizer``'s schedule besides its rate."""
    return [*LENGTH, *(f"{optimizer}.{k}" for k in SCHEDULE_KEYS)]


def kept_schedule(saved: Mapping[str, Any] | None, optimizer: str) -> bool:
    """Whether a checkpoint's ``saved`` settings hold ``optimizer``'s schedule settings
    (those from before they were kept do not)."""
    return saved is not None and all(k in saved for k in schedule_settings(optimizer))


def schedule_changes(saved: Mapping[str, Any] | None, cfg: Config, optimizer: str) -> list[str]:
    """``"<key> <saved> -> <now>"`` for each setting ``cfg`` changed since the checkpoint
    that moves ``optimizer``'s schedule: none when the schedule comes out the same (a
    longer run under a constant rate), or when the checkpoint kept no schedule settings
    (:func:`kept_schedule`; its saved rates tell whether the schedule moved)."""
    if saved is None or not kept_schedule(saved, optimizer):
        return []
    now = settings_of(cfg)
    changed = [k for k in schedule_settings(optimizer) if saved[k] != now[k]]
    if not changed:
        return []
    if schedule_of(with_saved(cfg, saved, changed), optimizer) == schedule_of(cfg, optimizer):
        return []
    # The epochs and batch size set the total only when it is derived.
    derived = saved[LENGTH[0]] is None or now[LENGTH[0]] is None
    shown = [k for k in changed if derived or k not in LENGTH[1:]]
    return [f"{k} {saved[k]} -> {now[k]}" for k in shown]


def changed_settings(saved: Mapping[str, Any] | None, cfg: Config) -> list[str]:
    """``"<key> <saved> -> <now>"`` for each compared setting ``cfg`` changed since the
    checkpoint saved ``saved`` (None: a checkpoint from before they were kept: nothing)."""
    if not saved:
        return []
    now = settings_of(cfg)
    return [
        f"{k} {saved[k]} -> {now[k]}"
        for k in COMPARED
        if k in saved and _moved(k, saved[k], now[k])
    ]


def _moved(key: str, saved: Any, now: Any) -> bool:
    """Whether a compared setting changed: a model path as the folder it names."""
    if key in ("model.path", "critic.model.path") and saved is not None and now is not None:
        return not same_path(saved, now)
    return saved != now


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
