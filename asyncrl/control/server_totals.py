"""Run totals of the rollout servers' counters, kept across their restarts and the learner's.

A rollout server counts from 0 in each process (``rollout/tokens``, ``rollout/reward_errors``,
the agents' and the endpoint's counters) and reports its counts in every heartbeat. Summed
over the live servers only, a step's record went backwards when a server restarted or
left (its counts gone with its registration) and lost every retired process's counts when
the learner restarted. :class:`ServerTotals` keeps, per server id, the last counts of its
current process and the sum of its earlier processes' (``base``), and is saved with the
coordinator's state, so the totals it gives never fall during a run.

A new process is told from the same one by ``rollout/incarnation``, a random number each
server draws at start (a server that restarts reports another); a server that does not
report one is taken to have restarted when a count fell.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

INCARNATION = "rollout/incarnation"

# The cumulative counters every server reports (per process, never falling within one).
COUNTERS: tuple[str, ...] = tuple(
    f"rollout/{k}"
    for k in (
        "tokens",
        "task_wait_s",
        "sync_pause_s",
        "uptime_s",  # the time base of the waits (asyncrl/launch/time_split.py)
        "version_wait_s",
        "score_wait_s",
        "push_blocked_s",
        "gc_s",
        "groups_filtered",
        "filter_metric_unknown",
        "dropped_acks_resent",
        "reward_errors",
        "prompts_truncated",
        "groups",
        "task_errors",
        "prompts_filtered_too_long",
        "push_wait_s",
        "resubmitted",
        "moved_off_stale_adapters",
        "version_wait_missed",
        "probe_timeouts",
        "samples_dated_down",
    )
)
# The multi-turn agents' and the OpenAI endpoint's counters: named as they arise, all
# cumulative.
COUNTER_PREFIXES = ("rollout/agent/", "rollout/openai/")
_COUNTERS = frozenset(COUNTERS)


def is_counter(key: str) -> bool:
    """Whether ``key`` is a cumulative counter of a server (summed into run totals)."""
    return key in _COUNTERS or key.startswith(COUNTER_PREFIXES)


class _Server:
    """One server id's counts: ``last`` of its current process, ``base`` of earlier ones."""

    def __init__(self) -> None:
        self.incarnation: float | None = None
        self.base: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def started_over(self, incarnation: float | None, counts: Mapping[str, float]) -> bool:
        """Whether ``counts`` come from another process than ``last``."""
        if incarnation is not None and self.incarnation is not None:
            return incarnation != self.incarnation
        return any(k in counts and counts[k] < v for k, v in self.last.items())


class ServerTotals:
    """Run totals of the servers' counters over every process of every server id, live or
    gone. Fed by each heartbeat (:meth:`observe`); read by the step records (:meth:`totals`)."""

    def __init__(self) -> None:
        self.servers: dict[str, _Server] = {}

    def observe(self, server_id: str, metrics: Mapping[str, float]) -> None:
        """A heartbeat's metrics from ``server_id``: a new process's counts start on top of
        the ones before them; the same process's replace its last."""
        s = self.servers.setdefault(server_id, _Server())
        counts = {k: float(v) for k, v in metrics.items() if is_counter(k)}
        incarnation = metrics.get(INCARNATION)
        if s.started_over(incarnation, counts):
            for k, v in s.last.items():
                s.base[k] = s.base.get(k, 0.0) + v
            s.last = {}
        # Merged, not replaced: a heartbeat cut to its first keys by name (a server with
        # many agent counters) leaves the others where they were.
        s.last.update(counts)
        if incarnation is not None:
            s.incarnation = float(incarnation)

    def totals(self) -> dict[str, float]:
        """Every counter summed over every process seen (0.0 for the fixed ones before any
        report): never less than an earlier call's."""
        out = dict.fromkeys(COUNTERS, 0.0)
        for s in self.servers.values():
            for counts in (s.base, s.last):
                for k, v in counts.items():
                    out[k] = out.get(k, 0.0) + v
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready, for the coordinator's checkpoint."""
        return {
            sid: {"incarnation": s.incarnation, "base": s.base, "last": s.last}
            for sid, s in self.servers.items()
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.servers = {}
        for sid, saved in state.items():
            s = self.servers[sid] = _Server()
            inc = saved.get("incarnation")
            s.incarnation = None if inc is None else float(inc)
            s.base = {k: float(v) for k, v in saved.get("base", {}).items()}
            s.last = {k: float(v) for k, v in saved.get("last", {}).items()}
