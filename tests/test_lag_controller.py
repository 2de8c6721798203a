"""The adaptive staleness controller: its rule on constructed measurements, its memory over
steps, and the coordinator admitting by the lag it sets (real sockets on 127.0.0.1)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.client import CoordinatorClient
from asyncrl.control.lag_controller import (
    BACKOFF_STEPS,
    HOLD_STEPS,
    LagController,
    Signals,
    decide,
)
from asyncrl.control.setup import state_from_config
from asyncrl.tasks.schema import make_row
from learner.control_plane import RankZero
from tests.helpers import start_coordinator

HEALTHY = Signals(ess=0.9, mismatch_kl=0.001, lag_drop_frac=0.0, learner_wait=0.5)


def _decide(lag: int, **changes: float) -> tuple[int, str]:
    signals = Signals(**{**HEALTHY.__dict__, **changes})
    return decide(lag, 0, 4, signals, min_ess=0.3, max_kl=0.1)


def test_the_rule_narrows_on_degraded_correction_and_widens_when_healthy_and_waiting():
    assert _decide(2) == (3, "widen: healthy, the learner waited 50%")
    assert _decide(2, learner_wait=0.05) == (2, "hold")  # the learner is not starved
    assert _decide(2, ess=0.5) == (2, "hold")  # healthy, not comfortably so
    assert _decide(2, ess=0.2)[0] == 1
    assert _decide(2, mismatch_kl=-0.2)[0] == 1
    assert _decide(2, lag_drop_frac=0.1)[0] == 1
    assert _decide(0, ess=0.1)[0] == 0 and _decide(4)[0] == 4  # within [low, high]


def _metrics(ess: float, wait: float, groups_in: float, lag_drops: float = 0.0) -> dict:
    return {
        "importance/ess": ess,
        "importance/mismatch_kl": 0.0,
        "timing/wait_fraction": wait,
        "buffer/groups_in": groups_in,
        "buffer/drops/lag": lag_drops,
    }


def test_the_controller_widens_once_per_hold_and_narrows_at_once():
    lag = LagController(0, 3, min_ess=0.3, max_kl=0.1)
    assert lag.lag == 0  # it starts at the narrow end
    changes = [lag.step(s, _metrics(0.95, 0.6, 8.0 * s)) for s in range(1, 8)]
    assert changes == [1, None, None, 2, None, None, 3]  # every HOLD_STEPS steps
    assert HOLD_STEPS == 3
    assert lag.step(8, _metrics(0.1, 0.6, 64.0)) == 2  # degraded: at once
    # Lag drops since the last step, not since the start: 2 of 8 new groups (25%).
    assert lag.step(9, _metrics(0.95, 0.0, 72.0, lag_drops=2.0)) == 1
    assert lag.step(10, _metrics(0.95, 0.0, 80.0, lag_drops=2.0)) is None
    assert lag.step(11, {"timing/wait_fraction": 0.9}) is None  # nothing measured


def test_a_narrowing_holds_until_the_batches_dealt_after_it_are_trained():
    """Found by a review: the hold was 3 steps whatever the lag and the push schedule, but
    the first batch dealt after a narrowing from lag L is trained L * sync_every + 1 steps
    later. With pushes every second step from lag 4, one dip narrowed at steps 10, 13, 16
    and 19, all on batches dealt under lag 4, down to the floor."""
    lag = LagController(0, 4, min_ess=0.3, max_kl=0.1, sync_every=2)
    lag.lag = 4
    dipped = [lag.step(s, _metrics(0.25, 0.0, 8.0 * s)) for s in range(10, 21)]
    assert [(s, v) for s, v in zip(range(10, 21), dipped, strict=True) if v is not None] == [
        (10, 3),
        (19, 2),  # 4 * 2 + 1 steps after the first
    ]
    assert lag.hold_after(1) == HOLD_STEPS  # short lags keep the floor of the hold
    restored = LagController(0, 4, min_ess=0.3, max_kl=0.1, sync_every=2)
    restored.load_state_dict(lag.state_dict())
    assert restored.narrow_hold == lag.narrow_hold == 3 * 2 + 1


@pytest.mark.parametrize("min_ess", [0.3, 0.5, 0.6, 0.9])
def test_a_high_ess_floor_still_leaves_room_to_widen(min_ess):
    """The comfort level was twice the floor, capped at 1: from min_ess 0.5 up, only an
    ESS of exactly 1 (every weight equal) was comfortable, and the run never widened."""
    assert decide(1, 0, 4, replace(HEALTHY, ess=0.99), min_ess, 0.1)[0] == 2
    assert decide(1, 0, 4, replace(HEALTHY, ess=min_ess + 0.001), min_ess, 0.1)[0] == 1


def test_a_step_with_no_valid_importance_token_is_no_measurement():
    """Every behaviour logprob dropped: no weight was measured, and the step reads as
    such (NaN), not as on-policy (ESS 1, KL 0), on which the controller widened."""
    from learner.losses import STAT_MAXES, STAT_SUMS, summarize_stats

    stats = summarize_stats(dict.fromkeys(STAT_SUMS + STAT_MAXES, 0.0), "tis")
    for key in ("w_mean", "ess", "chi2", "mismatch_kl", "log_w_abs_mean"):
        assert math.isnan(stats[f"importance/{key}"]), key
    lag = LagController(0, 3, min_ess=0.3, max_kl=0.1)
    assert lag.step(5, {**stats, "timing/wait_fraction": 0.9, "buffer/groups_in": 8.0}) is None
    assert lag.lag == 0


def test_a_wait_while_a_validation_round_shares_the_servers_does_not_widen():
    assert _decide(2, validating=True) == (
        2,
        "hold: the learner waited while a validation round shared the servers",
    )
    assert _decide(2, validating=True, ess=0.2)[0] == 1  # narrowing still acts at once
    lag = LagController(0, 3, min_ess=0.3, max_kl=0.1)
    assert lag.step(1, _metrics(0.95, 0.6, 8.0), validating=True) is None
    assert lag.step(2, _metrics(0.95, 0.6, 16.0)) == 1  # the round is over: the wait counts


class _Coordinator:
    """What ``RankZero.after_step`` and ``steer_lag`` ask of the coordinator: whether a
    validation round is being generated, and the lag it sets."""

    def __init__(self) -> None:
        self.generating, self.lags = False, []

    def validation_generating(self) -> bool:
        return self.generating

    def set_admission_lag(self, lag: int) -> None:
        self.lags.append(lag)

    def on_step(self, step: int, weights_step: int | None = None) -> None:
        self.generating = True  # a round is due at every step here


def test_the_learner_tells_the_controller_of_a_round_generated_since_the_last_step():
    """A round started after step 1 (``after_step``) and generated during step 2 shared
    step 2's servers: step 2's wait does not widen the lag; step 3's does. A round scored
    but not yet read holds nothing (a review: one that never completed held the lag for
    the rest of the run)."""
    plane = SimpleNamespace(
        lag=LagController(0, 3, min_ess=0.3, max_kl=0.1),
        coordinator=_Coordinator(),
        pushes=SimpleNamespace(serve_catchups=lambda: None),
        cfg=SimpleNamespace(trainer=SimpleNamespace(test_freq=-1)),
        _weights_step=lambda step: step,
        _poll_validation=lambda step: None,
        _round_in_flight=False,
    )
    RankZero.after_step(plane, 1)  # type: ignore[arg-type]
    assert plane._round_in_flight
    plane.coordinator.generating = False  # generated during step 2, scored since
    metrics = _metrics(0.95, 0.6, 8.0)
    RankZero.steer_lag(plane, 2, metrics)  # type: ignore[arg-type]
    assert plane.coordinator.lags == [] and metrics["staleness/lag_limit"] == 0.0
    plane._round_in_flight = False  # no round started after step 2
    RankZero.steer_lag(plane, 3, _metrics(0.95, 0.6, 16.0))  # type: ignore[arg-type]
    assert plane.coordinator.lags == [1]


def test_the_coordinator_says_a_round_is_generated_until_its_tasks_are_scored():
    cfg = load_config(None, ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2"])
    rows = [make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(4)]
    state = state_from_config(cfg, rows, rows[:2])
    assert not state.validation_generating()
    state.start_validation(0)
    assert state.validation_generating()  # rows to deal
    tasks, _ = state.ledger.deal("a", 2)
    assert [t.validation for t in tasks] == [True, True] and state.validation_generating()
    state.ledger.trained([t.task_id for t in tasks])  # scored (not yet read)
    assert not state.validation_generating()


def _plant_run(lag: LagController, steps: int, stale_at: int = 2, delay: int = 2) -> list:
    """A run whose batches were dealt under the lag in force ``delay`` steps earlier: from
    lag ``stale_at`` on the data is stale (ESS 0.2, under the floor 0.3 but not half of it);
    below, healthy but the learner waits (40%). The lag changes, as (step, lag)."""
    history, changes = {}, []
    for step in range(1, steps + 1):
        history[step] = lag.lag
        stale = history.get(step - delay, 0) >= stale_at
        metrics = _metrics(0.2 if stale else 0.9, 0.0 if stale else 0.4, 64.0 * step)
        if (new := lag.step(step, metrics)) is not None:
            changes.append((step, new))
    return changes


def test_the_controller_settles_rather_than_cycling_into_a_lag_that_failed():
    """A review's plant: the hold applied to widenings only, so a narrowing was followed by
    another on the batches dealt before it (2 -> 1 -> 0), and the controller widened back
    into the lag that had just failed every few steps: 18 changes in 40 steps, about 2 steps
    in 9 on stale data. A narrowing now holds like a widening, and a lag it was narrowed
    from is tried again only after a backoff that doubles at each failure."""
    changes = _plant_run(LagController(0, 3, min_ess=0.3, max_kl=0.1), 80)
    assert changes[:3] == [(1, 1), (4, 2), (7, 1)]  # never below the healthy lag 1
    retries = [step for step, lag in changes if lag == 2]
    assert retries[1] - changes[2][0] >= BACKOFF_STEPS  # lag 2 again after its backoff
    assert retries[2] - retries[1] >= 2 * BACKOFF_STEPS  # and later still after its second
    assert min(lag for _, lag in changes) == 1 and len(changes) <= 8


def test_a_severe_degradation_narrows_within_the_hold():
    """The hold after a narrowing waits for the batches of the narrower lag, unless the
    correction is past twice its threshold: then it narrows again at once."""
    lag = LagController(0, 3, min_ess=0.3, max_kl=0.1)
    lag.load_state_dict({"lag": 3, "widened_at": 0, "groups_in": None, "lag_drops": None})
    assert lag.step(10, _metrics(0.2, 0.0, 8.0)) == 2
    assert lag.step(11, _metrics(0.2, 0.0, 16.0)) is None  # held: dealt before the narrowing
    assert lag.step(12, _metrics(0.1, 0.0, 24.0)) == 1  # ESS under half its floor: at once
    again = LagController(0, 3, min_ess=0.3, max_kl=0.1)
    again.load_state_dict(lag.state_dict())  # the failures and the hold come back
    assert (again.narrowed_at, again.failed) == (12, {3: (10, 1), 2: (12, 1)})


def test_a_restored_controller_goes_on_at_the_lag_it_had_earned():
    """Saved in learner checkpoints: a resumed run does not fall back to the narrow end
    (and widen one step per hold again); a restore into narrower bounds is clamped."""
    lag = LagController(0, 3, min_ess=0.3, max_kl=0.1)
    for s in range(1, 5):
        lag.step(s, _metrics(0.95, 0.6, 8.0 * s))
    assert lag.lag == 2 and lag.widened_at == 4
    again = LagController(0, 3, min_ess=0.3, max_kl=0.1)
    again.load_state_dict(lag.state_dict())
    assert (again.lag, again.widened_at) == (2, 4)
    assert again.step(5, _metrics(0.95, 0.6, 40.0)) is None  # still within the hold
    assert again.step(7, _metrics(0.95, 0.6, 56.0)) == 3
    narrow = LagController(0, 1, min_ess=0.3, max_kl=0.1)
    narrow.load_state_dict(lag.state_dict())
    assert narrow.lag == 1


def test_a_restored_controller_judges_lag_drops_since_the_checkpoint():
    """Early lag drops (100 of the first 500 groups) that have stopped by the checkpoint: a
    resumed run does not narrow on the buffer's whole-run ratio (the buffer outlives the
    learner), as the uninterrupted one does not. A checkpoint saved without the counters
    (an older one) makes the first step after the restore a baseline only."""
    live = LagController(0, 2, min_ess=0.3, max_kl=0.1)
    assert live.step(1, _metrics(0.95, 0.0, 500.0, lag_drops=100.0)) is None  # at low already
    assert live.step(2, _metrics(0.95, 0.6, 564.0, lag_drops=100.0)) == 1  # healthy, waiting
    assert live.step(3, _metrics(0.95, 0.0, 628.0, lag_drops=100.0)) is None
    saved = json.loads(json.dumps(live.state_dict()))  # as a checkpoint holds it
    after = [_metrics(0.95, 0.0, 692.0, lag_drops=100.0), _metrics(0.95, 0.0, 700.0, 102.0)]
    assert [live.step(s, m) for s, m in zip((4, 5), after, strict=True)] == [None, 0]
    resumed = LagController(0, 2, min_ess=0.3, max_kl=0.1)
    resumed.load_state_dict(saved)
    assert resumed.step(4, after[0]) is None and resumed.lag == 1
    assert resumed.step(5, after[1]) == 0  # 2 of 8 new groups dropped: narrowed at once
    older = LagController(0, 2, min_ess=0.3, max_kl=0.1)
    older.load_state_dict({"lag": 1, "widened_at": 2})
    assert older.step(4, after[0]) is None and older.lag == 1  # the baseline only
    assert older.step(5, after[1]) == 0


def test_a_fresh_controller_meeting_a_long_running_buffer_takes_its_counters_first():
    """A learner restarted without a checkpoint while the buffer ran on: the buffer's
    counters are its whole run's (here 100 lag drops in 500 groups, long over). The first
    step only takes them; what follows is judged on the groups since."""
    fresh = LagController(0, 2, min_ess=0.3, max_kl=0.1)
    # Healthy and waiting: it widens (judged on the whole run, 20% dropped, it would not).
    assert fresh.step(1, _metrics(0.95, 0.6, 500.0, lag_drops=100.0)) == 1
    assert fresh.step(2, _metrics(0.95, 0.0, 508.0, lag_drops=102.0)) == 0  # 2 of 8 new


def test_a_restarted_buffer_counting_from_zero_is_judged_on_its_own_counts():
    """A buffer restart resets its counters: the step after it judges the new buffer's
    groups (2 lag drops in its first 8), not a negative difference read as no drop."""
    c = LagController(0, 2, min_ess=0.3, max_kl=0.1)
    assert c.step(1, _metrics(0.95, 0.6, 500.0, lag_drops=0.0)) == 1  # healthy, waiting
    assert c.step(2, _metrics(0.95, 0.0, 8.0, lag_drops=2.0)) == 0  # 25%: narrowed


def test_the_coordinator_admits_by_the_lag_it_is_given():
    coord = start_coordinator(100, per_version=2)  # lag 1: 4 groups admitted
    client = CoordinatorClient(
        coord.tasks_addr, coord.control_addr, "r0", engine_world_size=0, timeout_s=10.0
    )
    try:
        client.register()
        assert len(client.request_tasks(8).tasks) == 4
        coord.set_admission_lag(0)  # narrower than what is in flight: nothing new, nothing lost
        assert client.request_tasks(8).tasks == []
        assert coord.metrics()["coordinator/budget/dealt"] == 4
        coord.set_admission_lag(3)  # (3 + 1) * 2 = 8
        assert len(client.request_tasks(8).tasks) == 4
    finally:
        client.close()
        coord.stop()


def test_the_lag_range_must_be_a_range():
    with pytest.raises(ConfigError, match="staleness.min_policy_lag=3 is above"):
        load_config(None, ["staleness.min_policy_lag=3", "staleness.max_policy_lag=1"])
    cfg = load_config(None, ["staleness.controller=adaptive", "staleness.max_policy_lag=4"])
    assert (cfg.staleness.min_policy_lag, cfg.staleness.max_policy_lag) == (0, 4)
