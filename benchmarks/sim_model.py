"""A discrete-event model of the scheduler, in virtual time. Pure: no I/O, no clock.

What it models (docs/DESIGN.md sections 1 and 4):

- ``num_servers`` rollout servers, each a continuous batch of at most ``max_num_seqs``
  sequences. One decode step of ``b`` sequences costs ``decode_fixed_s + decode_per_seq_s * b``
  and gives every active sequence one token; admitting groups costs
  ``prefill_s_per_token * prompt_length`` per group (the ``n`` samples share the prompt).
  A server asks for tasks whenever it has room for a whole group, as the real server does,
  ``tasks_per_request`` at a time; the coordinator grants them under the admission rule of
  :mod:`asyncrl.control.admission` (imported, not re-implemented). Several waiting servers
  are served round-robin. A finished group goes to the buffer.
- The learner takes ``train_batch_size`` groups (oldest first) once that many are in the
  buffer, trains for ``(train_s_per_token * tokens + train_fixed_s) / learner speed``, and
  every ``sync_every`` steps pushes weights: all servers pause for
  ``sync_fixed_s + weight_bytes / sync_bandwidth`` (the learner is busy sending), then the
  version goes up by one and the servers resume; sequences in flight keep going under the
  new weights. A group's version is the one it started under; its lag when trained is the
  learner's version minus that. The buffer drops (and refunds, cause ``lag``) groups whose
  lag exceeds ``max_policy_lag``.
- ``max_policy_lag = 0`` is the synchronous mode: a version's groups are dealt only after
  the previous push, so a step costs generation + training + sync.

Between events, every server runs at a constant rate, so time jumps from one sequence end
to the next (events are sequence ends, training ends and sync ends).

Throughput and the ideal bound are in **trained tokens per second** (prompt + response
tokens of the samples the learner trained on): the learner's cost and the servers' work are
both per token, and a finite window favours short samples, which inflates samples/s but
not tokens/s. The ideal bound is ``min(generation capacity, training capacity)`` in samples/s
times the mean tokens per sample, where generation capacity is what the rollout servers
produce alone at full batch (``max_num_seqs``) without ever pausing, and training capacity
what the learner GPUs train alone (neither pays for syncs).
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections import Counter, deque
from itertools import pairwise

import numpy as np

from asyncrl.control.admission import Budget, budget_limit, groups_per_version
from benchmarks.sim_types import (
    ResponseLengths,
    SimParams,
    SimResult,
    generation_capacity,
    training_capacity,
)

log = logging.getLogger(__name__)

_EPS = 1e-9
_SERVER, _TRAIN_DONE, _SYNC_DONE = 0, 1, 2


class _Server:
    __slots__ = (
        "idx",
        "step",
        "t_last",
        "heap",
        "paused",
        "stall",
        "version",
        "token",
        "wait_since",
        "wait_s",
    )

    def __init__(self, idx: int) -> None:
        self.idx, self.step, self.t_last, self.heap = idx, 0.0, 0.0, []
        self.paused, self.stall, self.version, self.token = False, 0.0, 0, 0
        self.wait_since: float | None = None  # waiting for tasks the budget does not grant
        self.wait_s = 0.0

    def count_wait(self, now: float, still_waiting: bool) -> None:
        if self.wait_since is not None:
            self.wait_s += now - self.wait_since
            self.wait_since = now if still_waiting else None


class _Sim:
    """The event loop. Consumes events in time order; see the module docstring."""

    def __init__(self, p: SimParams, max_policy_lag: int, total_steps: int, seed: int) -> None:
        self.p, self.lag, self.total_steps = p, max_policy_lag, total_steps
        self.per_version = groups_per_version(p.train_batch_size, p.sync_every)
        self.budget = Budget(max_policy_lag=max_policy_lag, per_version=self.per_version)
        self.rng = np.random.default_rng(seed)
        self.pending_lengths: list[list[int]] = []
        self.servers = [_Server(i) for i in range(p.num_servers)]
        self.waiting: dict[int, None] = {}  # insertion-ordered set of server ids
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.groups: dict[int, list[int]] = {}  # id -> [remaining seqs, version, tokens]
        self.next_gid = 0
        self.buffer: deque[tuple[int, int, int]] = deque()  # (gid, version, tokens)
        self.unchecked = 0  # newest buffer entries not yet through the lag filter
        self.charged = 0  # deals counted by the simulator itself, to check the budget
        self.max_excess = -(10**9)
        self.learner_busy = False
        self.idle_since = 0.0
        self.steps_done = 0
        self.step_ends: list[float] = []
        self.lags_by_step: list[Counter[int]] = []
        self.c = Counter()  # cumulative counters: trained_*, learner_wait_s, drops
        self.decoded = 0.0  # response tokens generated so far
        self.step_fixed, self.step_per_seq = p.decode_fixed_s, p.decode_per_seq_s
        self.snaps: list[dict[str, float]] = []

    # ----------------------------------------------------------------- events
    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def run(self) -> None:
        self.deal(range(len(self.servers)))
        events, servers, pop = self.events, self.servers, heapq.heappop
        while self.steps_done < self.total_steps or self.learner_busy:
            if not events:
                raise RuntimeError(f"simulation stalled at t={self.now:.1f}s: {self.c}")
            t, _, kind, a, b = pop(events)
            self.now = t
            if kind == _SERVER:
                if servers[a].token == b:
                    self.on_server(servers[a])
            elif kind == _TRAIN_DONE:
                self.on_train_done()
            else:
                self.on_sync_done()

    # ----------------------------------------------------------------- servers
    def advance(self, s: _Server) -> None:
        """Bring ``s`` to ``now``: decode progress at its current batch size."""
        if s.paused or self.now <= s.t_last:
            return
        if s.heap:
            b = len(s.heap)
            ds = (self.now - s.t_last) / (self.step_fixed + self.step_per_seq * b)
            s.step += ds
            self.decoded += ds * b
        s.t_last = self.now

    def schedule(self, s: _Server) -> None:
        """(Re)plan ``s``'s next sequence end; older plans are void (token)."""
        s.token += 1
        if s.paused or not s.heap:
            return
        heap = s.heap
        ahead = heap[0][0] - s.step
        t = s.t_last + (ahead if ahead > 0 else 0.0) * (
            self.step_fixed + self.step_per_seq * len(heap)
        )
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, _SERVER, s.idx, s.token))

    def on_server(self, s: _Server) -> None:
        """A sequence ends: free its slot, finish its group if it was the last, refill."""
        heap, groups, pop = s.heap, self.groups, heapq.heappop
        target = heap[0][0]
        self.decoded += (target - s.step) * len(heap)  # lands exactly on the end: no drift
        s.step, s.t_last = target, self.now
        finished = 0
        while heap and heap[0][0] <= target + _EPS:
            gid = pop(heap)[1]
            g = groups[gid]
            g[0] -= 1
            if not g[0]:
                del groups[gid]
                self.buffer.append((gid, g[1], g[2]))
                self.unchecked += 1
                finished += 1
        token = s.token
        if self.p.max_num_seqs - len(heap) >= self.p.n:
            self.deal((s.idx,))
        if s.token == token:  # not rescheduled by an admission
            self.schedule(s)
        if finished:
            self.try_train()

    def room(self, s: _Server) -> int:
        return (self.p.max_num_seqs - len(s.heap)) // self.p.n

    def deal(self, ids) -> None:
        """Grant tasks to the servers ``ids`` that have room, round-robin, under the budget;
        those left with room and no grant wait (and count the wait)."""
        pending = [self.servers[i] for i in ids if not self.servers[i].paused]
        pending = [s for s in pending if self.room(s) > 0]
        while pending and self.budget.free(self.charged) > 0:
            again = []
            for s in pending:
                want = min(self.p.tasks_per_request, self.room(s))
                got = min(want, self.budget.free(self.charged))
                if got:
                    self.admit(s, got)
                if self.room(s) > 0:
                    again.append(s)
            pending = again
        for s in pending:
            if s.wait_since is None:
                s.wait_since = self.now
                self.waiting[s.idx] = None

    def admit(self, s: _Server, k: int) -> None:
        self.charged += k
        limit = budget_limit(self.budget.consumed, self.lag, self.per_version)
        self.max_excess = max(self.max_excess, self.charged - limit)
        s.count_wait(self.now, still_waiting=False)
        self.waiting.pop(s.idx, None)
        self.advance(s)
        p = self.p
        for _ in range(k):
            lens = self.next_lengths()
            gid = self.next_gid
            self.next_gid += 1
            self.groups[gid] = [p.n, s.version, p.n * p.prompt_length + sum(lens)]
            for n_tok in lens:
                heapq.heappush(s.heap, (s.step + n_tok, gid))
        s.t_last = max(s.t_last, self.now) + k * p.prompt_length * p.prefill_s_per_token
        self.schedule(s)

    def next_lengths(self) -> list[int]:
        if not self.pending_lengths:  # draw in chunks: one numpy call per 1024 groups
            self.pending_lengths = self.p.lengths.draw(self.rng, 1024, self.p.n).tolist()
            self.pending_lengths.reverse()
        return self.pending_lengths.pop()

    # ----------------------------------------------------------------- learner
    def try_train(self) -> None:
        """Start a step if the learner is free and a batch (after the lag filter) is ready."""
        if self.learner_busy:
            return
        self.drop_stale()
        version, p = self.budget.version, self.p
        if len(self.buffer) < p.train_batch_size:
            return
        batch = [self.buffer.popleft() for _ in range(p.train_batch_size)]
        tokens = sum(g[2] for g in batch)
        self.lags_by_step.append(Counter(version - g[1] for g in batch))
        self.c["trained_samples"] += len(batch) * p.n
        self.c["trained_tokens"] += tokens
        self.c["learner_wait_s"] += self.now - self.idle_since
        self.learner_busy = True
        train_s = (p.train_s_per_token * tokens + p.train_fixed_s) / p.learner_speed
        self.push(self.now + train_s, _TRAIN_DONE)

    def drop_stale(self) -> None:
        """The buffer's lag filter, on the groups not checked at this version (the newest
        ``unchecked``). Dropped groups are refunded so the servers can make up for them."""
        if not self.unchecked:
            return
        version = self.budget.version
        tail = [self.buffer.pop() for _ in range(self.unchecked)]
        keep = [g for g in reversed(tail) if version - g[1] <= self.lag]
        self.buffer.extend(keep)
        self.unchecked = 0
        dropped = len(tail) - len(keep)
        if dropped:
            self.charged -= dropped  # refunded: the learner never saw them
            self.c["drops"] += dropped
            self.deal(list(self.waiting))

    def on_train_done(self) -> None:
        self.steps_done += 1
        if self.steps_done % self.p.sync_every:
            self.end_step()
            return
        for s in self.servers:  # pause: progress stops, a pending prefill stall carries over
            self.advance(s)
            s.stall = max(0.0, s.t_last - self.now)
            s.paused = True
            s.token += 1
            s.count_wait(self.now, still_waiting=False)
        self.waiting.clear()
        self.push(self.now + self.p.sync_s, _SYNC_DONE)

    def on_sync_done(self) -> None:
        self.budget.consume(self.budget.consumed + self.per_version)  # a version's worth
        self.budget.advance(self.budget.version + 1)
        self.unchecked = len(self.buffer)  # a new version: every pooled group is rechecked
        for s in self.servers:
            s.paused = False
            s.version = self.budget.version
            s.t_last = self.now + s.stall
            self.schedule(s)
        self.deal(range(len(self.servers)))
        self.end_step()

    def end_step(self) -> None:
        self.learner_busy = False
        self.idle_since = self.now
        self.step_ends.append(self.now)
        self.snapshot()
        if self.steps_done < self.total_steps:
            self.try_train()

    def snapshot(self) -> None:
        """Cumulative counters at the end of each step, with every server brought to now."""
        for s in self.servers:
            self.advance(s)
            s.count_wait(self.now, still_waiting=True)
        wait = sum(s.wait_s for s in self.servers)
        self.snaps.append(
            {**self.c, "t": self.now, "rollout_wait_s": wait, "decoded": self.decoded}
        )


def simulate(
    params: SimParams, *, max_policy_lag: int, steps: int, seed: int, warmup: int | None = None
) -> SimResult:
    """Run ``warmup + steps`` learner steps; measure over the last ``steps``.

    ``warmup`` defaults to ``max_policy_lag + 2`` steps: the pipeline holds up to
    ``max_policy_lag + 1`` versions of groups, so it is full after that many.
    """
    if max_policy_lag < 0 or steps < 1:
        raise ValueError("max_policy_lag must be >= 0 and steps >= 1")
    warmup = max_policy_lag + 2 if warmup is None else warmup
    sim = _Sim(params, max_policy_lag, warmup + steps, seed)
    sim.run()
    return _measure(sim, warmup, steps, seed)


@functools.lru_cache(maxsize=64)
def _length_stats(lengths: ResponseLengths, prompt_length: int, seed: int) -> dict:
    return lengths.stats(prompt_length, seed=seed)


def _measure(sim: _Sim, warmup: int, steps: int, seed: int) -> SimResult:
    """The figures of the window between the ends of steps ``warmup`` and the last."""
    p = sim.p
    start = sim.snaps[warmup - 1] if warmup else {"t": 0.0}
    end = sim.snaps[-1]
    window = end["t"] - start["t"]

    def rate(key: str) -> float:
        return (end.get(key, 0.0) - start.get(key, 0.0)) / window

    drops = int(end.get("drops", 0) - start.get("drops", 0))
    lags: Counter[int] = Counter()
    for c in sim.lags_by_step[warmup:]:
        lags.update(c)
    stats = _length_stats(p.lengths, p.prompt_length, seed)
    gen_cap = generation_capacity(p, stats["mean_response"])
    train_cap = training_capacity(p, stats["mean_sample_tokens"])
    ideal = min(gen_cap, train_cap) * stats["mean_sample_tokens"]
    ends = [0.0, *sim.step_ends]
    return SimResult(
        max_policy_lag=sim.lag,
        steps=steps,
        window_s=window,
        samples_per_s=rate("trained_samples"),
        generated_tokens_per_s=rate("decoded"),
        trained_tokens_per_s=rate("trained_tokens"),
        learner_wait_frac=rate("learner_wait_s"),
        rollout_wait_frac=rate("rollout_wait_s") / p.num_servers,
        rollout_util=rate("decoded") * p.t_step(p.max_num_seqs) / (p.num_servers * p.max_num_seqs),
        mean_lag=sum(k * v for k, v in lags.items()) / max(1, sum(lags.values())),
        max_lag=max(lags, default=0),
        lag_hist=dict(sorted(lags.items())),
        drops_lag=drops,
        drop_frac=drops / (drops + steps * p.train_batch_size),
        max_budget_excess=sim.max_excess,
        gen_capacity_samples_per_s=gen_cap,
        train_capacity_samples_per_s=train_cap,
        ideal_tokens_per_s=ideal,
        ratio_to_ideal=rate("trained_tokens") / ideal,
        step_times=[b - a for a, b in pairwise(ends)],
    )


def compare_lags(
    params: SimParams, lags: list[int], *, steps: int, seed: int, warmup: int | None = None
) -> list[SimResult]:
    """One run per lag (lag 0, the synchronous baseline, always included and first), each
    with ``ratio_to_sync`` set from trained tokens/s on the same GPUs and seed."""
    order = [0, *sorted(set(lags) - {0})]
    results = [
        simulate(params, max_policy_lag=lag, steps=steps, seed=seed, warmup=warmup) for lag in order
    ]
    base = results[0].trained_tokens_per_s
    for r in results:
        r.ratio_to_sync = r.trained_tokens_per_s / base
        log.debug(
            "lag %d: %.0f trained tokens/s, %.2fx sync",
            r.max_policy_lag,
            r.trained_tokens_per_s,
            r.ratio_to_sync,
        )
    return results
