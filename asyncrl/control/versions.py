"""Policy versions and weight syncs: which servers get weights, when, and at which version.

:class:`Versions` holds these rules; :class:`~asyncrl.control.state.ControlState` owns one
and shares with it the server records, the ledger (whose budget carries the version) and
the counters. :mod:`asyncrl.control.syncs` keeps the rounds themselves (members, ranks,
generations, outcomes).

- A server with engine ranks *needs a catch-up* while the weights it holds are older than
  the current version: it gets no task until a catch-up or main sync brings it level.
  A catch-up blocks the learner until it ends (up to ``sync.timeout_s``), so after a failed
  one the server's next is held back: ``catchup_backoff_s``, doubling per consecutive
  failure up to ``catchup_backoff_max_s``. A successful sync clears the count.
- ``policy_version`` never goes backwards; a server registering with a version above the
  coordinator's (the learner restarted from an older checkpoint) raises it, so the next
  push is above anything a server holds. A server's *record* holds the version its last
  sync loaded, which a catch-up from such a learner brings below its registration's.
- After a learner restart, versions the replay reproduces are adopted, not pushed: the
  servers that hold them keep them (:mod:`asyncrl.control.recovery`).
"""

from __future__ import annotations

import logging
from collections import Counter

from asyncrl.control.ledger import DONE, TaskLedger
from asyncrl.control.messages import SyncDone
from asyncrl.control.recovery import Recovery
from asyncrl.control.registry import ServerRecord
from asyncrl.control.syncs import SyncBook, SyncResult, SyncRound
from asyncrl.sync.plan import WeightPlan

log = logging.getLogger(__name__)


class Versions:
    """The version, main syncs, catch-ups and their backoff, replayed versions.

    ``servers`` is the registry's own dict (the control state adds and removes records;
    this object reads them and marks what each holds); ``counts`` is the control state's.
    """

    def __init__(
        self,
        servers: dict[str, ServerRecord],
        ledger: TaskLedger,
        syncs: SyncBook,
        recovery: Recovery,
        counts: Counter[str],
        *,
        catchup_backoff_s: float,
        catchup_backoff_max_s: float,
    ) -> None:
        self.servers = servers
        self.ledger = ledger
        self.syncs = syncs
        self.recovery = recovery
        self.counts = counts
        self.catchup_backoff_s = catchup_backoff_s
        self.catchup_backoff_max_s = catchup_backoff_max_s

    @property
    def version(self) -> int:
        return self.ledger.budget.version

    def needs_catchup(self, rec: ServerRecord) -> bool:
        stale = rec.policy_version < self.version or not rec.trusted
        return rec.engine_world_size > 0 and stale

    def begin_sync(self, plan: WeightPlan, now: float = 0.0) -> SyncRound:
        """Start pushing version ``current + 1`` to every live server with engine ranks,
        but one that may still wait in a failed send's receive (``receiving_until``): its
        meeting would hold this round's until then. It catches up afterwards."""
        members = sorted(
            (
                r
                for r in self.servers.values()
                if r.engine_world_size > 0 and r.receiving_until <= now
            ),
            key=lambda r: r.order,
        )
        # What the pushed weights trained on is counted now: with sync.overlap_push the
        # next step trains (and reports its groups) before this round ends, and counting
        # those too opened the window a batch wider than max_policy_lag allows.
        rnd = self.syncs.begin(
            [(r.server_id, r.engine_world_size) for r in members],
            self.version + 1,
            plan,
            consumed=self.ledger.tally["train"][DONE],
        )
        for r in members:
            r.syncing = rnd.sync_id
        return rnd

    def pending_catchups(self, now: float) -> list[str]:
        """Servers waiting for a catch-up that can start one now (not busy in a sync, not
        backing off after a failed one)."""
        return [
            r.server_id
            for r in sorted(self.servers.values(), key=lambda r: r.order)
            if self.catchup_due(r.server_id, now)
        ]

    def catchup_due(self, server_id: str, now: float) -> bool:
        """Whether ``server_id`` is registered and can start a catch-up now (it needs one,
        is in no sync, and is not backing off after a failed one)."""
        r = self.servers.get(server_id)
        if r is None or not self.needs_catchup(r) or r.syncing:
            return False
        return now >= max(r.catchup_after, r.receiving_until)

    def begin_catchup(self, server_id: str, plan: WeightPlan) -> SyncRound:
        """A one-off group between the learner and ``server_id`` for the current weights."""
        rec = self.servers[server_id]
        rnd = self.syncs.begin(
            [(server_id, rec.engine_world_size)], self.version, plan, catchup=True
        )
        rec.syncing = rnd.sync_id
        return rnd

    def at_least(self, version: int) -> None:
        """Versions never go back: a learner that starts without a checkpoint numbers its
        pushes above ``version``, the highest the buffer that outlived its predecessor has
        seen (the version only, not the window)."""
        if version > self.version:
            self.ledger.budget.advance(version)
            log.info("version raised to %d: the buffer has seen it", version)

    def set_replay(self, through: int) -> None:
        """The restored learner will reach version ``through`` by replaying (recovery.py):
        servers registered up to it are trusted; one above holds weights no replay makes
        (the version moves past it, and it gets a catch-up)."""
        self.recovery.replay_through = through
        for rec in self.servers.values():
            rec.trusted = rec.policy_version <= through
            # Past the replay only, as register() says: one within it with partly loaded
            # weights (untrusted) moved the version too, with no training behind it.
            if rec.policy_version > max(self.version, through):
                self.ledger.budget.advance(rec.policy_version)
        log.info("resumed: the learner's replay reaches version %d", through)

    def end_replay(self) -> None:
        """The buffer restarted: the batches a replay under way was to get again went with
        it, so the learner trains fresh ones and reproduces no version past the current
        one. Servers holding such a version hold the lost branch's weights: untrusted, they
        get a catch-up, and versions move past theirs (:meth:`set_replay`)."""
        replay = self.recovery.replay_through
        if replay is not None and replay > self.version:
            log.warning(
                "the buffer restarted during the learner's replay (through version %d): the "
                "replay ends at version %d, later versions are pushed",
                replay,
                self.version,
            )
            self.set_replay(self.version)

    def adopt(self, version: int) -> bool:
        """The learner reached ``version`` by replaying: the servers that hold it keep it
        (no push); the version and the window move as a push would move them. False when
        ``version`` is not one a replay reproduces, or no registered server holds it (the
        learner pushes it)."""
        replay = self.recovery.replay_through
        if replay is None or not self.version < version <= replay:
            return False
        # The replay's count of redelivered batches may include one the previous life
        # never trained (it died training it, or it was released to a request nobody was
        # waiting on any more): a version no server holds was never pushed, so push it.
        if not any(r.trusted and r.policy_version >= version for r in self.servers.values()):
            self.counts["replay_not_held"] += 1
            return False
        self.ledger.budget.consume(self.ledger.tally["train"][DONE])
        self.ledger.budget.advance(version)
        self.counts["versions_replayed"] += 1
        return True

    def sync_done(self, msg: SyncDone, rec: ServerRecord | None) -> None:
        """A member's report on its part of a round (``rec``: its record, None if it is no
        longer registered)."""
        if self.syncs.other_session(msg):  # late, from before a learner restart
            self.counts["sync_reports_stale"] += 1
            return
        if rec is not None and rec.syncing and msg.sync_id >= rec.syncing:
            rec.syncing = 0
        if rec is not None:  # out of its receive, whichever round it reports on
            rec.receiving_until = 0.0
        if not self.syncs.report(msg):
            self.counts["sync_reports_stale"] += 1
            return
        if msg.ok and rec is not None:
            # Exactly the version it loaded: a catch-up after a learner restarted from an
            # older checkpoint brings a server's weights (and so its record) down.
            rec.policy_version = msg.version
            rec.trusted = True
            rec.catchup_failures, rec.catchup_after = 0, 0.0

    def weights_sent(self, rnd: SyncRound) -> None:
        """The learner's broadcast of ``rnd`` ended without error. A main round that is
        still the active one opens the admission window now (:meth:`Budget.sent`); a
        catch-up changes nothing."""
        active = self.syncs.active
        if active is None or active.round is not rnd or rnd.catchup:
            return
        self.ledger.budget.sent(active.round.version, active.round.consumed)

    def finish_sync(self, sent_ok: bool, send_error: str = "", *, now: float) -> SyncResult:
        """Close the round; a main round makes its version current (the learner's weights
        moved on whoever received them). A failed catch-up backs its server off (not one
        lost from it, whose record now is a restarted incarnation's)."""
        active = self.syncs.active
        catchup = active is not None and active.round.catchup
        consumed = active.round.consumed if active is not None else 0
        unreported = self.syncs.waiting_for()
        # A member lost from the round and registered again since is a new incarnation:
        # the round's failure is not its own, so it backs nothing off.
        lost = set(active.lost) if active is not None else set()
        result = self.syncs.finish(sent_ok, send_error)
        for server_id in unreported if not sent_ok else ():
            if (rec := self.servers.get(server_id)) is not None:
                rec.receiving_until = now + self.syncs.timeout_s
        for rec in self.servers.values():  # the round is over, reported or not: a member
            if rec.syncing == result.sync_id:  # whose report was lost may catch up now
                rec.syncing = 0
        if not catchup:
            # The window moves by what the pushed weights were trained on (a resume push
            # consumed nothing new: it stays put), even when a registration raised the
            # version past this round's meanwhile.
            self.ledger.budget.consume(consumed)
            if result.version > self.version:
                self.ledger.budget.advance(result.version)
        for server_id in result.failed if catchup else ():
            if server_id not in lost:
                self._back_off(server_id, now)
        self.counts["syncs_catchup" if catchup else "syncs"] += 1
        self.counts["sync_failures"] += len(result.failed)
        return result

    def _back_off(self, server_id: str, now: float) -> None:
        rec = self.servers.get(server_id)
        if rec is None:
            return
        rec.catchup_failures += 1
        delay = min(
            self.catchup_backoff_max_s,
            self.catchup_backoff_s * 2 ** (rec.catchup_failures - 1),
        )
        rec.catchup_after = now + delay
        self.counts["catchup_backoffs"] += 1
        log.warning(
            "catch-up to %s failed %d time(s) in a row: next try in %.0fs (check that server's "
            "log; it gets no task until it holds the current weights)",
            server_id,
            rec.catchup_failures,
            delay,
        )
