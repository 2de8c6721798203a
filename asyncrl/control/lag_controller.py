"""The adaptive staleness controller (``staleness.controller: adaptive``): the admission lag,
set each learner step within ``[staleness.min_policy_lag, staleness.max_policy_lag]`` from
what the step measured.

Lag buys throughput (the servers generate while the learner trains) and costs correction
quality (older data, weights further from 1). The controller trades one for the other on
measurements instead of a guess:

- **narrow** at once, by one version, when the correction degrades: the importance weights'
  ESS under ``trainer.health.min_ess``, the mismatch KL over
  ``trainer.health.max_mismatch_kl``, or more than :data:`LAG_DROP_FRAC` of the groups the
  buffer took since the last step dropped for lag;
- **widen** by one version when the correction is comfortably healthy (ESS at least twice its
  floor, or halfway from the floor to 1 when that is less; mismatch KL at most half its
  ceiling) and the learner waited for data for at least
  :data:`WIDEN_WAIT` of its step, at most once per :data:`HOLD_STEPS` steps (a change needs a
  few steps to show in the measurements), unless a validation round was being generated
  during the step: the servers then spend time on the round that a wider lag cannot give
  back, and widening on that wait would keep the wider lag for the rest of the run;
- otherwise hold.

It paces admission rather than dropping work: a narrower lag deals no new task until the
learner has consumed enough of what is in flight (the buffer's own drop rule keeps
``max_policy_lag``). Pure: :func:`decide` is the rule, :class:`LagController` its memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Share of a step the learner must have waited for data before the lag widens.
WIDEN_WAIT = 0.2
#: Steps between two widenings.
HOLD_STEPS = 3
#: Share of the groups taken since the last step that the buffer may drop for lag.
LAG_DROP_FRAC = 0.05


@dataclass(frozen=True)
class Signals:
    """What one learner step measured."""

    ess: float  # importance/ess
    mismatch_kl: float  # importance/mismatch_kl
    lag_drop_frac: float  # buffer lag drops / groups in, since the last step
    learner_wait: float  # timing/wait_fraction
    validating: bool = False  # a validation round was in flight during the step


def decide(
    lag: int, low: int, high: int, s: Signals, min_ess: float, max_kl: float
) -> tuple[int, str]:
    """The admission lag after a step measured ``s``, and why (see the module docstring)."""
    if s.ess < min_ess:
        return max(low, lag - 1), f"narrow: ESS {s.ess:.3f} < {min_ess:g}"
    if abs(s.mismatch_kl) > max_kl:
        return max(low, lag - 1), f"narrow: mismatch KL {s.mismatch_kl:.4f} beyond {max_kl:g}"
    if s.lag_drop_frac > LAG_DROP_FRAC:
        return max(low, lag - 1), f"narrow: {s.lag_drop_frac:.0%} of new groups dropped for lag"
    # Twice the floor, or halfway from it to 1 where twice is out of reach (min_ess 0.5
    # asked for an ESS of exactly 1: every weight equal, so the lag never widened).
    comfortable_ess = min(2 * min_ess, (1 + min_ess) / 2)
    comfortable = s.ess >= comfortable_ess and abs(s.mismatch_kl) <= max_kl / 2
    if comfortable and s.learner_wait >= WIDEN_WAIT:
        if s.validating:
            return lag, "hold: the learner waited while a validation round shared the servers"
        return min(high, lag + 1), f"widen: healthy, the learner waited {s.learner_wait:.0%}"
    return lag, "hold"


class LagController:
    """The controller's state: the current lag and when it last widened."""

    def __init__(self, low: int, high: int, min_ess: float, max_kl: float) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"lag bounds [{low}, {high}] are not a range")
        self.low, self.high, self.min_ess, self.max_kl = low, high, min_ess, max_kl
        self.lag = low  # start synchronous-ish: widen only on evidence
        self.widened_at = -HOLD_STEPS
        # The buffer's counters (cumulative) at the last step: lag drops are judged on what
        # came in since. None until a step reports them: a learner that starts without a
        # checkpoint may meet a buffer that has run for hours (its counters are the whole
        # run's), so its first step only takes them, judging no drops.
        self.groups_in: float | None = None
        self.lag_drops: float | None = None
        self.last_reason = "start"

    def state_dict(self) -> dict[str, float | None]:
        """The lag reached, when it last widened, and the buffer counters last seen (saved
        in learner checkpoints: a resumed run goes on at the lag it had earned, not back at
        ``low``, and judges its first step's drops on the groups since the checkpoint, not
        on the buffer's whole run)."""
        return {
            "lag": self.lag,
            "widened_at": self.widened_at,
            "groups_in": self.groups_in,
            "lag_drops": self.lag_drops,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lag = min(max(int(state["lag"]), self.low), self.high)  # the bounds may change
        self.widened_at = int(state["widened_at"])
        self.groups_in, self.lag_drops = state.get("groups_in"), state.get("lag_drops")
        self.last_reason = "restored"

    def step(self, step: int, metrics: dict[str, float], validating: bool = False) -> int | None:
        """Take one step's metrics; the new lag when it changes, else None. ``validating``:
        a validation round was in flight during the step (its wait does not widen)."""
        groups_in = metrics.get("buffer/groups_in", self.groups_in)
        drops = metrics.get("buffer/drops/lag", self.lag_drops)
        new_in, new_drops = _since(groups_in, self.groups_in), _since(drops, self.lag_drops)
        self.groups_in, self.lag_drops = groups_in, drops
        ess, kl = metrics.get("importance/ess"), metrics.get("importance/mismatch_kl")
        if ess is None or kl is None or not (math.isfinite(ess) and math.isfinite(kl)):
            return None  # no measurement this step (e.g. a critic-only warmup step)
        signals = Signals(
            ess=ess,
            mismatch_kl=kl,
            lag_drop_frac=new_drops / new_in if new_in > 0 else 0.0,
            learner_wait=metrics.get("timing/wait_fraction", 0.0),
            validating=validating,
        )
        lag, reason = decide(self.lag, self.low, self.high, signals, self.min_ess, self.max_kl)
        if lag > self.lag and step - self.widened_at < HOLD_STEPS:
            return None  # too soon after the last widening to judge it
        if lag == self.lag:
            return None
        if lag > self.lag:
            self.widened_at = step
        self.lag, self.last_reason = lag, reason
        return lag


def _since(now: float | None, before: float | None) -> float:
    """How much a cumulative counter rose since ``before``; 0 while either is unknown. A
    counter below ``before`` belongs to a restarted buffer, which counted from zero."""
    if now is None or before is None:
        return 0.0
    return now - before if now >= before else now
