"""What a rollout server counts and reports: cumulative counters, the recent rewards and
response lengths, tokens by policy version, and the time it waited for tasks; the snapshot
rides on the server's heartbeat (``rollout/*``)."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from asyncrl.launch.startup import collector_metrics

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from asyncrl.control.messages import Task
    from asyncrl.rewards import ScoreResult
    from rollout_servers.engine import Sample
    from rollout_servers.protocols import Tokenizer

log = logging.getLogger(__name__)

#: Responses the recent reward and length means are taken over.
RECENT = 1000
#: A pushed group's first sample is logged every this many groups.
SAMPLE_EVERY = 50


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
            "rollout/filter_metric_unknown": 0,  # filter_groups.metric no member carries
            "rollout/prompts_filtered_too_long": 0,  # data.filter_overlong_prompts
            "rollout/version_wait_s": 0.0,  # tasks waiting for the version they were dealt at
        }
        self.groups_done = 0
        self.tokens_by_version: Counter[int] = Counter()
        self.rewards: deque[float] = deque(maxlen=RECENT)  # of the latest responses
        self.lengths: deque[int] = deque(maxlen=RECENT)
        self.started = time.monotonic()
        # Task wait = time with nothing in flight (idle, waiting for a grant): set when the
        # last sequence finishes, added to rollout/task_wait_s when tasks arrive.
        self.idle_since: float | None = self.started

    def busy(self) -> None:
        """Something is in flight again: the idle time so far was a wait for tasks."""
        if self.idle_since is not None:
            self.metrics["rollout/task_wait_s"] += time.monotonic() - self.idle_since
            self.idle_since = None

    def idle(self) -> None:
        self.idle_since = time.monotonic()

    def count_group(self, samples: list[Sample], scores: list[ScoreResult], task: Task) -> None:
        """Count a pushed group (the server's own, or an endpoint's)."""
        self.groups_done += 1
        self.metrics["rollout/groups"] += 1
        for s, score in zip(samples, scores, strict=True):
            self.metrics["rollout/tokens"] += len(s.token_ids)
            for version, n in s.version_spans:
                self.tokens_by_version[version] += n
            self.rewards.append(score.score)
            self.lengths.append(len(s.token_ids))
        if self.groups_done % SAMPLE_EVERY == 1:  # a sample generation, now and then
            text = self.tok.decode(samples[0].token_ids, skip_special_tokens=True)
            log.info(
                "sample [%s] %r -> %r reward %.2f",
                task.task_id,
                task.prompt[-1]["content"][:200] if task.prompt else "(an outside agent's)",
                text[:200],
                scores[0].score,
            )

    def snapshot(self, parts: Sequence[Mapping[str, float]], inflight: int) -> dict[str, float]:
        """Current metrics: the counters, the metrics of the server's ``parts`` (engine
        first: its ``rollout/sync_pause_s`` counts as waiting), and recent means."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        out = dict(self.metrics)
        for part in parts:
            out.update(part)
        out["rollout/tokens_per_s"] = self.metrics["rollout/tokens"] / elapsed
        out["rollout/inflight"] = inflight
        if self.idle_since is not None:  # idle now: count the wait so far
            out["rollout/task_wait_s"] += time.monotonic() - self.idle_since
        # A sync while idle counts in both; the fraction is capped at 1.
        waited = out["rollout/task_wait_s"] + out.get("rollout/sync_pause_s", 0.0)
        out["rollout/wait_fraction"] = min(1.0, waited / elapsed)
        if self.rewards:
            out["rollout/reward_mean"] = sum(self.rewards) / len(self.rewards)
            out["rollout/response_length_mean"] = sum(self.lengths) / len(self.lengths)
        for version, n in self.tokens_by_version.items():
            out[f"rollout/tokens_by_version/{version}"] = n
        return out | collector_metrics("rollout")
