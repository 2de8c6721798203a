"""Health alarms: the learner's per-step metrics checked against ``trainer.health.*``.

Staleness and a train/inference mismatch hurt a run quietly: the loss still goes down while
the importance weights degenerate. Each rule below watches one metric the learner already
computes; crossing it gives one :class:`Alarm` whose line names the metric, its value, the
threshold, the likely cause and the fix. The defaults for the importance weights follow
veRL's documented levels for its rollout-correction metrics (mean weight within [0.5, 2],
ESS >= 0.3, |mismatch KL| <= 0.1, chi^2 <= 1).

Pure apart from the little history two rules need (the first entropy, recent grad norms):
:class:`HealthMonitor` takes a step's metrics and returns its alarms; the learner logs them,
counts them (``health/<rule>``) and, with ``trainer.health.action: stop``, ends the run
with a checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config.schema import HealthConfig

log = logging.getLogger(__name__)

#: Steps over which an entropy collapse is measured.
ENTROPY_WINDOW = 10
#: Steps of grad-norm history a spike is measured against.
GRAD_WINDOW = 20
#: Steps before the grad-norm rule speaks (a median of fewer says little).
GRAD_WARMUP = 5

STALE = (
    "the data is too stale (or off-policy) for the correction: lower "
    "staleness.max_policy_lag, or set algorithm.importance.mode=tis if it is none"
)
MISMATCH = (
    "the servers sample from other weights or numerics than the learner scores with: check "
    "rollout.temperature and model.dtype match, and the sync (sync/* metrics)"
)
#: The same rule on a batch with lag: behaviour against learner then also counts how far
#: the policy moved since the data was generated (early in a run, at a high learning rate).
MISMATCH_STALE = (
    "the batch's mean lag is {lag:.3g}, and the policy moved since it was generated: lower "
    "staleness.max_policy_lag or actor.optim.lr; if it persists at lag 0, the servers "
    "sample from other numerics (rollout.temperature, model.dtype, sync/* metrics)"
)


def _mismatch_advice(m: dict[str, float]) -> str:
    """The mismatch rule's fix: staleness when the batch is behind the learner's weights,
    in pushes (``lag/mean``) or in updates since the last push (``sync_every`` > 1), else
    the two stacks' numerics."""
    lag, since = m.get("lag/mean", 0.0), m.get("lag/steps_since_push", 0.0)
    if lag:
        return MISMATCH_STALE.format(lag=lag)
    if since:
        return (
            f"the batch is at lag 0 but {since:.0f} update(s) behind the learner "
            "(staleness.sync_every > 1): the policy moved since it was generated; lower "
            "staleness.sync_every or actor.optim.lr"
        )
    return MISMATCH


@dataclass(frozen=True)
class Alarm:
    """One crossed threshold of one step."""

    rule: str  # counted as health/<rule>
    metric: str
    value: float
    threshold: str  # as configured, e.g. ">= 0.3"
    advice: str  # the likely cause and the fix

    steps: int = 1  # steps in a row it has been crossed

    def line(self, step: int) -> str:
        run = f" for {self.steps} steps" if self.steps > 1 else ""
        return (
            f"health: step {step}: {self.metric}={self.value:.4g} outside {self.threshold}"
            f"{run} (trainer.health.{self.rule}): {self.advice}"
        )


class HealthMonitor:
    """Checks each step's metrics (see the module docstring)."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self.entropies: deque[float] = deque(maxlen=ENTROPY_WINDOW + 1)
        self.norms: deque[float] = deque(maxlen=GRAD_WINDOW)
        self.counts: dict[str, int] = {}
        self.streaks: dict[str, int] = {}  # consecutive steps each rule has been crossed

    def check(self, metrics: dict[str, float]) -> list[Alarm]:
        """The alarms of one step's ``metrics`` (missing metrics are not checked). A rule
        alarms once it has been crossed ``patience`` steps in a row (and again every
        ``patience`` steps while it stays crossed): one step's excursion, such as a single
        large weight early in a run, is noise. Non-finite values alarm at once."""
        if not self.cfg.enable:
            return []
        crossed = {a.rule: a for a in self._importance(metrics) + self._updates(metrics) if a}
        alarms = []
        for rule in RULES:
            self.streaks[rule] = self.streaks.get(rule, 0) + 1 if rule in crossed else 0
            patience = 1 if rule in AT_ONCE else self.cfg.patience
            if self.streaks[rule] and self.streaks[rule] % patience == 0:
                alarms.append(dataclasses.replace(crossed[rule], steps=self.streaks[rule]))
                self.counts[rule] = self.counts.get(rule, 0) + 1
        return alarms

    def state_dict(self) -> dict[str, Any]:
        """The history the rules judge by (windows, streaks) and the counts, for the
        checkpoint: a collapse or a streak that spans a learner restart is still seen."""
        return {
            "entropies": list(self.entropies),
            "norms": list(self.norms),
            "counts": dict(self.counts),
            "streaks": dict(self.streaks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s data (a key a checkpoint lacks starts empty)."""
        self.entropies.extend(float(x) for x in state.get("entropies", []))
        self.norms.extend(float(x) for x in state.get("norms", []))
        self.counts.update({str(k): int(v) for k, v in state.get("counts", {}).items()})
        self.streaks.update({str(k): int(v) for k, v in state.get("streaks", {}).items()})

    def metrics(self) -> dict[str, float]:
        """``health/<rule>``: alarms so far, every rule (0 when it never fired)."""
        return {f"health/{rule}": float(self.counts.get(rule, 0)) for rule in RULES}

    def _importance(self, m: dict[str, float]) -> list[Alarm | None]:
        c = self.cfg
        low, high = c.w_mean_range
        # The share over the cap: truncated under tis, masked out of the gradient under mis
        # (the other reads 0; under mis a third of the tokens were dropped without a word).
        masked = m.get("importance/masked_frac", 0.0) > 0
        capped = "importance/masked_frac" if masked else "importance/truncated_frac"
        return [
            _outside(m, "w_mean", "importance/w_mean", low, high, STALE),
            _outside(m, "min_ess", "importance/ess", c.min_ess, None, STALE),
            _outside(m, "max_chi2", "importance/chi2", None, c.max_chi2, STALE),
            _outside(
                m,
                "max_truncated_frac",
                capped,
                None,
                c.max_truncated_frac,
                f"many weights exceed algorithm.importance.cap: {STALE}",
            ),
            _outside(
                m,
                "max_mismatch_kl",
                "importance/mismatch_kl",
                None,
                c.max_mismatch_kl,
                _mismatch_advice(m),
                absolute=True,
            ),  # fmt: skip
        ]

    def _updates(self, m: dict[str, float]) -> list[Alarm | None]:
        c = self.cfg
        out = [
            _outside(
                m,
                "max_ppo_kl",
                "actor/ppo_kl",
                None,
                c.max_ppo_kl,
                "the policy moves far within one batch: lower actor.optim.lr or actor.ppo_epochs",
            ),
            self._entropy(m),
            self._grad_spike(m),
        ]
        out.append(
            _outside(
                m,
                "max_probe_diff",
                "sync/probe_mean_abs_diff",
                None,
                c.max_probe_diff,
                f"a server holds other weights than the learner pushed: {PROBE_LOG}",
            )
        )
        # The critic's skipped updates too: a critic that stops learning leaves GAE's
        # advantages on stale values, with nothing else in the record to show it.
        names = ("actor/skipped_updates", "importance/nonfinite_dropped", "critic/skipped_updates")
        bad = sum(m.get(name, 0.0) for name in names)
        if bad > 0 and c.nonfinite:
            out.append(
                Alarm(
                    "nonfinite",
                    "+".join(name for name in names if name in m),
                    bad,
                    "== 0",
                    "non-finite losses, gradients or logprobs: lower actor.optim.lr (or "
                    "critic.optim.lr), check model.dtype (bf16 overflow) and the behaviour "
                    "logprobs",
                )
            )
        return out

    def _entropy(self, m: dict[str, float]) -> Alarm | None:
        """A collapse is a fall, not a level: learning a task with one right answer lowers
        the entropy tenfold over a run (the CPU demo: 3.0 to 0.3 in 180 steps), a collapse
        does it within a few steps. So the entropy is compared with its value
        :data:`ENTROPY_WINDOW` steps before."""
        value = m.get("actor/entropy")
        if value is None or not math.isfinite(value):
            return None
        self.entropies.append(value)
        if len(self.entropies) <= ENTROPY_WINDOW:
            return None
        before = self.entropies[0]
        if value >= self.cfg.entropy_collapse_frac * before:
            return None
        return Alarm(
            "entropy_collapse_frac",
            "actor/entropy",
            value,
            f">= {self.cfg.entropy_collapse_frac:g} x its value {ENTROPY_WINDOW} steps before "
            f"({before:.3g})",
            "the policy is collapsing onto few tokens: lower actor.optim.lr, raise "
            "actor.clip_ratio_high (clip-higher) or add actor.entropy_coeff",
        )

    def _grad_spike(self, m: dict[str, float]) -> Alarm | None:
        value = m.get("actor/grad_norm")
        if value is None or not math.isfinite(value) or value <= 0:
            return None
        history = list(self.norms)
        self.norms.append(value)
        if len(history) < GRAD_WARMUP:
            return None
        median = statistics.median(history)
        limit = self.cfg.grad_norm_spike * median
        if value <= limit:
            return None
        return Alarm(
            "grad_norm_spike",
            "actor/grad_norm",
            value,
            f"<= {self.cfg.grad_norm_spike:g} x the recent median ({median:.3g})",
            "one batch pulls hard (an outlier reward or stale data): check reward/* and "
            "lag/*; actor.grad_clip bounds the step",
        )


#: Rules that alarm on the first step: no excursion of theirs is noise.
AT_ONCE = ("nonfinite", "max_probe_diff")
#: Where the probe's server-by-server verdict is logged.
PROBE_LOG = "the 'probe after version' line before this one names it"

RULES = (
    "w_mean",
    "min_ess",
    "max_chi2",
    "max_truncated_frac",
    "max_mismatch_kl",
    "max_ppo_kl",
    "entropy_collapse_frac",
    "grad_norm_spike",
    "nonfinite",
    "max_probe_diff",
)


def learner_probe(trainer: Any) -> list[float]:
    """The learner's logprobs of the post-sync probe (:mod:`asyncrl.sync.probe`) under its
    current weights, at temperature 1, concatenated over the probe's sequences; empty when
    the model is too short for it. A collective on every rank (``Trainer.compute_logprobs``)."""
    from asyncrl.sync.probe import probe_ids
    from learner.rollouts import Rollout

    rollouts = [
        Rollout(ids[:1], ids[1:], [0.0] * (len(ids) - 1), 0.0, f"probe/{i}")
        for i, ids in enumerate(probe_ids())
    ]
    out = trainer.compute_logprobs(rollouts, 1.0)
    if any(lp is None for lp in out):
        return []
    return [float(x) for lp in out for x in lp.tolist()]


def check_probe(
    mine: list[float], theirs: dict[str, list[float]], version: int, cfg: HealthConfig
) -> dict[str, float]:
    """The post-sync probe of one push: its ``sync/probe_*`` metrics, and one log line per
    server whose probe is further than ``max_probe_diff`` from the learner's (named)."""
    from asyncrl.sync.probe import compare, probe_metrics

    if not mine:
        return {}
    for server, diff in sorted(compare(mine, theirs).items()):
        if cfg.enable and diff > cfg.max_probe_diff:  # off: measured, and recorded only
            log.warning(
                "health: probe after version %d: %s scores it %.3g nats per token from the "
                "learner (trainer.health.max_probe_diff=%g): its weights arrived corrupted, "
                "out of order or under the wrong version label",
                version,
                server,
                diff,
                cfg.max_probe_diff,
            )
    return probe_metrics(mine, theirs)


def _outside(
    m: dict[str, float],
    rule: str,
    metric: str,
    low: float | None,
    high: float | None,
    advice: str,
    absolute: bool = False,
) -> Alarm | None:
    """An alarm when ``metric`` is present and below ``low`` or above ``high``."""
    value = m.get(metric)
    if value is None or math.isnan(value):
        return None
    seen = abs(value) if absolute else value
    if (low is None or seen >= low) and (high is None or seen <= high):
        return None
    if low is not None and high is not None:
        threshold = f"[{low:g}, {high:g}]"
    elif low is not None:
        threshold = f">= {low:g}"
    else:
        threshold = f"{'|x| ' if absolute else ''}<= {high:g}"
    return Alarm(rule, metric, value, threshold, advice)
