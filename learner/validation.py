"""Validation scores from the validation groups the buffer scored, one record per round.

The coordinator deals a validation round (every validation prompt once, ``val_kwargs.n``
samples each) every ``trainer.test_freq`` steps; the buffer keeps each scored group's sums
by round and validation id. This tracker collects a round's groups by id and reports the
round once they are all in: ``val/score`` (mean reward over the round's responses), its
standard errors over responses and over prompts, and ``val/<data_source>/score``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.wire import ValidationGroup, ValidationStats

if TYPE_CHECKING:
    from asyncrl.control.state import ValidationProgress

log = logging.getLogger(__name__)


class ValidationTracker:
    """Reports each validation round once, when its groups are all in.

    Groups are kept by validation id, so that reading them twice counts them once: the
    buffer keeps its groups for its session (never drained), a restarted buffer scores the
    rest of a round from nothing, and a group it scores again (its report to the
    coordinator lost with the old buffer) is the same id. The groups of rounds not
    reported yet, and the rounds reported, are saved in checkpoints (:meth:`state_dict`),
    so that a learner restarted after a buffer restart still has the old session's part
    of a round. A round reported after the checkpoint by a learner that then died is
    reported again."""

    def __init__(self) -> None:
        self.reported: set[str] = set()  # round keys (``val.<lineage>/<k>``)
        self.groups: dict[str, dict[str, ValidationGroup]] = {}  # unreported: key -> id -> g

    def missing(self, progress: ValidationProgress) -> list[str]:
        """The keys of the started rounds not reported yet."""
        keys = map(progress.round_key, range(progress.rounds_started))
        return [key for key in keys if key not in self.reported]

    def collected(self) -> tuple[int, int]:
        """Rounds reported and groups held for the others: grows as a round comes in."""
        return len(self.reported), sum(map(len, self.groups.values()))

    def pending(self, progress: ValidationProgress) -> bool:
        """Whether a started round is not reported yet."""
        return bool(self.missing(progress))

    def add(
        self,
        by_round: dict[str, dict[str, ValidationGroup]],
        progress: ValidationProgress,
        given_up: Mapping[str, Collection[str]] | None = None,
    ) -> list[dict[str, float]]:
        """Takes in the buffer's scored groups (``by_round``: round key -> validation id ->
        group) and returns the metrics of every started round whose groups (one per
        validation row) are now all in, oldest first (see :func:`round_metrics`).
        ``given_up``: per round key, the ids the coordinator gave up (they failed past
        ``control.task_retries``): never to come, so the round is reported without them,
        ``val/groups_given_up`` saying how many (without it, no score ever again)."""
        out = []
        for key in self.missing(progress):
            have = self.groups.setdefault(key, {})
            for task_id, group in by_round.get(key, {}).items():
                have.setdefault(task_id, group)  # the same id scored twice counts once
            lost = [t for t in (given_up or {}).get(key, ()) if t not in have]
            need = progress.groups_in(key)  # an earlier set's round: its own size
            if need and len(have) + len(lost) >= need:
                metrics = round_metrics(per_source(have.values()))
                # Logged at the step the round completes: say which weights it measured
                if (started := progress.start_step(key)) is not None:
                    metrics["val/step"] = float(started)
                metrics.update(version_range(have.values()))
                if errors := int(metrics["val/reward_errors"]):
                    log.warning(
                        "validation round %s: the scorer failed on %d of its %d responses, "
                        "each scored 0.0 in val/score; the rollout servers' logs say why "
                        "(fix the reward function or reward.* and the next round counts them)",
                        key,
                        errors,
                        int(metrics["val/responses"]),
                    )
                if lost:
                    metrics["val/groups_given_up"] = float(len(lost))
                    log.warning(
                        "validation round %s scored without %d of its %d prompts, given up "
                        "(failed past control.task_retries, dropped by the buffer, or lost "
                        "with a buffer after a resume changed the validation set; the log "
                        "says which): val/score covers the rest",
                        key,
                        len(lost),
                        need,
                    )
                out.append(metrics)
                self.reported.add(key)
                del self.groups[key]
        return out

    def lacking(self, scored: Mapping[str, Iterable[str]]) -> list[str]:
        """Of ``scored`` (per round key, ids the coordinator counts as scored), those of
        rounds not reported whose groups this tracker has not got."""
        return [
            t
            for key, ids in scored.items()
            if key not in self.reported
            for t in ids
            if t not in self.groups.get(key, {})
        ]

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the rounds reported and the groups of those not reported yet."""
        groups = {
            k: {i: msgspec.to_builtins(g) for i, g in v.items()} for k, v in self.groups.items()
        }
        return {"reported": sorted(self.reported), "groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reported = set(state.get("reported", []))
        self.groups = {
            key: {i: msgspec.convert(g, ValidationGroup) for i, g in by_id.items()}
            for key, by_id in state.get("groups", {}).items()
        }


def never_coming(states: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """Of the coordinator's states of unreported rounds' ids (round key -> id -> state),
    per round, those never to be scored: given up (failed past ``control.task_retries``)
    or dropped by the buffer (``dropped/<cause>``: refused, too large, expired; a
    validation group is not dealt again). Without them a round waits for ever."""
    return {
        key: [t for t, st in ids.items() if st == "given_up" or st.startswith("dropped/")]
        for key, ids in states.items()
    }


def version_range(groups: Iterable[ValidationGroup]) -> dict[str, float]:
    """``val/version_min`` and ``val/version_max``: the oldest and newest policy versions a
    round's responses came from (pushes go on while it is generated); none when no group
    says (groups scored before they said)."""
    known = [(g.version_min, g.version_max) for g in groups if g.version_min >= 0]
    if not known:
        return {}
    return {
        "val/version_min": float(min(lo for lo, _ in known)),
        "val/version_max": float(max(hi for _, hi in known)),
    }


def per_source(groups: Iterable[ValidationGroup]) -> dict[str, ValidationStats]:
    """Groups summed per data source."""
    out: dict[str, ValidationStats] = {}
    for g in groups:
        out.setdefault(g.data_source, ValidationStats()).add(g)
    return out


def round_metrics(stats: dict[str, ValidationStats]) -> dict[str, float]:
    """One round's record from its sums per data source: ``val/score`` (mean reward over
    responses), ``val/score_se`` (its standard error over responses),
    ``val/score_se_prompt`` (over prompts' mean rewards: larger when prompts differ in
    difficulty, since a prompt's samples are not independent), ``val/responses``,
    ``val/reward_errors`` (responses the scorer failed on, each scored 0.0),
    ``val/<data_source>/score`` and the mean of each other value the scorer returned,
    ``val/<data_source>/<name>/mean``."""
    resp, prompt = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    for s in stats.values():
        _add(resp, s.trajectories, s.reward_sum, s.reward_sq_sum)
        _add(prompt, s.groups, s.group_mean_sum, s.group_mean_sq_sum)
    n, total, _ = resp
    # No response (every group given up): no score, rather than a 0 read as one.
    out = {"val/score": total / n, "val/responses": n} if n else {"val/responses": 0.0}
    for key, acc in (("val/score_se", resp), ("val/score_se_prompt", prompt)):
        if acc[0] >= 2:
            out[key] = mean_standard_error(*acc)
    # Each failure scored 0.0 and is inside val/score: counted, a broken scorer shows here.
    out["val/reward_errors"] = float(sum(s.reward_errors for s in stats.values()))
    for source, s in stats.items():
        out[f"val/{source}/score"] = s.reward_sum / max(s.trajectories, 1)
        for name, (total, n) in s.parts.items():  # veRL: val-aux/<source>/<name>/mean@N
            out[f"val/{source}/{name}/mean"] = total / max(n, 1)
    return out


def _add(acc: list[float], n: float, total: float, sq: float) -> None:
    acc[0] += n
    acc[1] += total
    acc[2] += sq


def mean_standard_error(n: float, total: float, sq: float) -> float:
    """Standard error of the mean of ``n`` values from their sum and sum of squares
    (sample variance with ``n - 1``); for 0/1 rewards close to ``sqrt(p (1 - p) / n)``."""
    mean = total / n
    var = max(0.0, (sq - n * mean * mean) / (n - 1))
    return math.sqrt(var / n)
