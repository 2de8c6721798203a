"""A step's ``rollout/...`` metrics from the rollout servers' heartbeats
(:func:`learner.metrics.rollout_summary`), on hand-computed inputs."""

from __future__ import annotations

import pytest

from learner.metrics import rollout_summary


def test_counters_are_summed_fractions_averaged_and_agent_counters_kept():
    """Totals and the agents' and the endpoint's counters are summed over the servers (the
    README names ``rollout/agent/*`` and ``rollout/openai/*``; they reached only the
    servers' logs before), fractions averaged, the frozen-heap count at its minimum."""
    servers = {
        "r0": {
            "rollout/tokens_per_s": 100.0,
            "rollout/tokens": 1000.0,
            "rollout/wait_fraction": 0.2,
            "rollout/gc_frozen_objects": 50.0,
            "rollout/agent/tool_errors/timeout": 2.0,
            "rollout/openai/groups_pushed": 3.0,
            "rollout/tokens_by_version/7": 10.0,  # a server's own detail: not summed
            "rollout/task_errors": 2.0,
            "rollout/inflight": 16.0,
        },
        "r1": {
            "rollout/tokens_per_s": 50.0,
            "rollout/tokens": 500.0,
            "rollout/wait_fraction": 0.4,
            "rollout/gc_frozen_objects": 0.0,
            "rollout/agent/tool_errors/timeout": 1.0,
            "rollout/task_errors": 1.0,
            "rollout/inflight": 8.0,
            "rollout/resubmitted": 4.0,
        },
        "r2": {},  # no heartbeat yet: not counted
    }
    out = rollout_summary(servers)
    assert out["rollout/tokens_per_s"] == 150.0 and out["rollout/tokens"] == 1500.0
    assert out["rollout/wait_fraction"] == pytest.approx(0.3)
    assert out["rollout/gc_frozen_objects_min"] == 0.0
    assert out["rollout/agent/tool_errors/timeout"] == 3.0
    assert out["rollout/openai/groups_pushed"] == 3.0
    assert out["rollout/servers_reporting"] == 2
    # Failed tasks and resumed responses reached only the servers' logs before.
    assert (out["rollout/task_errors"], out["rollout/inflight"]) == (3.0, 24.0)
    assert (out["rollout/resubmitted"], out["rollout/prompts_filtered_too_long"]) == (4.0, 0.0)
    assert not any(k.startswith("rollout/tokens_by_version") for k in out)
    assert rollout_summary({"r0": {}}) == {}


def test_every_counter_a_server_keeps_reaches_the_step_record():
    """A review: ``rollout/version_wait_missed`` and ``rollout/probe_timeouts`` were counted
    by the servers and listed in METRICS.md as in every step's record, but the summary
    left them out. Every counter of :class:`ServerStats` is now summed over the servers."""
    from asyncrl.control.server_totals import INCARNATION
    from rollout_servers.engine import ENGINE_METRICS
    from rollout_servers.server_stats import ServerStats

    # The engine's too (a review: rollout/moved_off_stale_adapters was left out); not the
    # process's incarnation, a number of its own.
    stats = ServerStats(tok=None).metrics  # type: ignore[arg-type]
    counters = [*(k for k in stats if k != INCARNATION), *ENGINE_METRICS]
    servers = {f"r{i}": {key: float(i + 1) for key in counters} for i in range(2)}
    out = rollout_summary(servers)
    missing = [key for key in counters if out.get(key) != 3.0]
    assert not missing, missing
