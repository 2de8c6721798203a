"""The invariants of the fault simulation (docs/DESIGN.md section 11), checked as the run goes.

After every event:

- ``accounting``: the ledger's identity per kind (``unaccounted == 0``);
- ``tally``: the ledger's tally equals its entries counted by state (an entry overwritten by
  a second deal leaves the tally off while the identity still holds);
- ``id_reuse``: a task id dealt as new work by a coordinator whose id family differs from
  the one that first dealt it (a fresh coordinator starts a family, a restored one keeps its
  checkpoint's: within a family the same id names the same prompt, a deliberate re-deal), an
  external slot id dealt twice, or a deal over an entry that was not waiting to be re-dealt;
- ``batch_confusion``: the buffer forgot a batch (an ack, or a hello's ``acked_through``)
  holding groups that the acknowledging learner line never trained;
- ``trained_twice``: a line of learner state trained a group it already contains (a replay
  after a restore is not twice: the restored weights never saw it);
- ``lag``: a trained group older than ``max_policy_lag`` versions at the learner;
- ``adopt_unheld``: a replayed version made current without a push while no live server
  holds it (or a newer one), nor one that died too recently for anyone to know
  (``control.dead_after_s``).

At the end of a schedule (faults stopped, the run drained and then quiet):

- ``liveness``: the learner reached its last step within the drain's bound;
- ``budget_leak``: a training task charged to the admission budget that is not where the
  ledger says (outstanding at no live server that holds it, or in a buffer that does not);
- ``lost``: a batch released to the learner that it never received and will never get again
  (its groups stay charged), or a validation group scored by the buffer and never reported.
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from asyncrl.control.task_states import BUF, OUT, QUEUED, is_external, kind_of

if TYPE_CHECKING:
    from benchmarks.fault_learner import LearnerProc
    from benchmarks.fault_world import World

log = logging.getLogger(__name__)

INVARIANTS = (
    "accounting",
    "tally",
    "id_reuse",
    "batch_confusion",
    "trained_twice",
    "lag",
    "adopt_unheld",
    "liveness",
    "budget_leak",
    "lost",
)


@dataclass
class Line:
    """What one line of learner state has trained: a restored learner continues its
    checkpoint's line; a fresh one starts a new, empty line."""

    trained: set[str] = field(default_factory=set)
    batches: set[tuple[str, int]] = field(default_factory=set)
    weights: str = "init"  # names the weights: a digest of every batch trained, in order

    def copy(self) -> Line:
        return Line(set(self.trained), set(self.batches), self.weights)

    def add(self, session: str, batch_id: int, task_ids: list[str]) -> None:
        self.trained.update(task_ids)
        self.batches.add((session, batch_id))
        digest = zlib.crc32(f"{self.weights}|{','.join(task_ids)}".encode())
        self.weights = f"{digest:08x}"


class Violation(NamedTuple):
    invariant: str
    event: int  # schedule position (-1: the drain or the end)
    detail: str


class Checker:
    """Collects violations (the first few of each invariant) for one schedule."""

    def __init__(self, max_policy_lag: int, limit: int = 3):
        self.max_policy_lag = max_policy_lag
        self.limit = limit
        self.event = -1
        self.violations: list[Violation] = []
        self.seen: Counter[str] = Counter()
        self.families = 0
        self.first_dealer: dict[str, int] = {}  # task id -> family that first dealt it
        self._externals: set[str] = set()  # external slot ids dealt so far

    def violate(self, invariant: str, detail: str) -> None:
        self.seen[invariant] += 1
        if self.seen[invariant] <= self.limit:
            self.violations.append(Violation(invariant, self.event, detail))
            log.debug("violation %s at event %d: %s", invariant, self.event, detail)

    def new_family(self) -> int:
        self.families += 1
        return self.families

    # ------------------------------------------------------------------ as it happens
    def dealt(self, family: int, task_ids: list[str], before: dict[str, str]) -> None:
        for tid in task_ids:
            prev = before.get(tid)
            if prev is not None and prev != QUEUED:
                self.violate("id_reuse", f"{tid} dealt again while {prev} (entry overwritten)")
                continue
            first = self.first_dealer.setdefault(tid, family)
            if prev is None and first != family:
                self.violate("id_reuse", f"{tid} first dealt by family {first}, now {family}")
            elif prev is None and is_external(tid) and tid in self._externals:
                self.violate("id_reuse", f"external slot {tid} dealt twice")
            if is_external(tid):
                self._externals.add(tid)

    def trained(self, learner: LearnerProc, batch: Any) -> None:
        for g in batch.groups:
            if g.task_id in learner.line.trained:
                self.violate("trained_twice", f"{g.task_id} again (batch {batch.batch_id})")
            # A replayed batch trains the weights its first training did, whatever number
            # the versions carry now (a push the dying learner left half done moves them):
            # its lag is the one it was released with.
            replay = batch.redelivered and learner.restored is not None
            ref = batch.policy_version if replay else learner.version
            lag = ref - g.oldest_version
            if lag > self.max_policy_lag:
                self.violate("lag", f"{g.task_id} trained at lag {lag} (batch {batch.batch_id})")

    def forgotten(self, session: str, batch: Any, line: Line, held: set[str]) -> None:
        missing = [g.task_id for g in batch.groups if g.task_id not in line.trained | held]
        if missing:
            self.violate(
                "batch_confusion",
                f"buffer {session} forgot batch {batch.batch_id} with {missing} untrained",
            )

    def adopted(self, world: World, version: int) -> None:
        # A server that died less than dead_after_s ago still counts: nobody can know yet.
        recent = world.now - world.cfg.dead_after_s
        held = [s.version for s in world.servers.values() if s.alive]
        held += [v for s in world.servers.values() for at, v in [s.died] if at >= recent]
        if not any(v >= version for v in held):
            self.violate("adopt_unheld", f"version {version} adopted; servers hold {held}")

    def after_event(self, world: World) -> None:
        st = world.learner.state
        if st is None or not world.dirty:
            return
        world.dirty = False
        ledger = st.ledger
        acct = ledger.accounting()
        for kind in ("train", "val"):
            if acct[f"accounting/{kind}/unaccounted"]:
                self.violate("accounting", f"{kind}: {acct}")
        counted: dict[str, Counter[str]] = {"train": Counter(), "val": Counter()}
        for tid, e in ledger.entries.items():
            counted[kind_of(tid)][e.state] += 1
        for kind, c in counted.items():
            tally = +ledger.tally[kind]
            if c != tally:
                self.violate("tally", f"{kind}: tally {dict(tally)} != entries {dict(c)}")

    # ------------------------------------------------------------------ at the end
    def final(self, world: World, finished: bool) -> None:
        if not finished:
            lp = world.learner
            self.violate("liveness", f"learner at step {lp.step}, phase {lp.phase}")
        st = world.learner.state
        if st is None:
            return
        self._charged(world)
        self._stranded(world)

    def _charged(self, world: World) -> None:
        from benchmarks import fault_api as api

        st = world.learner.state
        assert st is not None
        held = api.held_ids(world.buffer.buf)
        validated = set(world.buffer.buf.inventory()[2])
        leaks, lost = [], []
        for tid, e in st.ledger.entries.items():
            if e.state == OUT:
                srv = world.servers.get(e.server)
                if srv is None or not srv.alive or tid not in srv.held:
                    leaks.append(f"{tid} out at {e.server or '?'}")
            elif e.state == BUF and tid not in held:
                if kind_of(tid) == "train":
                    leaks.append(f"{tid} in_buffer")
                elif tid in validated:
                    lost.append(f"{tid} scored, never reported")
        if leaks:
            self.violate("budget_leak", f"{len(leaks)} charged, not there: {leaks[:4]}")
        if lost:
            self.violate("lost", f"{len(lost)}: {lost[:4]}")

    def _stranded(self, world: World) -> None:
        """Batches released to the learner and passed over: it trained later batches of
        that buffer session, and this one it never got (nor will: it is not queued to come
        again). One released after the last step is not passed over: the run was done."""
        from benchmarks import fault_api as api

        buf, line = world.buffer.buf, world.learner.line
        session = world.buffer.session
        queued = api.redelivery_queue(buf)
        for bid, batch in api.unacked(buf).items():
            if bid in queued or api.owner(buf, bid) != "learner":
                continue
            if not any(s == session and b > bid for s, b in line.batches):
                continue
            untrained = [g.task_id for g in batch.groups if g.task_id not in line.trained]
            if untrained:
                self.violate("lost", f"batch {bid} released, never trained: {untrained}")
