"""Health alarms (``trainer.health.*``): each fires on a constructed batch, with one line
naming the metric, its value and the threshold, and none fires on a healthy batch.

The importance rules read the metrics the real loss computes (:func:`learner.losses.
policy_loss` on constructed logprobs); the update rules read a step's metrics as the
trainer reports them."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import ConfigError, load_config
from learner.health import RULES, HealthMonitor
from learner.losses import LossConfig, policy_loss, summarize_stats

B, T = 8, 16


def _health(*overrides: str) -> HealthMonitor:
    """A monitor that alarms on the first step a threshold is crossed (patience 1)."""
    cfg = load_config(None, ["trainer.health.patience=1", *overrides])
    return HealthMonitor(cfg.trainer.health)


def _step_metrics(gap: torch.Tensor, entropy: float = 1.0) -> dict[str, float]:
    """The loss's metrics for learner logprobs ``p`` and behaviour ``b = p - gap`` (so
    ``w = exp(gap)``), and a step's update metrics as a healthy run shows them."""
    torch.manual_seed(0)
    p = -torch.rand(B, T) - 0.5
    b = p - gap
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.randn(B)
    cfg = LossConfig(importance_mode="tis", importance_cap=2.0)
    _, stats = policy_loss(p.clone(), p, b, adv, mask, cfg, entropy=torch.full((B, T), entropy))
    metrics = summarize_stats({k: float(v) for k, v in stats.items()}, "tis")
    return metrics | {"actor/grad_norm": 0.3, "actor/skipped_updates": 0.0}


def test_a_healthy_batch_fires_nothing():
    health = _health()
    small = 0.01 * torch.randn(B, T)  # lag 0: the two stacks' rounding
    for _ in range(10):
        assert health.check(_step_metrics(small)) == []
    assert set(health.metrics()) == {f"health/{r}" for r in RULES}
    assert sum(health.metrics().values()) == 0


def test_stale_weights_fire_the_importance_rules():
    health = _health()
    # Behaviour far from the learner: one token in 8 weighs e^3, the others e^-1.
    gap = torch.where(torch.arange(T) % 8 == 0, 3.0, -1.0).expand(B, T)
    alarms = {a.rule: a for a in health.check(_step_metrics(gap))}
    assert {"w_mean", "min_ess", "max_chi2", "max_truncated_frac"} <= set(alarms), alarms
    line = alarms["min_ess"].line(7)
    assert line.startswith("health: step 7: importance/ess=") and ">= 0.3" in line, line
    assert "trainer.health.min_ess" in line and "staleness.max_policy_lag" in line, line
    assert health.metrics()["health/min_ess"] == 1


def test_the_share_over_the_cap_alarms_under_mis_as_under_tis():
    """Found by a review: under algorithm.importance.mode=mis the share of tokens over the
    cap is masked out of the gradient and reported as importance/masked_frac, which no rule
    read: 30% of a batch was dropped without an alarm that tis raised on the same data."""
    for mode, key in (("tis", "importance/truncated_frac"), ("mis", "importance/masked_frac")):
        health = _health()
        other = "importance/masked_frac" if mode == "tis" else "importance/truncated_frac"
        alarms = [health.check({key: 0.3, other: 0.0}) for _ in range(3)][-1]
        (capped,) = [a for a in alarms if a.rule == "max_truncated_frac"]
        assert capped.metric == key and capped.value == 0.3, (mode, capped)


def test_a_systematic_mismatch_fires_the_mismatch_rule():
    health = _health()
    alarms = health.check(_step_metrics(torch.full((B, T), -0.3)))  # b above p everywhere
    (mismatch,) = [a for a in alarms if a.rule == "max_mismatch_kl"]
    assert math.isclose(mismatch.value, 0.3, rel_tol=1e-5)
    assert "|x| <= 0.1" in mismatch.line(1) and "rollout.temperature" in mismatch.line(1)
    assert not [a for a in _health("trainer.health.max_mismatch_kl=0.5").check(
        _step_metrics(torch.full((B, T), -0.3))
    ) if a.rule == "max_mismatch_kl"]  # fmt: skip


def test_the_mismatch_line_blames_staleness_when_the_batch_has_lag():
    """Behaviour against learner counts the policy's moves since a stale batch was generated:
    the line says so, rather than sending the user after temperatures and dtypes."""
    metrics = _step_metrics(torch.full((B, T), -0.3)) | {"lag/mean": 1.5}
    (mismatch,) = [a for a in _health().check(metrics) if a.rule == "max_mismatch_kl"]
    line = mismatch.line(1)
    assert "mean lag is 1.5" in line and "staleness.max_policy_lag" in line
    metrics["lag/mean"] = 0.0  # all from the current weights: the numerics' line
    (mismatch,) = [a for a in _health().check(metrics) if a.rule == "max_mismatch_kl"]
    assert "mean lag" not in mismatch.line(1) and "model.dtype" in mismatch.line(1)
    # Lag 0 one update after a push (sync_every 2): the policy moved, not the numerics.
    metrics["lag/steps_since_push"] = 1.0
    (mismatch,) = [a for a in _health().check(metrics) if a.rule == "max_mismatch_kl"]
    assert "1 update(s) behind" in mismatch.line(1) and "staleness.sync_every" in mismatch.line(1)


def test_update_rules_fire_on_a_collapse_a_spike_and_a_skipped_update():
    health = _health()
    calm = _step_metrics(0.01 * torch.randn(B, T), entropy=2.0)
    for _ in range(10):
        assert health.check(calm) == []
    collapsed = calm | {"actor/entropy": 0.1}  # under 0.1 x its 2.0 of 10 steps before
    spiked = calm | {"actor/grad_norm": 30.0}  # 100 x the median 0.3
    skipped = calm | {"actor/skipped_updates": 1.0}
    moved = calm | {"actor/ppo_kl": 0.5}
    fired = [{a.rule for a in health.check(m)} for m in (collapsed, spiked, skipped, moved)]
    assert fired == [
        {"entropy_collapse_frac"},
        {"grad_norm_spike"},
        {"nonfinite"},
        {"max_ppo_kl"},
    ], fired
    assert health.metrics()["health/grad_norm_spike"] == 1


def test_health_off_checks_nothing():
    gap = torch.full((B, T), 3.0)
    assert _health("trainer.health.enable=false").check(_step_metrics(gap)) == []


def test_one_steps_excursion_is_noise_a_sustained_one_alarms():
    """With the default patience (3), a single step past a threshold (the demo at lag 2
    shows one weight of 29 at step 7) alarms nothing; three in a row do."""
    health = HealthMonitor(load_config(None, []).trainer.health)
    stale = _step_metrics(torch.where(torch.arange(T) % 8 == 0, 3.0, -1.0).expand(B, T))
    calm = _step_metrics(0.01 * torch.randn(B, T))
    assert [health.check(m) for m in (stale, calm, stale, stale)] == [[], [], [], []]
    (ess,) = [a for a in health.check(stale) if a.rule == "min_ess"]  # the third in a row
    assert ess.steps == 3 and " for 3 steps (trainer.health.min_ess)" in ess.line(5)
    skipped = calm | {"actor/skipped_updates": 1.0}
    assert [a.rule for a in health.check(skipped)] == ["nonfinite"]  # at once
    # a critic skipping its updates (GAE then reads values that stopped learning)
    critic_skipped = calm | {"actor/skipped_updates": 0.0, "critic/skipped_updates": 2.0}
    (alarm,) = health.check(critic_skipped)
    assert alarm.rule == "nonfinite" and "critic/skipped_updates" in alarm.metric


def test_a_slow_fall_of_the_entropy_is_learning_not_a_collapse():
    """The CPU demo's entropy fell from 3.0 to 0.3 over 180 steps while its reward rose
    from 0.31 to 0.84: no alarm. The same fall within ten steps is one."""
    health = _health()
    assert not any(health.check({"actor/entropy": 3.0 * 0.1 ** (s / 179)}) for s in range(180))
    fast = _health()
    fired = [fast.check({"actor/entropy": 3.0 * 0.1 ** (s / 9)}) for s in range(12)]
    assert [a.rule for alarms in fired for a in alarms][:1] == ["entropy_collapse_frac"]


def test_a_collapse_and_a_streak_that_span_a_learner_restart_still_alarm():
    """A review: every learner start built a fresh monitor, so an entropy collapse begun
    before a restart never alarmed, streaks started over and ``health/*`` read 0. The
    monitor's history is in the checkpoint (as plain data, through JSON)."""
    import json

    steps = [{"actor/entropy": 3.0}] * 8 + [{"actor/entropy": 0.2}] * 5
    straight = HealthMonitor(load_config(None, []).trainer.health)  # patience 3
    fired_straight = [bool(straight.check(m)) for m in steps]
    assert True in fired_straight
    before = HealthMonitor(load_config(None, []).trainer.health)
    for m in steps[:9]:  # the fall has begun: one step of its streak
        before.check(m)
    after = HealthMonitor(load_config(None, []).trainer.health)
    after.load_state_dict(json.loads(json.dumps(before.state_dict())))
    fired = [bool(after.check(m)) for m in steps[9:]]
    assert fired == fired_straight[9:]
    assert after.metrics() == straight.metrics()
    fresh = HealthMonitor(load_config(None, []).trainer.health)  # as before the fix
    assert not any(fresh.check(m) for m in steps[9:])
    assert after.state_dict() == straight.state_dict()
    empty = HealthMonitor(load_config(None, []).trainer.health)
    empty.load_state_dict({})  # a checkpoint from before it kept them
    assert empty.state_dict()["entropies"] == []


def test_the_probe_is_recorded_with_the_alarms_off(caplog):
    """With ``trainer.health.enable=false`` the servers still score the post-sync probe
    (``sync.probe`` is its own switch): its ``sync/probe_*`` metrics are recorded, only the
    per-server warning is the health rule's (they were dropped with it)."""
    from learner.health import check_probe

    mine, theirs = [-1.0, -2.0], {"s0": [-1.0, -2.0], "s1": [-3.0, -4.0]}
    off = load_config(None, ["trainer.health.enable=false"]).trainer.health
    with caplog.at_level("WARNING", logger="learner.health"):
        metrics = check_probe(mine, theirs, 3, off)
    assert metrics["sync/probe_servers"] == 2 and metrics["sync/probe_mean_abs_diff"] > 0.5
    assert not caplog.records
    on = load_config(None, []).trainer.health
    with caplog.at_level("WARNING", logger="learner.health"):
        assert check_probe(mine, theirs, 3, on) == metrics
    assert [r.getMessage().split(" scores")[0] for r in caplog.records] == [
        "health: probe after version 3: s1"
    ]


def test_a_reversed_weight_range_is_refused():
    """``w_mean_range=[2, 0.5]`` alarmed on every step, at a mean weight of 1 too."""
    with pytest.raises(ConfigError, match=r"w_mean_range.*reversed; give it as \[low, high\]"):
        load_config(None, ["trainer.health.w_mean_range=[2.0,0.5]"])
