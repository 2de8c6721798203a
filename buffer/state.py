"""What :class:`buffer.core.ReplayBuffer` holds, as plain records: the incomplete groups,
the complete training groups it holds (in the pool or in unacknowledged batches), the pool
in completion order; and the names of the counters it keeps (the unacknowledged batches
themselves: :mod:`buffer.deliveries`). Which groups are released, dropped for lag or evicted
is decided in :mod:`buffer.core`, which are dropped as duplicates, late, overflowing or
expired in :mod:`buffer.assembly`; here a group only leaves the pool
(:meth:`State.leave_pool`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from asyncrl.wire import Group, Trajectory

COUNTERS = (
    "trajectories_in",
    "groups_in",
    "val_groups_in",
    "batches_out",
    "groups_out",
    "batches_redelivered",
    "batches_resent",  # released, never received (the reply came late): sent again
    "batches_returned",  # of a consumer that started without a checkpoint: groups to the pool
    "batches_acked",
    "hello_other_session",  # a restarted consumer's checkpoint predates this session
    "acks_other_session",  # acknowledgements of batches an earlier session numbered
    "groups_acked",
    "drops/duplicate",  # trajectories
    "drops/late",  # trajectories
    "drops/inconsistent",  # trajectories whose group_size disagrees with their group's
    "drops/overflow",  # trajectories of new groups refused: incomplete groups at capacity
    "drops/duplicate_groups",  # groups that came again after their first copy was forgotten
    "drops/lag",  # groups
    "drops/expired",  # groups
    "drops/rejected",  # groups a refused message named (oversize, invalid): reported
    "evicted",  # groups already trained on, removed to make room or because stale
)


@dataclass
class Partial:
    """An incomplete group: its members so far, by ``group_index`` (a dict, so that a
    group announced with a huge ``group_size`` costs what arrived, not what it claims)."""

    size: int
    first_seen: float
    members: dict[int, Trajectory] = field(default_factory=dict)

    def ordered(self) -> list[Trajectory]:
        return [self.members[i] for i in range(self.size)]


@dataclass
class Held:
    """A complete training group the buffer holds."""

    group: Group
    oldest_version: int
    uses: int = 0  # batches it was released in
    refs: int = 0  # unacknowledged batches holding it
    in_pool: bool = True


@dataclass
class State:
    """Every group the buffer holds or has seen, by task id."""

    partial: dict[str, Partial] = field(default_factory=dict)  # insertion = arrival order
    # task id -> complete | expired | duplicate (complete, and a second copy was reported)
    closed: dict[str, str] = field(default_factory=dict)
    held: dict[str, Held] = field(default_factory=dict)
    pool: dict[str, None] = field(default_factory=dict)  # ordered set: completion order
    pool_versions: Counter[int] = field(default_factory=Counter)  # oldest versions in pool

    def leave_pool(self, tid: str) -> None:
        """Out of the pool; forgotten too unless an unacknowledged batch holds it."""
        del self.pool[tid]
        h = self.held[tid]
        h.in_pool = False
        self.pool_versions[h.oldest_version] -= 1
        if not self.pool_versions[h.oldest_version]:
            del self.pool_versions[h.oldest_version]
        if h.refs == 0:
            del self.held[tid]
