"""The one place where the fault simulation meets the decision classes' APIs.

The simulation (:mod:`benchmarks.fault_model`) drives the real coordinator state
(:class:`~asyncrl.control.state.ControlState` over its ledger, task source, budget, recovery
and sync book) and the real :class:`~buffer.core.ReplayBuffer`. Some of their signatures grew
with the recovery fixes (task id lineages, buffer sessions, batch re-sends, drop reports read
by cursor); each function here uses the newer form when the class offers it and the older
one otherwise, so the same harness runs against either and says which it found
(:func:`features`).

Everything random in the real classes that could change a run (sessions, lineages) is given
here from the simulation's own seeded values: one seed, one schedule, one outcome.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from asyncrl.control.admission import Budget, groups_per_version
from asyncrl.control.group_filter import GroupFilter
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncBook
from asyncrl.control.task_source import TaskSource
from asyncrl.control.versions import Versions
from asyncrl.tasks import make_row
from asyncrl.wire import Batch, DroppedTask
from buffer.core import ReplayBuffer


def _accepts(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


HAS_LINEAGE = _accepts(TaskSource, "lineage")
LINEAGE = HAS_LINEAGE  # task ids carry the dealing lineage
LEDGER_SESSION = _accepts(TaskLedger, "session")  # external slot ids carry a session
BUFFER_SESSION = _accepts(ReplayBuffer, "session")  # batches carry the buffer session
RESEND = _accepts(ReplayBuffer.release, "received")  # a batch never received comes again
HELLO_SESSION = _accepts(ReplayBuffer.restart, "session")  # acked_through names its session
CURSOR = hasattr(ReplayBuffer, "reports_since")  # drop reports read by cursor, not drained
RESUMED = _accepts(ReplayBuffer.restart, "resumed")  # a fresh consumer replays nothing
AUDIT = hasattr(ControlState, "audit_request")  # acked groups audited against the buffer
AT_LEAST = hasattr(Versions, "at_least")  # a fresh learner's versions go on above the buffer's
SKIP = _accepts(GroupFilter, "skip")  # rows the filter keeps dropping are passed over


def features() -> dict[str, bool]:
    """Which of the newer APIs the classes under test have (printed with every report)."""
    return {
        "lineage": LINEAGE,
        "ledger_session": LEDGER_SESSION,
        "buffer_session": BUFFER_SESSION,
        "resend": RESEND,
        "hello_session": HELLO_SESSION,
        "cursor": CURSOR,
        "resumed": RESUMED,
        "audit": AUDIT,
        "at_least": AT_LEAST,
        "skip": SKIP,
    }


def rows(n: int, split: str) -> list[dict[str, Any]]:
    """``n`` tiny dataset rows in the project's layout (prompts are never read here)."""
    return [make_row("arithmetic", f"{i}+1=", str(i + 1), split=split, index=i) for i in range(n)]


def new_state(cfg: Any, train: Sequence[dict], val: Sequence[dict], tag: str) -> ControlState:
    """A fresh coordinator state for ``cfg`` (a :class:`benchmarks.fault_world.SimConfig`);
    ``tag`` names this incarnation (lineage of a fresh source, session of the state)."""
    # Plain ids when lineages are off (a mutation test), never the source's random default.
    kw: dict[str, Any] = {"lineage": tag if LINEAGE else ""} if HAS_LINEAGE else {}
    source = TaskSource(train, val, seed=cfg.seed, shuffle=True, n=cfg.n, val_n=1, **kw)
    budget = Budget(cfg.max_policy_lag, groups_per_version(cfg.batch, cfg.sync_every))
    lkw: dict[str, Any] = {"session": tag} if LEDGER_SESSION else {}
    ledger = TaskLedger(
        source,
        budget,
        lag_retries=cfg.lag_retries,
        task_retries=cfg.task_retries,
        task_timeout_s=cfg.task_timeout_s,
        **lkw,
    )
    state = ControlState(
        ledger,
        SyncBook(timeout_s=cfg.sync_timeout_s),
        heartbeat_s=cfg.heartbeat_s,
        dead_after_s=cfg.dead_after_s,
        store_host="sim",
        store_port=1,
        test_freq=cfg.test_freq,
        catchup_backoff_s=cfg.catchup_backoff_s,
        catchup_backoff_max_s=cfg.catchup_backoff_max_s,
        group_filter=GroupFilter(
            enable=cfg.filter_groups,
            max_num_gen_batches=cfg.max_num_gen_batches,
            batch_size=cfg.batch,
            **_skip(cfg),
        ),
    )
    state.session = tag  # deterministic (the real one is random)
    return state


def _skip(cfg: Any) -> dict[str, Any]:
    """The group filter's prompt skipping, where the classes have it and the run asks."""
    if not (SKIP and cfg.skip_uninformative):
        return {}
    from asyncrl.config.recipes import FilterGroupsConfig
    from asyncrl.control.prompt_skip import PromptSkip

    fg = FilterGroupsConfig()  # the default chances
    return {
        "skip": PromptSkip(explore=fg.skip_explore, explore_min=fg.skip_explore_min, seed=cfg.seed)
    }


def restored_state(
    cfg: Any, train: Sequence[dict], val: Sequence[dict], tag: str, saved: dict[str, Any]
) -> ControlState:
    """A coordinator state restored from a checkpoint's ``state_dict`` (as the learner does
    on a resume: the coordinator then waits for the servers and the buffer's inventory)."""
    state = new_state(cfg, train, val, tag)
    state.load_state_dict(saved)
    return state


def new_buffer(cfg: Any, session: str) -> ReplayBuffer:
    """A fresh buffer process's replay buffer (``session`` names it)."""
    kw: dict[str, Any] = {"session": session} if BUFFER_SESSION else {}
    return ReplayBuffer(
        batch_size=cfg.batch,
        capacity_groups=cfg.capacity,
        max_policy_lag=cfg.max_policy_lag,
        group_timeout_s=cfg.group_timeout_s,
        **kw,
    )


def release(
    buf: ReplayBuffer, version: int, consumer: str, received: tuple[str, int | None] | None
) -> Batch | None:
    """A batch for ``consumer``; ``received`` is the last batch it got (session, id)."""
    if RESEND:
        return buf.release(version, consumer, received=received)  # type: ignore[call-arg]
    return buf.release(version, consumer)


def restart(
    buf: ReplayBuffer, acked_through: int | None, consumer: str, session: str, resumed: bool
) -> int:
    """A consumer's hello (``resumed``: from a checkpoint); how many batches come again."""
    kw: dict[str, Any] = {"session": session} if HELLO_SESSION else {}
    if RESUMED:
        kw["resumed"] = resumed
    queued, _ = buf.restart(acked_through, consumer, **kw)
    return queued


def audit_request(state: ControlState, now: float) -> tuple[list[str], float] | None:
    """Acknowledged groups the coordinator checks against the buffer now (and their
    cutoff), or None (none due, or a coordinator without audits)."""
    return state.audit_request(now) if AUDIT else None  # type: ignore[attr-defined]


def audited(state: ControlState, unknown: list[str], paused: bool, before: float) -> None:
    state.audited(unknown, paused, before)  # type: ignore[attr-defined]


def buffer_version(buf: ReplayBuffer) -> int:
    """The highest version the buffer measured lag against (0 before any, or unknown)."""
    return int(getattr(buf, "learner_version", 0) or 0)


def at_least(state: ControlState, version: int) -> None:
    """A learner started without a checkpoint: its versions go on above ``version``."""
    if AT_LEAST:
        state.versions.at_least(version)  # type: ignore[attr-defined]


def unknown(buf: ReplayBuffer, task_ids: list[str]) -> list[str]:
    """Those of ``task_ids`` the buffer never received a member of."""
    return buf.unknown(task_ids)  # type: ignore[attr-defined]


def reports(
    buf: ReplayBuffer, session: str, cursor: tuple[int, int]
) -> tuple[list[DroppedTask], list[str], tuple[int, int]]:
    """Drops and scored validation ids for the coordinator's poll, read from ``cursor`` of
    buffer ``session`` (another session's cursor reads from the start, as the service
    does), and the cursor after them; drained lists when the buffer has no cursor."""
    if CURSOR:
        start = cursor if session == buffer_session(buf) else (0, 0)
        dropped, validated = buf.reports_since(*start)  # type: ignore[attr-defined]
        return dropped, validated, (start[0] + len(dropped), start[1] + len(validated))
    return buf.take_dropped(), buf.take_validated(), (0, 0)  # type: ignore[attr-defined]


def buffer_session(buf: ReplayBuffer) -> str:
    return str(getattr(buf, "session", ""))


def batch_session(batch: Batch, buffer_session: str) -> str:
    """The session that numbered ``batch`` (the releasing buffer's, before batches said)."""
    return str(getattr(batch, "session", "") or buffer_session)


def _deliveries(buf: ReplayBuffer) -> Any:
    """Where the buffer keeps released, unacknowledged batches (its own record, or the
    state it shared with the pool before they had one)."""
    return getattr(buf, "deliveries", None) or buf._s  # noqa: SLF001


def unacked(buf: ReplayBuffer) -> dict[int, Batch]:
    """Released batches the buffer still holds for their consumer (inspection only)."""
    return _deliveries(buf).unacked


def owner(buf: ReplayBuffer, batch_id: int) -> str:
    return _deliveries(buf).owner.get(batch_id, "")


def redelivery_queue(buf: ReplayBuffer) -> set[int]:
    return set(_deliveries(buf).redeliver)


def held_ids(buf: ReplayBuffer) -> set[str]:
    """Task ids the buffer holds (complete, in the pool or in unacknowledged batches, or
    incomplete)."""
    held, _, _ = buf.inventory()
    return set(held)
