"""What a rollout server counts and reports: cumulative counters, the recent rewards and
response lengths, tokens by policy version, the time it waited for tasks, and the time its
engine had nothing to run because every response in flight waited for the scorer or the
buffer; the snapshot rides on the server's heartbeat (``rollout/*``).

A second paused for a weight sync is the sync's (``rollout/sync_pause_s``: the engine's
pause clock, which also runs while partly loaded weights hold generation until a catch-up):
the waits counted here leave it out, so that the waits of one snapshot add up to its
``rollout/uptime_s`` at most."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from asyncrl.control.server_totals import INCARNATION
from asyncrl.launch.startup import collector_metrics

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from asyncrl.control.messages import Task
    from asyncrl.rewards import ScoreResult
    from rollout_servers.protocols import Tokenizer
    from rollout_servers.samples import Sample

log = logging.getLogger(__name__)

#: Responses the recent reward and length means are taken over.
RECENT = 1000
#: A pushed group's first sample is logged every this many groups.
SAMPLE_EVERY = 50
#: Versions ``rollout/tokens_by_version/<v>`` counts (the newest).
TOKENS_BY_VERSION_KEPT = 16
#: What the responses in flight can wait on once generated, and the counter of the time
#: the engine is left with nothing to run because all of them do.
AFTER_GENERATION = {"scoring": "rollout/score_wait_s", "pushing": "rollout/push_blocked_s"}

#: When a wait began: (``time.monotonic()``, the engine's pause clock) then.
Mark = tuple[float, float]


def _never_paused() -> float:
    return 0.0


def _unpaused(since: Mark, now: float, paused: float) -> float:
    """Seconds from ``since`` to ``now`` not paused for a weight sync (``paused``: the pause
    clock now); the pause is already in ``rollout/sync_pause_s``."""
    return max(0.0, now - since[0] - (paused - since[1]))


class AfterGeneration:
    """The time every response in flight is generated and waits for the scorer
    (``rollout/score_wait_s``) or, none scoring, for the buffer to take its group
    (``rollout/push_blocked_s``): the engine has nothing to run then, so that time is
    neither generation nor a wait for tasks. A slow reward function shows here, not as
    generation."""

    def __init__(
        self, metrics: dict[str, float], paused: Callable[[], float] = _never_paused
    ) -> None:
        self.metrics = metrics
        self.paused = paused  # the engine's pause clock
        for key in AFTER_GENERATION.values():
            metrics[key] = 0.0
        self.inflight = 0  # responses dealt and not finished
        self.at = dict.fromkeys(AFTER_GENERATION, 0)  # of those, generated and waiting
        self.since: Mark | None = None
        self.waiting_for = ""

    def slots(self, n: int) -> None:
        """``n`` responses started (negative: finished, their group pushed or failed)."""
        self.inflight += n
        self._settle()

    @contextlib.contextmanager
    def phase(self, kind: str, n: int) -> Iterator[None]:
        """``n`` generated responses wait for ``kind`` (``scoring``, ``pushing``)."""
        self.at[kind] += n
        self._settle()
        try:
            yield
        finally:
            self.at[kind] -= n
            self._settle()

    def ongoing(self, now: float, paused: float) -> dict[str, float]:
        """The wait in progress at ``now`` (``paused``: the pause clock then), by counter
        (added to the counters in a snapshot)."""
        if self.since is None:
            return {}
        return {AFTER_GENERATION[self.waiting_for]: _unpaused(self.since, now, paused)}

    def _settle(self) -> None:
        now, paused = time.monotonic(), self.paused()
        if self.since is not None:
            self.metrics[AFTER_GENERATION[self.waiting_for]] += _unpaused(self.since, now, paused)
            self.since = None
        if self.inflight > 0 and sum(self.at.values()) >= self.inflight:
            self.waiting_for = "scoring" if self.at["scoring"] else "pushing"
            self.since = (now, paused)


class ServerStats:
    """The counters of one rollout server (its own groups and its endpoint's)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.metrics: dict[str, float] = {
            "rollout/task_wait_s": 0.0,
            "rollout/groups": 0,
            "rollout/tokens": 0,
            "rollout/prompts_truncated": 0,
            "rollout/task_errors": 0,
            "rollout/reward_errors": 0,  # samples the scorer failed on (scored 0.0)
            "rollout/push_wait_s": 0.0,
            "rollout/groups_filtered": 0,  # algorithm.filter_groups: dropped here, unpushed
            "rollout/dropped_acks_resent": 0,  # a dropped group's ack, unanswered, sent again
            "rollout/filter_metric_unknown": 0,  # filter_groups.metric no member carries
            "rollout/prompts_filtered_too_long": 0,  # data.filter_overlong_prompts
            "rollout/version_wait_s": 0.0,  # tasks waiting for the version they were dealt at
            "rollout/version_wait_missed": 0,  # tasks started under older weights than dealt
            "rollout/probe_timeouts": 0,  # post-sync probes not scored in time (sync stands)
            "rollout/samples_dated_down": 0,  # spanned a catch-up down (samples.add_span)
            # This process's own number: the coordinator's run totals tell a restarted
            # server's counts (from 0 again) from the same process's (server_totals).
            INCARNATION: float(secrets.randbits(52)),
        }
        self.groups_done = 0
        self.tokens_by_version: Counter[int] = Counter()
        self.rewards: deque[float] = deque(maxlen=RECENT)  # of the latest responses
        self.lengths: deque[int] = deque(maxlen=RECENT)
        self.started = time.monotonic()
        # The engine's pause clock (GenerationEngine.paused_s), handed over with each
        # snapshot: the task loop takes its first before its first task, and a fresh engine
        # has not paused, so the 0.0 of the stand-in until then is the engine's too.
        self.paused_s: Callable[[], float] = _never_paused
        # Task wait = time with nothing in flight (idle, waiting for a grant) and not paused
        # for a sync: marked when the last sequence finishes, added to rollout/task_wait_s
        # when tasks arrive.
        self.idle_since: Mark | None = (self.started, 0.0)
        self.after_generation = AfterGeneration(self.metrics, lambda: self.paused_s())

    def busy(self) -> None:
        """Something is in flight again: the idle time so far was a wait for tasks."""
        if self.idle_since is not None:
            now, paused = time.monotonic(), self.paused_s()
            self.metrics["rollout/task_wait_s"] += _unpaused(self.idle_since, now, paused)
            self.idle_since = None

    def idle(self) -> None:
        self.idle_since = (time.monotonic(), self.paused_s())

    def count_group(self, samples: list[Sample], scores: list[ScoreResult], task: Task) -> None:
        """Count a pushed group (the server's own, or an endpoint's)."""
        self.groups_done += 1
        self.metrics["rollout/groups"] += 1
        for s, score in zip(samples, scores, strict=True):
            self.metrics["rollout/tokens"] += len(s.token_ids)
            self.metrics["rollout/samples_dated_down"] += s.dated_down
            for version, n in s.version_spans:
                self.tokens_by_version[version] += n
            if not task.validation:  # a round's scores (val/*) made the training curve jump
                self.rewards.append(score.score)
                self.lengths.append(len(s.token_ids))
        # The newest versions only: every entry rides on each heartbeat, whose metrics are
        # bounded (a run of a thousand pushes had its heartbeats refused).
        while len(self.tokens_by_version) > TOKENS_BY_VERSION_KEPT:
            del self.tokens_by_version[min(self.tokens_by_version)]
        if self.groups_done % SAMPLE_EVERY == 1:  # a sample generation, now and then
            text = self.tok.decode(samples[0].token_ids, skip_special_tokens=True)
            log.info(
                "sample [%s] %r -> %r reward %.2f",
                task.task_id,
                task.prompt[-1]["content"][:200] if task.prompt else "(an outside agent's)",
                text[:200],
                scores[0].score,
            )

    def snapshot(
        self,
        parts: Sequence[Mapping[str, float]],
        inflight: int,
        paused_s: Callable[[], float] | None = None,
    ) -> dict[str, float]:
        """Current metrics: the counters, the metrics of the server's ``parts`` (engine
        first: its ``rollout/sync_pause_s`` counts as waiting), and recent means, all as of
        one instant. ``paused_s``: the engine's pause clock, kept for the waits to come; the
        snapshot's ``rollout/sync_pause_s`` is its reading (a pause in progress included)."""
        if paused_s is not None:
            self.paused_s = paused_s
        now, paused = time.monotonic(), self.paused_s()
        elapsed = max(now - self.started, 1e-9)
        out = dict(self.metrics)
        for part in parts:
            out.update(part)
        if self.paused_s is not _never_paused:  # the pause in progress (a hold) included
            out["rollout/sync_pause_s"] = paused
        # This snapshot's own clock: the change of a wait between two heartbeats over the
        # change of this is its share of that time (the learner's records, which carry the
        # last heartbeat, are not written when it was taken).
        out["rollout/uptime_s"] = elapsed
        out["rollout/tokens_per_s"] = self.metrics["rollout/tokens"] / elapsed
        out["rollout/inflight"] = inflight
        if self.idle_since is not None:  # idle now: count the wait so far
            out["rollout/task_wait_s"] += _unpaused(self.idle_since, now, paused)
        for key, waited in self.after_generation.ongoing(now, paused).items():
            out[key] += waited
        out["rollout/score_wait_fraction"] = min(1.0, out["rollout/score_wait_s"] / elapsed)
        # A sync while idle is the sync's alone (the task wait leaves it out); capped at 1
        # all the same, as the engine counts its pauses by a clock of its own.
        waited = out["rollout/task_wait_s"] + out.get("rollout/sync_pause_s", 0.0)
        out["rollout/wait_fraction"] = min(1.0, waited / elapsed)
        if self.rewards:
            out["rollout/reward_mean"] = sum(self.rewards) / len(self.rewards)
            out["rollout/response_length_mean"] = sum(self.lengths) / len(self.lengths)
        for version, n in self.tokens_by_version.items():
            out[f"rollout/tokens_by_version/{version}"] = n
        return out | collector_metrics("rollout")
