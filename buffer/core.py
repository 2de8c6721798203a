"""The replay buffer as a plain data structure: no sockets, no clocks (callers pass ``now``).

Life of a task id (docs/DESIGN.md section 4):

1. Its trajectories arrive one by one or together (:meth:`ReplayBuffer.add`); the group is
   *incomplete* until all ``group_size`` members are in. A second copy of a member, or any
   member after the group completed, is a duplicate: dropped and counted. Members of a group
   that expired are late: dropped and counted.
2. An incomplete group older than ``group_timeout_s`` *expires* (:meth:`expire`).
   Steps 1 and 2, trajectories into complete groups, are :mod:`buffer.assembly`'s.
3. A complete **validation** group is kept by round and id (its sums), never put into a
   training batch. A complete **training** group joins the *pool*.
4. :meth:`release` takes the learner's current version ``v`` (the highest any request
   reported: versions never go backwards), drops pooled groups whose lag, ``v`` minus the
   oldest version among their tokens, exceeds ``max_policy_lag`` (such a group could never be
   used), then returns a batch of ``batch_size`` groups: oldest first (by policy version, then
   arrival), each once (``fifo``),
   or sampled uniformly, each at most ``max_reuse`` times (``uniform``).
5. A released batch stays *unacknowledged* until :meth:`ack`. :meth:`restart` (a consumer
   restarted) queues the unacknowledged batches released to it for release again, in batch
   id order, before any new batch.

Capacity and eviction: ``capacity_groups`` bounds the complete training groups held (in the
pool or in unacknowledged batches), and separately the incomplete groups. When at capacity,
groups already trained on (``uniform`` replay) and not in an unacknowledged batch are
evicted, oldest first; fresh groups are never evicted: :meth:`has_room` turns False and the
service stops reading, so producers block (backpressure). Incomplete groups past their
bound never stop the reading (it would keep out the members that complete the open ones):
a new group then overflows, dropped and reported. Stale groups leave at the next request,
incomplete ones at their timeout, which the service counts in reading time (a member
waiting in the socket while the buffer is full does not age its group).

Groups dropped unused (lag, expiry, a duplicate of a forgotten group, overflow, a message
of theirs the service refused: ``oversize`` or ``invalid``) and
validation groups scored are logged for the coordinator, which reads the logs by cursor
(:mod:`buffer.reports`): a reply lost on the way is read again, never lost.

Batches carry the buffer's ``session`` (a new one per process), so a consumer's "I hold
everything up to batch ``k``" is never applied to another session's batch ``k``; a batch
released to a consumer that says it never received it (its reply came after the consumer
stopped waiting) is sent again before anything else.
Task ids stay known after their group left (to recognise duplicates and late members): a few
dozen bytes per task for the life of the process. The records behind all this (incomplete
groups, held groups, the pool, unacknowledged batches) live in :mod:`buffer.state`.
"""

from __future__ import annotations

import random
import secrets
from collections import Counter
from collections.abc import Iterable
from typing import Literal

import msgspec

from asyncrl.wire import Batch, DroppedTask, Group, Packed, Trajectory
from buffer.assembly import GroupAssembly, Outcome
from buffer.deliveries import Deliveries, Received
from buffer.release_order import oldest_first
from buffer.reports import Reports
from buffer.state import COUNTERS, Held, State


class ReplayBuffer:
    """Complete groups in, training batches out. Not thread-safe: one owner calls it."""

    def __init__(
        self,
        *,
        batch_size: int,
        capacity_groups: int,
        max_policy_lag: int,
        policy: Literal["fifo", "uniform"] = "fifo",
        max_reuse: int = 1,
        group_timeout_s: float = 600.0,
        seed: int = 0,
        session: str = "",
    ):
        if policy not in ("fifo", "uniform"):
            raise ValueError(f"policy must be fifo or uniform, not {policy!r}")
        if policy == "fifo" and max_reuse != 1:
            raise ValueError("fifo uses each group once: max_reuse must be 1")
        self.batch_size, self.capacity = batch_size, capacity_groups
        self.policy, self.max_reuse = policy, max_reuse
        self.max_policy_lag, self.group_timeout_s = max_policy_lag, group_timeout_s
        self._rng = random.Random(seed)
        self._s = State()
        self._next_batch_id = 0
        self._learner_version: int | None = None
        # Names this buffer's contents and batch ids: a new session means it restarted.
        self.session = session or secrets.token_hex(4)
        self.deliveries = Deliveries(self.session)  # released, unacknowledged batches
        self.reports = Reports()  # drops and validation, for the coordinator and learner
        self._lag_hist: Counter[int] = Counter()
        self._size_max = 0
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        # Trajectories into complete groups, over the same records, counters and reports.
        self._assembly = GroupAssembly(
            self._s,
            self.counts,
            self.reports,
            capacity=capacity_groups,
            group_timeout_s=group_timeout_s,
            complete=self._complete,
        )

    # ------------------------------------------------------------------ in
    def add(self, traj: Trajectory, now: float) -> Outcome:
        """Take one trajectory that arrived at ``now``; say what became of it
        (:meth:`buffer.assembly.GroupAssembly.add`)."""
        return self._assembly.add(traj, now)

    def add_packed(self, packed: Packed, now: float) -> list[Outcome]:
        """Take the trajectories of one message; what became of each, in order
        (:meth:`buffer.assembly.GroupAssembly.add_packed`)."""
        return self._assembly.add_packed(packed, now)

    def expire(self, now: float) -> list[str]:
        """Drop incomplete groups first seen more than ``group_timeout_s`` before ``now``."""
        return self._assembly.expire(now)

    def reject(self, task_id: str, cause: str, validation: bool = False) -> bool:
        """A refused message named ``task_id``: drop and report its group
        (:meth:`buffer.assembly.GroupAssembly.reject`); True when reported."""
        return self._assembly.reject(task_id, cause, validation)

    def _complete(self, group: Group) -> None:
        """A group the assembly completed: validation to its stats, training to the pool."""
        if group.validation:
            self.reports.scored(group)
            self.counts["val_groups_in"] += 1
            return
        s = self._s
        oldest = group.oldest_version
        s.held[group.task_id] = Held(group, oldest)
        s.pool[group.task_id] = None
        s.pool_versions[oldest] += 1
        self.counts["groups_in"] += 1
        self._size_max = max(self._size_max, len(s.held))
        self._evict_used()

    # ------------------------------------------------------------------ out
    def release(
        self,
        policy_version: int,
        consumer: str = "",
        received: Received | None = None,
    ) -> Batch | None:
        """The next batch for ``consumer``, a learner at ``policy_version``, or None if too
        few groups.

        ``received`` is the last batch the consumer received, as ``(session, batch id)``
        (``None`` id: none yet; ``received`` None: the consumer does not say). A batch
        released to it after that one and never received (the reply came after it stopped
        waiting) is sent again first, unchanged: a late reply loses nothing. Then a batch
        queued by :meth:`restart`, unchanged but marked redelivered. A new batch's
        ``policy_version`` is the version its lag is measured against.
        """
        s = self._s
        if self._learner_version is None or policy_version > self._learner_version:
            self._learner_version = policy_version
        version = self._learner_version
        self._drop_stale(version)
        again = self.deliveries.resend(consumer, received)
        if again is not None:
            self.counts["batches_resent"] += 1
            return self._metrics_now(again)
        again = self.deliveries.redelivery(consumer)
        if again is not None:
            self.counts["batches_redelivered"] += 1
            return self._metrics_now(again)
        if len(s.pool) < self.batch_size:
            return None
        if self.policy == "fifo":
            # Oldest policy version first, then arrival: a group that finished late (a long
            # generation, a slow server) is trained before it goes stale instead of being
            # overtaken by fresher ones and dropped for lag.
            picked = oldest_first(s, self.batch_size)
        else:
            picked = self._rng.sample(list(s.pool), self.batch_size)
        groups, lags = [], Counter()
        for tid in picked:
            h = s.held[tid]
            h.uses += 1
            h.refs += 1
            if h.uses >= self.max_reuse:
                s.leave_pool(tid)
            groups.append(h.group)
            lags[version - h.oldest_version] += 1
        self._lag_hist.update(lags)
        batch = Batch(
            session=self.session,
            batch_id=self._next_batch_id,
            policy_version=version,
            groups=groups,
            lag_histogram=dict(sorted(lags.items())),
            metrics=self.metrics(),
        )
        self._next_batch_id += 1
        self.deliveries.record(batch, consumer)
        self.counts["batches_out"] += 1
        self.counts["groups_out"] += len(groups)
        self._evict_used()
        return batch

    def ack(
        self, batch_ids: Iterable[int], session: str | None = None
    ) -> tuple[list[int], list[int]]:
        """Forget acknowledged batches, numbered by ``session`` (None: this one); returns
        (acknowledged, unknown) ids. Another session's are all unknown: its ids name other
        batches here."""
        if session is not None and session != self.session:
            self.counts["acks_other_session"] += 1
            return [], list(batch_ids)
        s = self._s
        batches, unknown = self.deliveries.ack(batch_ids)
        for batch in batches:
            for g in batch.groups:
                h = s.held[g.task_id]
                h.refs -= 1
                if h.refs == 0 and not h.in_pool:
                    del s.held[g.task_id]
            self.counts["groups_acked"] += len(batch.groups)
        self.counts["batches_acked"] += len(batches)
        self._evict_used()
        return [b.batch_id for b in batches], unknown

    def restart(
        self,
        acked_through: int | None = None,
        consumer: str | None = None,
        session: str = "",
        resumed: bool = True,
    ) -> tuple[int, int]:
        """A consumer (re)started holding batches up to ``acked_through`` of ``session``:
        acknowledge those, queue its other unacknowledged ones for release again, in order
        (:class:`~buffer.deliveries.Deliveries`; ``consumer`` None: every consumer's).
        Returns (batches queued again, batches acknowledged).

        A consumer that did not resume from a checkpoint (``resumed`` False) replays
        nothing: its unacknowledged batches' groups go back to the pool, to be released
        afresh under the lag filter (a stale one is dropped and reported, not trained by
        weights that never saw the versions it was measured against)."""
        if not resumed:
            self._take_back(self.deliveries.forget(consumer))
            return 0, 0
        if acked_through is not None and session != self.session:
            self.counts["hello_other_session"] += 1  # its ids name other batches here
        held, queued = self.deliveries.restart(acked_through, consumer, session)
        acked, _ = self.ack(held)
        return len(queued), len(acked)

    def _take_back(self, batches: list[Batch]) -> None:
        """The groups of batches nobody will train: back to the pool, as if never used."""
        s = self._s
        for batch in batches:
            for g in batch.groups:
                h = s.held[g.task_id]
                h.refs -= 1
                h.uses -= 1
                if not h.in_pool:
                    h.in_pool = True
                    s.pool[g.task_id] = None
                    s.pool_versions[h.oldest_version] += 1
            self.counts["batches_returned"] += 1

    # ------------------------------------------------------------------ housekeeping
    def has_room(self) -> bool:
        """False when complete groups fill the capacity: the caller should stop reading new
        trajectories. Incomplete groups have their own bound (a new group past it is an
        ``overflow`` drop, :mod:`buffer.assembly`): stopping the reading for them would
        also keep out the members that complete them."""
        return len(self._s.held) < self.capacity

    def _drop(self, d: DroppedTask) -> None:
        self.reports.drop(d)

    def reports_since(
        self, drops_from: int, validated_from: int
    ) -> tuple[list[DroppedTask], list[str]]:
        """Drops and scored validation ids since these positions of the two logs
        (:class:`~buffer.reports.Reports`)."""
        return self.reports.since(drops_from, validated_from)

    def take_dropped(self) -> list[DroppedTask]:
        """Tasks dropped unused since the last call (an in-process reader)."""
        return self.reports.take_dropped()

    def unknown(self, task_ids: list[str]) -> list[str]:
        """Those of ``task_ids`` this buffer never received a member of (ids stay known
        for the life of the process)."""
        s = self._s
        return [t for t in task_ids if t not in s.closed and t not in s.partial]

    def inventory(self) -> tuple[list[str], list[DroppedTask], list[str]]:
        """Task ids held (complete or not), every drop, every validation id scored."""
        held = [*self._s.held, *self._s.partial]
        return held, list(self.reports.drops), list(self.reports.validated)

    def can_release(self) -> bool:
        """Whether :meth:`release` could return a batch (before the lag filter)."""
        return bool(self.deliveries.redeliver) or len(self._s.pool) >= self.batch_size

    @property
    def ready(self) -> int:
        """Training groups waiting in the pool."""
        return len(self._s.pool)

    @property
    def learner_version(self) -> int:
        """The highest version a batch request reported (the lag reference), 0 before any."""
        return self._learner_version or 0

    @property
    def next_batch_id(self) -> int:
        return self._next_batch_id

    def metrics(self) -> dict[str, float]:
        """Sizes, counters, lag of released groups (``buffer/lag_hist/<lag>``)."""
        s = self._s
        out = {f"buffer/{k}": float(v) for k, v in self.counts.items()}
        out |= {
            "buffer/size": len(s.held),
            "buffer/size_max": self._size_max,
            "buffer/capacity": self.capacity,
            "buffer/ready": len(s.pool),
            "buffer/incomplete": len(s.partial),
            "buffer/unacked_batches": len(self.deliveries.unacked),
            "buffer/redeliver_pending": len(self.deliveries.redeliver),
        }
        if self._learner_version is not None:
            out["buffer/learner_version"] = self._learner_version
        if self._lag_hist:
            n = sum(self._lag_hist.values())
            out["buffer/lag_max"] = max(self._lag_hist)
            out["buffer/lag_mean"] = sum(k * v for k, v in self._lag_hist.items()) / n
            out |= {f"buffer/lag_hist/{k}": v for k, v in sorted(self._lag_hist.items())}
        return {k: float(v) for k, v in out.items()}

    def _metrics_now(self, batch: Batch) -> Batch:
        """``batch`` (its groups unchanged) with the buffer's metrics as they are now: the
        step that trains it records them, and those of its first release said nothing of
        the replay under way (``buffer/redeliver_pending`` read 0 on every step)."""
        return msgspec.structs.replace(batch, metrics=self.metrics())

    def _drop_stale(self, version: int) -> None:
        s = self._s
        limit = version - self.max_policy_lag  # stale: oldest version below this
        if not s.pool_versions or min(s.pool_versions) >= limit:
            return  # the common case, without a scan of the pool
        stale = [t for t in s.pool if s.held[t].oldest_version < limit]
        for tid in stale:
            h = s.held[tid]
            if h.uses == 0:
                self.counts["drops/lag"] += 1
                self._drop(DroppedTask(tid, "lag", False))
            else:
                self.counts["evicted"] += 1  # trained on already: not a loss
            s.leave_pool(tid)

    def _evict_used(self) -> None:
        """At capacity, make room by evicting groups already trained on, oldest first.

        Only groups no unacknowledged batch holds: evicting the others would free nothing.
        """
        s = self._s
        # With max_reuse 1 (always under fifo) a released group leaves the pool at once, so
        # the pool holds no used group: no scan of a full pool on every arrival.
        if len(s.held) < self.capacity or self.max_reuse <= 1:
            return
        for tid in list(s.pool):  # a copy: leave_pool changes the pool
            h = s.held[tid]
            if h.uses > 0 and h.refs == 0:
                self.counts["evicted"] += 1
                s.leave_pool(tid)
                if len(s.held) < self.capacity:
                    return
