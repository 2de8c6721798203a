"""Sync rounds: who joins which weight-sync group, under which generation. Pure: no I/O.

One round at a time (the learner runs them one after another):

- A *main* round pushes a new version to every live server that has engine ranks. Learner
  rank 0 is rank 0; each member occupies ``engine_world_size`` ranks after it, in
  registration order. The group *generation* (``main/<sync_id>``) is new only when the
  membership changed or the last main round failed for anyone (a failed collective leaves
  the group unusable); otherwise the learner and the servers keep their group.
- A *catch-up* round (``catchup/<server>/<sync_id>``) gives one server the current weights
  through a one-off group with the learner: a server that joined late or failed a sync.
  It joins the main group at the next main round. A member of the main group that gets
  one leaves that group for it (a server holds one group at a time): the next main round
  forms a new generation.

A member that reports failure, does not report, dies or leaves is dropped: the next main
round forms a new generation without it, and it needs a catch-up (its weights are older
than the current version). One lost before the round's group formed (:class:`RoundWatch`)
would hold the others in the meeting until ``sync.timeout_s``: the round is given up and a
main round begun again at once, at the same version, without it (:meth:`SyncBook.lose`).

Sync ids go on from a checkpoint's (:attr:`SyncBook.counter` is saved), so they increase
across restarts from that point; the ids a learner used after its last checkpoint are used
again by its restart. Its sync store (with the session's secret in every group's prefix) is
new, so no group name is used twice in one store, and each :class:`SyncStart` names the
coordinator's session, which its member's report names back: a report of the dead
learner's round, late, is not taken for the new round of that id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.control.messages import SyncDone, SyncStart
from asyncrl.sync.plan import WeightPlan


class RoundWatch:
    """Where the coordinator's thread, which may lose a member of a round
    (:meth:`SyncBook.lose`), and the learner's, which forms the round's group, settle
    which came first. Lost before the group formed, the round is given up (:meth:`ended`
    says why; the learner gives the meeting up for every member) and a main round has a
    :attr:`successor`; lost after, the member fails the round, and the learner gives up
    the broadcast it may be in (:meth:`lost_in_send`): a member that stopped reading holds
    the sender's collective until ``sync.timeout_s``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._formed = False
        self._why = ""
        self._lost = ""  # why a member was lost after the group formed
        self.successor: SyncRound | None = None  # the round begun again in this one's place

    def ended(self) -> str:
        """Why the round was given up before its group formed ("" while it was not)."""
        return self._why

    def form(self) -> bool:
        """The learner's group formed: True unless the round was given up first (from now
        on a loss only fails the round)."""
        with self._lock:
            self._formed = self._formed or not self._why
            return self._formed

    def lost_in_send(self) -> str:
        """Why a member still receiving was lost after the group formed ("" while none
        was): the learner's send gives up on it."""
        return self._lost

    def end(
        self, why: str, begin_again: Callable[[], SyncRound | None], receiving: bool = True
    ) -> SyncRound | None:
        """Give the round up unless its group formed (then, for a member still
        ``receiving``, ``why`` is :meth:`lost_in_send`'s answer); ``begin_again``'s round
        (None: none) is its successor, set before the learner can see :meth:`ended`."""
        with self._lock:
            if self._formed:
                if receiving:
                    self._lost = self._lost or why
                return None
            if self._why:
                return None
            self.successor = begin_again()
            self._why = why
            return self.successor

    def fail(self, why: str) -> SyncRound | None:
        """The learner's meeting failed on its own (its timeout, the store gone): the round
        ends here, unless a loss ended it first; that loss's :attr:`successor` (None: none).
        Settled under the lock, so a loss coming after only fails the round. Unsettled, a
        loss between the meeting's failure and the round's close began a successor nobody
        sent: the learner's close took that round for its own, and its members waited
        ``sync.timeout_s`` more in a meeting the learner never came to."""
        with self._lock:
            if not self._formed and not self._why:
                self._why = why
            return self.successor


@dataclass(frozen=True)
class SyncRound:
    """What the learner needs for one sync: form ``generation`` as rank 0 of
    ``world_size`` when ``new_group`` (else reuse its group), then send the weights.

    With no ``ranks`` (no server takes part) there is nothing to send.
    """

    sync_id: int
    version: int
    generation: str
    world_size: int
    ranks: dict[str, int]  # server id -> its first rank
    new_group: bool
    catchup: bool
    # Training groups the pushed weights were trained on (the ledger's count when the push
    # began): the admission window moves by this once the round ends (Versions.finish_sync).
    consumed: int = 0
    # Shared with the coordinator: a member lost before the group formed ends the round.
    watch: RoundWatch = field(default_factory=RoundWatch, compare=False, repr=False)

    @property
    def members(self) -> list[str]:
        return list(self.ranks)


@dataclass
class SyncResult:
    """How a round ended: who loaded ``version`` and who failed (with why)."""

    sync_id: int
    version: int
    generation: str
    ok: list[str]
    failed: dict[str, str]
    checksums: dict[str, str]
    seconds: dict[str, float]  # per member, as it reported
    probes: dict[str, list[float]] = field(default_factory=dict)  # per member that scored one


@dataclass
class _Active:
    round: SyncRound
    starts: dict[str, SyncStart]
    sizes: dict[str, int]  # member -> engine world size
    plan: WeightPlan
    reports: dict[str, SyncDone] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)


class SyncBook:
    """Generations, membership of the main group and the round in progress."""

    def __init__(self, *, backend: str = "gloo", timeout_s: float = 120.0):
        self.backend = backend
        self.timeout_s = timeout_s
        self.counter = 0  # last sync id handed out
        self.session = ""  # the coordinator's, in every SyncStart (see other_session)
        self.generation = ""  # current main generation
        self.main_members: tuple[tuple[str, int], ...] = ()
        self.broken = False  # the main group must be re-formed before it is used again
        self.active: _Active | None = None

    def begin(
        self,
        members: list[tuple[str, int]],
        version: int,
        plan: WeightPlan,
        *,
        catchup: bool = False,
        consumed: int = 0,
    ) -> SyncRound:
        """Start a round with ``members`` (server id, engine world size), in rank order; each
        member's :class:`SyncStart` carries ``plan``."""
        if self.active is not None:
            raise RuntimeError(f"sync {self.active.round.sync_id} is still in progress")
        self.counter += 1
        sid = self.counter
        key = tuple(members)
        if catchup:
            # Its worker leaves the main group to join this one: kept, the main group
            # would be reused by the next main round and fail for every member.
            self._leave_main(members[0][0])
            generation, new_group = f"catchup/{members[0][0]}/{sid}", True
        elif key == self.main_members and not self.broken and self.generation:
            generation, new_group = self.generation, False
        else:
            generation, new_group = f"main/{sid}", True
        ranks, next_rank = {}, 1
        for server_id, size in members:
            ranks[server_id] = next_rank
            next_rank += size
        rnd = SyncRound(sid, version, generation, next_rank, ranks, new_group, catchup, consumed)
        starts = {
            server_id: SyncStart(
                sync_id=sid,
                version=version,
                generation=generation,
                rank=rank,
                world_size=next_rank,
                plan=plan,
                backend=self.backend,
                timeout_s=self.timeout_s,
                catchup=catchup,
                session=self.session,
            )
            for server_id, rank in ranks.items()
        }
        self.active = _Active(rnd, starts, dict(members), plan)
        if not catchup:
            self.generation, self.main_members, self.broken = generation, key, False
        return rnd

    def start_for(self, server_id: str) -> SyncStart | None:
        """The sync ``server_id`` must join now, if any. None for a member lost from the
        round (:meth:`lose`): restarted, it registers under the same id and asks for the
        syncs it has not seen, and joining a group formed without it would keep it from the
        next round's meeting (that round then fails for everyone). It gets a catch-up or
        the next main round instead."""
        a = self.active
        if a is None or server_id in a.reports or server_id in a.lost:
            return None
        return a.starts.get(server_id)

    def other_session(self, msg: SyncDone) -> bool:
        """Whether ``msg`` reports on a round another coordinator session started (a
        learner restarted since: its ids count on from the checkpoint's, and may name a round
        of this session). A report naming no session (an older server) is taken as ours."""
        return bool(msg.session) and msg.session != self.session

    def report(self, msg: SyncDone) -> bool:
        """Record a member's outcome; False if it is not about the round in progress."""
        a = self.active
        if a is None or msg.sync_id != a.round.sync_id or msg.server_id not in a.starts:
            return False
        a.reports[msg.server_id] = msg
        return True

    def loaded(self, msg: SyncDone) -> bool:
        """Whether ``msg`` is a member's report of loading the round in progress, taken."""
        a = self.active
        return msg.ok and a is not None and a.reports.get(msg.server_id) is msg

    def waiting_for(self) -> list[str]:
        """Members of the round in progress that have not reported yet."""
        a = self.active
        if a is None:
            return []
        return [m for m in a.starts if m not in a.reports and m not in a.lost]

    def lose(self, server_id: str, why: str) -> SyncRound | None:
        """``server_id`` is gone (dead, left, re-registered): it fails the round in progress
        and the main group must be re-formed without it. Lost before the round's group
        formed, it would hold the others in the meeting until ``sync.timeout_s``: the round
        is given up and, a main round, begun again (new id and generation, same version)
        without it; that round is returned."""
        self._leave_main(server_id)
        a = self.active
        if a is None or server_id not in a.starts:
            return None
        a.lost.setdefault(server_id, why)
        # One that reported has no receive to hold the send up (before the group formed,
        # a member that failed at once and is gone still holds the meeting up).
        return a.round.watch.end(
            f"{server_id} was lost ({why})",
            lambda: self._again(a),
            receiving=server_id not in a.reports,
        )

    def _leave_main(self, server_id: str) -> None:
        """``server_id`` no longer holds the main group: the group is re-formed without it
        before it is used again (the others' groups still count it)."""
        if any(m == server_id for m, _ in self.main_members):
            self.main_members = tuple(m for m in self.main_members if m[0] != server_id)
            self.broken = True

    def _again(self, a: _Active) -> SyncRound | None:
        """Round ``a`` begun again without its lost members (a catch-up is not: it fails)."""
        if a.round.catchup:
            return None
        self.active = None
        members = [(m, size) for m, size in a.sizes.items() if m not in a.lost]
        return self.begin(members, a.round.version, a.plan, consumed=a.round.consumed)

    def finish(self, sent_ok: bool, send_error: str = "") -> SyncResult:
        """Close the round: members that reported ok loaded the version (a member reports
        ok only once every bucket arrived, so a send that failed after that, on another
        member, does not undo it); every other member failed and leaves the main group,
        which a failed send breaks for all."""
        a = self.active
        if a is None:
            raise RuntimeError("no sync in progress")
        self.active = None
        ok, failed = [], {}
        for member in a.starts:
            rep = a.reports.get(member)
            if member in a.lost:
                failed[member] = a.lost[member]
            elif rep is None and not sent_ok:
                failed[member] = f"the learner's send failed: {send_error}"
            elif rep is None:
                failed[member] = "no answer before the sync timed out"
            elif not rep.ok:
                failed[member] = rep.error or "failed"
            else:
                ok.append(member)
        if (failed or not sent_ok) and not a.round.catchup:
            self.main_members = tuple((m, a.sizes[m]) for m in ok)
            self.broken = True
        r = a.round
        return SyncResult(
            r.sync_id,
            r.version,
            r.generation,
            ok,
            failed,
            {m: rep.checksum for m, rep in a.reports.items()},
            {m: rep.seconds for m, rep in a.reports.items()},
            {m: list(rep.probe) for m, rep in a.reports.items() if rep.ok and rep.probe},
        )
