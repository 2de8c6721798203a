"""How trajectories become groups, for :class:`buffer.core.ReplayBuffer` (steps 1 and 2 of a
task id's life there). No sockets, no clocks (callers pass ``now``).

Members arrive one by one or a whole group in one message; a group is *incomplete* until
all ``group_size`` members are in, then handed to the buffer (``complete``: to validation
stats or the pool). What never joins a group is dropped and counted here: a second copy of
a member, or any member after its group completed (``duplicate``); a member of a group
that expired (``late``); a member whose ``group_size`` disagrees with its group's
(``inconsistent``); the first member of a new group while ``capacity_groups`` incomplete
groups are open (``overflow``, reported as a drop). An incomplete group older than
``group_timeout_s`` expires (reported). The group of a message the service refused
(:meth:`GroupAssembly.reject`) is dropped and reported with the refusal's cause.

It works on the buffer's own records (:class:`~buffer.state.State`: the incomplete groups
and the ids closed, and the held groups, which it only reads), counters and reports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Literal

from asyncrl.wire import DroppedTask, Group, Packed, Trajectory
from buffer.reports import Reports
from buffer.state import Partial, State

Outcome = Literal["added", "completed", "duplicate", "late", "inconsistent", "overflow"]


class GroupAssembly:
    """Puts trajectories together into complete groups; hands each to ``complete``.

    ``state``, ``counts`` and ``reports`` are the buffer's own (shared, not copied).
    """

    def __init__(
        self,
        state: State,
        counts: Counter[str],
        reports: Reports,
        *,
        capacity: int,
        group_timeout_s: float,
        complete: Callable[[Group], None],
    ):
        self.state, self.counts, self.reports = state, counts, reports
        self.capacity, self.group_timeout_s = capacity, group_timeout_s
        self.complete = complete

    def add(self, traj: Trajectory, now: float) -> Outcome:
        """Take one trajectory that arrived at ``now``; say what became of it.

        Trajectories come validated by :mod:`asyncrl.wire` (``group_index < group_size``).
        A new group is refused (``overflow``, reported as a drop) while ``capacity_groups``
        incomplete groups are open, even inside one message.
        """
        s, tid = self.state, traj.task_id
        closed = s.closed.get(tid)
        if closed is not None:
            return self._closed(traj, closed)
        part = s.partial.get(tid)
        if part is None:
            if len(s.partial) >= self.capacity:
                self.counts["drops/overflow"] += 1
                s.closed[tid] = "expired"  # its other members are late
                self.reports.drop(DroppedTask(tid, "overflow", traj.validation))
                return "overflow"
            part = s.partial[tid] = Partial(traj.group_size, now)
        elif part.size != traj.group_size:
            self.counts["drops/inconsistent"] += 1
            return "inconsistent"
        if traj.group_index in part.members:
            self.counts["drops/duplicate"] += 1
            return "duplicate"
        # A copy: kept as a view, the member would hold its whole message in memory (the
        # other groups in it, its dropped copies) until the group completes or expires.
        part.members[traj.group_index] = traj.detached()
        self.counts["trajectories_in"] += 1
        if len(part.members) < part.size:
            return "added"
        del s.partial[tid]
        s.closed[tid] = "complete"
        self.complete(Group.from_trajectories(tid, part.ordered()))
        return "completed"

    def _closed(self, traj: Trajectory, closed: str) -> Outcome:
        """A member of a group already complete (a duplicate) or expired (late).

        A training group that comes again after the buffer used and forgot its first copy
        is reported as dropped (``duplicate``), once: the coordinator may have charged it
        to the budget (a task re-dealt by a coordinator that did not know the first copy),
        and only a report returns it. While the first copy is held, its charge stands.
        """
        s, tid = self.state, traj.task_id
        kind = "late" if closed == "expired" else "duplicate"
        self.counts[f"drops/{kind}"] += 1
        if closed == "complete" and tid not in s.held and not traj.validation:
            s.closed[tid] = "duplicate"
            self.counts["drops/duplicate_groups"] += 1
            self.reports.drop(DroppedTask(tid, "duplicate", False))
        return kind  # type: ignore[return-value]

    def add_packed(self, packed: Packed, now: float) -> list[Outcome]:
        """Take the trajectories of one message; what became of each, in order.

        A message that is exactly one new group, in ``group_index`` order (what rollout
        servers send), becomes a group without being split: no copy, no per-trajectory work.
        """
        metas = packed.metas
        tid, n = metas[0].task_id, metas[0].group_size
        s = self.state
        whole = (
            len(metas) == n
            and tid not in s.closed
            and tid not in s.partial
            and all(
                m.task_id == tid and m.group_index == i and m.group_size == n
                for i, m in enumerate(metas)
            )
        )
        if not whole:
            return [self.add(t, now) for t in packed.trajectories]
        s.closed[tid] = "complete"
        self.counts["trajectories_in"] += n
        self.complete(
            Group(
                task_id=tid,
                metas=metas,
                prompt_ids=packed.prompt_ids,
                response_ids=packed.response_ids,
                logprobs=packed.logprobs,
            )
        )
        return ["completed"] * n

    def reject(self, tid: str, cause: str, validation: bool) -> bool:
        """A message naming task ``tid`` was refused (``cause``: ``oversize``, ``invalid``):
        its group can never complete, so it is dropped now and reported, once, rather than
        kept by the coordinator as "in buffer" until an audit deals it again (a group refused
        every time would loop forever). An incomplete group goes with what it had; its later
        members are late. A group already complete, expired or reported is left alone (a
        refused duplicate of it changes nothing). True when reported."""
        s = self.state
        if tid in s.closed:
            return False
        s.partial.pop(tid, None)
        s.closed[tid] = "expired"  # closed unused: its other members are late
        self.counts["drops/rejected"] += 1
        self.reports.drop(DroppedTask(tid, cause, validation))
        return True

    def expire(self, now: float) -> list[str]:
        """Drop incomplete groups first seen more than ``group_timeout_s`` before ``now``."""
        s, out = self.state, []
        for tid, part in s.partial.items():
            if now - part.first_seen <= self.group_timeout_s:
                break  # arrival order: the rest are younger
            out.append(tid)
        for tid in out:
            part = s.partial.pop(tid)
            s.closed[tid] = "expired"
            member = next(iter(part.members.values()))
            self.reports.drop(DroppedTask(tid, "expired", member.validation))
        self.counts["drops/expired"] += len(out)
        return out
