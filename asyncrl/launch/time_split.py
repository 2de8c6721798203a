"""Where a run's time went, per role: what the learner and the rollout servers were busy
with and what they waited on, and so which side more hardware would speed up.

Read from the learner's step records (``timing/*``, and the servers' cumulative
``rollout/task_wait_s``, ``rollout/sync_pause_s``, ``rollout/score_wait_s`` and
``rollout/push_blocked_s``), over the window from the end of the first step to the end of
the last (start-up is the start-up table's business).

The servers' counters in a record are their last heartbeat's, taken up to a few seconds
before the record: their changes are divided by the change of the servers' own clock in
the same heartbeats (``rollout/uptime_s``, summed over servers like the waits), and by
the time between the records only for runs whose servers do not report it.
"""

from __future__ import annotations

import math
from typing import Any

# A side is the bottleneck when it is busy at least this share of the time while the other
# waits at least WAITING of its own.
BUSY, WAITING = 0.7, 0.1
TASKS_WAIT, AGENTS_WAIT = "waiting for tasks", "waiting for the agents' requests"
SCORER_WAIT, BUFFER_WAIT = "waiting for the scorer", "waiting for the buffer"
PAUSED = "paused for weight syncs"
#: The servers' cumulative waits, by the name the split gives them (the last two: time the
#: engine had nothing to run, every response in flight waiting for the scorer or the buffer).
SERVER_WAITS = {
    TASKS_WAIT: "rollout/task_wait_s",
    PAUSED: "rollout/sync_pause_s",
    SCORER_WAIT: "rollout/score_wait_s",
    BUFFER_WAIT: "rollout/push_blocked_s",
}
#: Who keeps a second two waits both counted: servers before ``rollout/uptime_s`` counted
#: a sync while idle as a wait for tasks too, and the sync is what held them then.
PRECEDENCE = (PAUSED, TASKS_WAIT, SCORER_WAIT, BUFFER_WAIT)
UPTIME, SERVERS = "rollout/uptime_s", "rollout/servers_reporting"
REGISTRATIONS = "coordinator/registrations"  # counts a server registering again too
#: Shown only when they are at least this share (most runs never wait on either).
SHOWN_FROM = 0.005


def _total(records: list[dict[str, Any]], key: str) -> float:
    return sum(float(r.get(key, 0.0)) for r in records)


def time_split(records: list[dict[str, Any]]) -> list[str]:
    """Up to three lines: the learner's time, the servers' time, and the verdict."""
    steps = [r for r in records if "timing/step_s" in r and "time" in r]
    if len(steps) < 2:
        return []
    wall = steps[-1]["time"] - steps[0]["time"]
    if wall <= 0:
        return []
    window = steps[1:]
    learner = {
        "training": _total(window, "timing/train_s"),
        "waiting for batches": _total(window, "timing/wait_batch_s"),
        # timing/gather_s spans the whole push section (timing/push_wait_s is inside it)
        "gathering and pushing weights": _total(window, "timing/gather_s"),
    }
    learner["other (validation, checkpoints, control)"] = max(0.0, wall - sum(learner.values()))
    # A step's parts may reach past the window's start: the shares are of their sum then.
    wall = max(wall, sum(learner.values()))
    lines = ["learner: " + _shares(learner, wall)]
    rollout = _rollout_split(steps)
    agents = _agents_only(records)
    if rollout is not None:
        shown = dict(rollout)
        if agents:  # they take no task: what they wait for is the agents' next request
            shown[AGENTS_WAIT] = shown.pop(TASKS_WAIT)
        lines.append("rollout servers (mean): " + _shares(shown, 1.0))
    lines.append(
        _verdict(learner["training"] / wall, learner["waiting for batches"] / wall, rollout, agents)
    )
    return lines


def _agents_only(records: list[dict[str, Any]]) -> bool:
    """Whether every training group came through the OpenAI endpoint (its servers take no
    dataset task): the agents, not the servers, set the pace of generation."""
    last = next((r for r in reversed(records) if "accounting/external/dealt" in r), None)
    if last is None:
        return False
    external = last["accounting/external/dealt"]
    return external > 0 and external >= last.get("accounting/train/dealt", 0.0)


def _rollout_split(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    """Shares of the servers' time, pooled over servers, between the first and last records
    that carry their cumulative waits; they add up to 1 (the rest is generation)."""
    reported = [r for r in steps if "rollout/task_wait_s" in r and "rollout/sync_pause_s" in r]
    span, waits = _pooled(reported)
    if span <= 0:
        return None
    shares, left = {}, 1.0
    for name in PRECEDENCE:  # a second counted twice is the first one's, never 2 seconds
        shares[name] = min(max(waits[name] / span, 0.0), left)
        left -= shares[name]
    shown = {
        name: shares[name]
        for name in SERVER_WAITS
        if name not in (SCORER_WAIT, BUFFER_WAIT) or shares[name] >= SHOWN_FROM
    }
    return {"generating": max(0.0, 1.0 - sum(shown.values()))} | shown


def _pooled(reported: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """The servers' time and the changes of their waits over each pair of consecutive
    records, summed. A pair is left out when a server joined, left or started over (its
    counters began again, and the change of a total is not a time: its registration counts,
    as its uptime's drop may hide under the others' rise), or no heartbeat came between the
    two."""
    span, waits = 0.0, dict.fromkeys(SERVER_WAITS, 0.0)
    for a, b in zip(reported, reported[1:], strict=False):
        base = _servers_time(a, b)
        changes = {name: b.get(key, 0.0) - a.get(key, 0.0) for name, key in SERVER_WAITS.items()}
        restarted = a.get(REGISTRATIONS) != b.get(REGISTRATIONS)
        if base <= 0 or a.get(SERVERS) != b.get(SERVERS) or min(changes.values()) < 0 or restarted:
            continue
        span += base
        for name, change in changes.items():
            waits[name] += change
    return span, waits


def _servers_time(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Server-seconds from record ``a`` to ``b``: the change of the servers' summed uptime,
    read in the heartbeats their waits come from; for servers that do not report it, the
    time between the records (whose heartbeats may be seconds older) times the servers."""
    if UPTIME in a and UPTIME in b:
        return float(b[UPTIME] - a[UPTIME])
    return (b["time"] - a["time"]) * max(1.0, float(b.get(SERVERS, 1)))


def _shares(parts: dict[str, float], total: float) -> str:
    """``name N%`` for each part, rounded so that the percents add up to the rounded total
    (three thirds read 33%, 33%, 34%, not 33% three times; two 50.5% never read 101%)."""
    exact = [100 * value / total for value in parts.values()]
    percents = [math.floor(x) for x in exact]
    short = round(sum(exact)) - sum(percents)
    for i in sorted(range(len(exact)), key=lambda i: percents[i] - exact[i])[: max(short, 0)]:
        percents[i] += 1
    return ", ".join(f"{name} {p}%" for name, p in zip(parts, percents, strict=True))


def _verdict(
    training: float, learner_waits: float, rollout: dict[str, float] | None, agents: bool = False
) -> str:
    # A server whose pushes the buffer holds back waits for the learner as one with no task.
    servers_wait = rollout[TASKS_WAIT] + rollout.get(BUFFER_WAIT, 0.0) if rollout else 0.0
    if agents and learner_waits >= WAITING and servers_wait >= WAITING:
        return (
            "bottleneck: the agents (the learner waits for batches, the servers for the "
            "agents' requests): more agents, or more episodes at once, would speed the run"
        )
    scorer = rollout.get(SCORER_WAIT, 0.0) if rollout else 0.0
    if learner_waits >= WAITING and scorer >= WAITING and scorer >= servers_wait:
        return (
            "bottleneck: the scorer (the learner waits for batches, the servers' responses "
            "for their rewards): more scorer processes (reward.num_workers) or a faster "
            "reward function would speed the run"
        )
    if training >= BUSY and servers_wait >= WAITING:
        return (
            "bottleneck: the learner (the servers wait for tasks): more learner hardware "
            "(trainer.nproc, launch.cpus/gpus.learner) or a larger staleness.max_policy_lag "
            "would speed the run"
        )
    if learner_waits >= WAITING and (rollout is None or rollout["generating"] >= BUSY):
        return (
            "bottleneck: generation (the learner waits for batches): more rollout servers or "
            "hardware (rollout.num_servers, launch.cpus/gpus.rollout) would speed the run"
        )
    return "bottleneck: none clear (both sides are busy, or both wait)"
