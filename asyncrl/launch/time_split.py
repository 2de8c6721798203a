"""Where a run's time went, per role: what the learner and the rollout servers were busy
with and what they waited on, and so which side more hardware would speed up.

Read from the learner's step records (``timing/*``, and the servers' cumulative
``rollout/task_wait_s``, ``rollout/sync_pause_s``, ``rollout/score_wait_s`` and
``rollout/push_blocked_s``), over the window from the end of the first step to the end of
the last (start-up is the start-up table's business).
"""

from __future__ import annotations

from typing import Any

# A side is the bottleneck when it is busy at least this share of the time while the other
# waits at least WAITING of its own.
BUSY, WAITING = 0.7, 0.1
TASKS_WAIT, AGENTS_WAIT = "waiting for tasks", "waiting for the agents' requests"
SCORER_WAIT, BUFFER_WAIT = "waiting for the scorer", "waiting for the buffer"
#: The servers' cumulative waits, by the name the split gives them (the last two: time the
#: engine had nothing to run, every response in flight waiting for the scorer or the buffer).
SERVER_WAITS = {
    TASKS_WAIT: "rollout/task_wait_s",
    "paused for weight syncs": "rollout/sync_pause_s",
    SCORER_WAIT: "rollout/score_wait_s",
    BUFFER_WAIT: "rollout/push_blocked_s",
}
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
    """Shares of the servers' time between the first and last records that carry their
    cumulative waits."""
    reported = [r for r in steps if "rollout/task_wait_s" in r and "rollout/sync_pause_s" in r]
    if len(reported) < 2:
        return None
    first, last = reported[0], reported[-1]
    span = (last["time"] - first["time"]) * max(
        1.0, float(last.get("rollout/servers_reporting", 1))
    )
    if span <= 0:
        return None
    shares = {}
    for name, key in SERVER_WAITS.items():
        share = min(max((last.get(key, 0.0) - first.get(key, 0.0)) / span, 0.0), 1.0)
        if name not in (SCORER_WAIT, BUFFER_WAIT) or share >= SHOWN_FROM:
            shares[name] = share
    return {"generating": max(0.0, 1.0 - sum(shares.values()))} | shares


def _shares(parts: dict[str, float], total: float) -> str:
    return ", ".join(f"{name} {value / total:.0%}" for name, value in parts.items())


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
