"""The adaptive staleness controller (``staleness.controller: adaptive``): the admission lag,
set each learner step within ``[staleness.min_policy_lag, staleness.max_policy_lag]`` from
what the step measured.

Lag buys throughput (the servers generate while the learner trains) and costs correction
quality (older data, weights further from 1). The controller trades one for the other on
measurements instead of a guess:

- **narrow** at once, by one version (then not again until the batches dealt after it are
  trained, :meth:`LagController.hold_after`, unless the degradation is :func:`severe`), when the
  correction degrades: the importance weights'
  ESS under ``trainer.health.min_ess``, the mismatch KL over
  ``trainer.health.max_mismatch_kl``, or more than :data:`LAG_DROP_FRAC` of the groups the
  buffer took since the last step dropped for lag;
- **widen** by one version when the correction is comfortably healthy (ESS at least twice its
  floor, or halfway from the floor to 1 when that is less; mismatch KL at most half its
  ceiling) and the learner waited for data for at least
  :data:`WIDEN_WAIT` of its step, at most once per :data:`HOLD_STEPS` steps (a change needs a
  few steps to show in the measurements), and into a lag it was narrowed from only after
  :data:`BACKOFF_STEPS` (doubled at each failure of that lag), unless a validation round was being generated
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
#: Steps between two widenings, and between two narrowings: a change shows in the
#: measurements only once the batches dealt under it are trained.
HOLD_STEPS = 3
#: Steps before the lag widens again into one it was narrowed from, doubled each time that
#: lag fails again (at most :data:`MAX_BACKOFF_STEPS`): without it the controller cycled
#: back into the failed lag every few steps, training on its stale data each time.
BACKOFF_STEPS = 4 * HOLD_STEPS
MAX_BACKOFF_STEPS = 16 * BACKOFF_STEPS
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


def severe(s: Signals, min_ess: float, max_kl: float) -> bool:
    """A degradation past twice its threshold (ESS under half its floor, mismatch KL over
    twice its ceiling, lag drops over twice their share): it narrows even within the hold
    after a narrowing."""
    return (
        s.ess < min_ess / 2
        or abs(s.mismatch_kl) > 2 * max_kl
        or s.lag_drop_frac > 2 * LAG_DROP_FRAC
    )


class LagController:
    """The controller's state: the current lag and when it last widened."""

    def __init__(
        self, low: int, high: int, min_ess: float, max_kl: float, sync_every: int = 1
    ) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"lag bounds [{low}, {high}] are not a range")
        self.low, self.high, self.min_ess, self.max_kl = low, high, min_ess, max_kl
        self.sync_every = sync_every
        self.lag = low  # start synchronous-ish: widen only on evidence
        self.widened_at = -HOLD_STEPS
        self.narrowed_at = -HOLD_STEPS
        # How long each way's last move holds (see hold_after).
        self.widen_hold = self.narrow_hold = HOLD_STEPS
        # lag -> (the step it was last narrowed from, how many times it has been)
        self.failed: dict[int, tuple[int, int]] = {}
        # The buffer's counters (cumulative) at the last step: lag drops are judged on what
        # came in since. None until a step reports them: a learner that starts without a
        # checkpoint may meet a buffer that has run for hours (its counters are the whole
        # run's), so its first step only takes them, judging no drops.
        self.groups_in: float | None = None
        self.lag_drops: float | None = None
        self.last_reason = "start"

    def state_dict(self) -> dict[str, Any]:
        """The lag reached, when it last widened, and the buffer counters last seen (saved
        in learner checkpoints: a resumed run goes on at the lag it had earned, not back at
        ``low``, and judges its first step's drops on the groups since the checkpoint, not
        on the buffer's whole run)."""
        return {
            "lag": self.lag,
            "widened_at": self.widened_at,
            "narrowed_at": self.narrowed_at,
            "widen_hold": self.widen_hold,
            "narrow_hold": self.narrow_hold,
            "failed": {str(k): list(v) for k, v in self.failed.items()},
            "groups_in": self.groups_in,
            "lag_drops": self.lag_drops,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lag = min(max(int(state["lag"]), self.low), self.high)  # the bounds may change
        self.widened_at = int(state["widened_at"])
        # Absent from checkpoints saved before the narrowing hold: no failure remembered.
        self.narrowed_at = int(state.get("narrowed_at", -HOLD_STEPS))
        self.widen_hold = int(state.get("widen_hold", HOLD_STEPS))
        self.narrow_hold = int(state.get("narrow_hold", HOLD_STEPS))
        self.failed = {int(k): (int(v[0]), int(v[1])) for k, v in state.get("failed", {}).items()}
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
        if lag == self.lag or self._held(step, lag, severe(signals, self.min_ess, self.max_kl)):
            return None
        if lag > self.lag:
            self.widened_at, self.widen_hold = step, self.hold_after(self.lag)
        else:
            self.narrowed_at, self.narrow_hold = step, self.hold_after(self.lag)
            _, times = self.failed.get(self.lag, (step, 0))
            self.failed[self.lag] = (step, times + 1)
        self.lag, self.last_reason = lag, reason
        return lag

    def _held(self, step: int, lag: int, severe: bool) -> bool:
        """Whether the move to ``lag`` waits: too soon after the last move the same way
        to judge it (the batches since were dealt before it; a severe degradation narrows
        all the same), or a widening into a lag that failed within its backoff."""
        if lag < self.lag:
            return not severe and step - self.narrowed_at < self.narrow_hold
        if step - self.widened_at < self.widen_hold:
            return True
        failed_at, times = self.failed.get(lag, (0, 0))
        backoff = min(BACKOFF_STEPS * 2 ** (times - 1), MAX_BACKOFF_STEPS) if times else 0
        return step - failed_at < backoff

    def hold_after(self, lag: int) -> int:
        """Steps a move from ``lag`` holds before the next the same way: until the first
        batch dealt after it is trained, ``lag * sync_every + 1`` steps later (the window
        moves only at a push), and at least :data:`HOLD_STEPS`. At a fixed 3, a push every
        second step or a lag of 3 or more narrowed again on batches all dealt before the
        first narrowing, down to ``min_policy_lag`` on one dip."""
        return max(HOLD_STEPS, lag * self.sync_every + 1)


def _since(now: float | None, before: float | None) -> float:
    """How much a cumulative counter rose since ``before``; 0 while either is unknown. A
    counter below ``before`` belongs to a restarted buffer, which counted from zero."""
    if now is None or before is None:
        return 0.0
    return now - before if now >= before else now
