"""Building the control plane from a run config (``data``, ``staleness``, ``control``,
``endpoints``, ``trainer``, ``rollout``, ``sync`` groups)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.config.shared import shared_settings
from asyncrl.control.admission import Budget, groups_per_version
from asyncrl.control.coordinator import Coordinator
from asyncrl.control.grant_size import fits_alone
from asyncrl.control.group_filter import GroupFilter
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.pacing import Pacer
from asyncrl.control.prompt_skip import PromptSkip
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource, load_rows
from asyncrl.net.transport import mebibytes
from asyncrl.tasks.lengths import Episodes, fitting_val_rows, refuse_overlong_val_rows

log = logging.getLogger(__name__)

Rows = Sequence[dict[str, Any]]


def store_host(host: str) -> str:
    """The sync store's host: ``endpoints.host``, or loopback when sockets use ipc."""
    return "127.0.0.1" if host.startswith("ipc://") else host


def sync_backend(device: str) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if device == "cuda" else "gloo"


def episodes_of(cfg: Config) -> Episodes | None:
    """How the servers render episodes' first prompts (None: multi-turn off), for the
    validation rows' length filter; a tool config that does not read is a ConfigError."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    tools = None
    if mt.tool_config_path:
        from asyncrl.tools.config import load_tool_config, schemas

        try:
            tools = schemas(load_tool_config(mt.tool_config_path))
        except ValueError as e:
            raise ConfigError([str(e)]) from e
    return Episodes(tools)


def task_source_from_config(
    cfg: Config, train_rows: Rows | None = None, val_rows: Rows | None = None
) -> TaskSource:
    """The dataset cursor; rows are read from ``data.train_files``/``data.val_files`` unless
    given (validation files only when validation is scheduled)."""
    d, t = cfg.data, cfg.trainer
    if train_rows is None:
        train_rows = load_rows(d.train_files, d.prompt_key)
    if val_rows is None:
        validating = t.val_before_train or t.test_freq > 0
        val_rows = load_rows(d.val_files, d.prompt_key) if validating else []
        measure = (cfg.model.path, d.prompt_key, d.max_prompt_length)
        if val_rows and d.filter_overlong_prompts:  # as veRL's loader leaves them out
            val_rows = fitting_val_rows(val_rows, *measure, episodes_of(cfg))
        elif val_rows and d.truncation == "error":  # veRL's dataset fails on them too
            refuse_overlong_val_rows(val_rows, *measure, episodes_of(cfg))
    source = TaskSource(
        train_rows,
        val_rows,
        seed=d.seed,
        shuffle=d.shuffle,
        total_epochs=t.total_epochs,
        n=cfg.rollout.n,
        val_n=cfg.rollout.val_kwargs.n,
        prompt_key=d.prompt_key,
        default_agent="tool_agent" if cfg.rollout.multi_turn.enable else "single_turn",
    )  # with a lineage of its own (a restored coordinator takes the checkpoint's back)
    _warn_idle_agents(cfg, train_rows)
    # A training row too large for a grant is dropped when dealt (counted); a validation
    # row never dealt would leave every round short of it, and no val/ score ever.
    limit = mebibytes(cfg.control.max_message_mb)
    if big := source.oversize_val_rows(lambda task: fits_alone(task, limit)):
        raise ConfigError(
            [
                f"data.val_files: {len(big)} row(s) (first: row {big[0]}) are larger than a "
                f"task grant may carry under control.max_message_mb="
                f"{cfg.control.max_message_mb:g}: raise it (in the config every role reads) "
                "or leave those rows out"
            ]
        )
    return source


def _warn_idle_agents(cfg: Config, rows: Rows) -> None:
    """Rows that name ``tool_agent`` while multi-turn episodes are off run single-turn,
    without their tools: say so once, with the key that runs them as episodes."""
    if cfg.rollout.multi_turn.enable:
        return
    named = sum(row.get("agent_name") == "tool_agent" for row in rows)
    if named:
        log.warning(
            "%d of %d training rows name agent_name tool_agent, but rollout.multi_turn.enable "
            "is false: they run single-turn, without their tools; set "
            "rollout.multi_turn.enable=true (and rollout.multi_turn.tool_config_path) to run "
            "them as episodes",
            named,
            len(rows),
        )


def state_from_config(
    cfg: Config, train_rows: Rows | None = None, val_rows: Rows | None = None
) -> ControlState:
    """A fresh :class:`ControlState` for the run (no server registered, version 0)."""
    budget = Budget(
        cfg.staleness.max_policy_lag,
        groups_per_version(cfg.data.train_batch_size, cfg.staleness.sync_every),
    )
    # A server holds at most rollout.max_inflight responses: that many groups unpaced.
    ceiling = max(1, cfg.rollout.max_inflight // cfg.rollout.n)
    pacer = Pacer(ceiling) if cfg.staleness.pace_servers else None
    fg = cfg.algorithm.filter_groups
    ledger = TaskLedger(
        task_source_from_config(cfg, train_rows, val_rows),
        budget,
        lag_retries=cfg.staleness.lag_retries,
        task_retries=cfg.control.task_retries,
        task_timeout_s=cfg.control.task_timeout_s,
        pacer=pacer,
    )
    syncs = SyncBook(backend=sync_backend(cfg.trainer.device), timeout_s=cfg.sync.timeout_s)
    state = ControlState(
        ledger,
        syncs,
        heartbeat_s=cfg.control.heartbeat_s,
        dead_after_s=cfg.control.dead_after_s,
        store_host=store_host(cfg.endpoints.host),
        store_port=cfg.endpoints.sync_store,
        test_freq=cfg.trainer.test_freq,
        val_before_train=cfg.trainer.val_before_train,
        min_servers_to_start=cfg.control.min_servers_to_start,
        catchup_backoff_s=cfg.sync.catchup_backoff_s,
        catchup_backoff_max_s=cfg.sync.catchup_backoff_max_s,
        group_filter=GroupFilter(
            enable=fg.enable,
            max_num_gen_batches=fg.max_num_gen_batches,
            batch_size=cfg.data.gen_batch_size or cfg.data.train_batch_size,
            skip=PromptSkip(
                explore=fg.skip_explore, explore_min=fg.skip_explore_min, seed=cfg.data.seed
            )
            if fg.skip_uninformative
            else None,
        ),
    )
    state.settings = shared_settings(cfg)
    return state


def coordinator_from_config(
    cfg: Config,
    *,
    train_rows: Rows | None = None,
    val_rows: Rows | None = None,
    buffer: bool = True,
    saved_state: dict[str, Any] | None = None,
) -> Coordinator:
    """A coordinator bound to ``endpoints.tasks``/``endpoints.control``; with ``buffer`` it
    polls ``endpoints.batches`` for dropped groups and shuts that buffer down at the end.
    ``saved_state`` is a :meth:`Coordinator.state_dict` to resume from."""
    from asyncrl.net.transport import config_endpoint, mebibytes

    coord = Coordinator(
        state_from_config(cfg, train_rows, val_rows),
        tasks_addr=config_endpoint(cfg.endpoints, "tasks"),
        control_addr=config_endpoint(cfg.endpoints, "control"),
        buffer_addr=config_endpoint(cfg.endpoints, "batches") if buffer else None,
        max_grant=cfg.control.tasks_per_request,
        drop_poll_s=cfg.control.heartbeat_s,
        max_message_bytes=mebibytes(cfg.control.max_message_mb),
    )
    if saved_state is not None:
        coord.load_state_dict(saved_state)
    return coord
