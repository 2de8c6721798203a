"""The learner's side of a weight push, driven by the coordinator.

:class:`WeightPusher` runs a sync round the coordinator planned: it forms (or reuses) the
group of the round's generation as rank 0 and broadcasts the tensors; the coordinator then
collects every member's report. Catch-up rounds (a server that joined late or failed a
sync) get a one-off group; the learner keeps its main group, which the coordinator has
re-formed at the next main round if the server was in it (it left that group for the
catch-up's). An error of the learner's own in a round (tensors off the plan, out of
memory) closes the round as failed, then is raised. Used by the learner and by the
stand-in learner of the tests, so both run the same protocol.

The pusher owns the :class:`~asyncrl.sync.plan.WeightPlan`: it builds it from the first
tensors it pushes (their names, shapes and dtypes never change within a run) and hands the
same plan to every round, so its callers only pass tensors.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncrl.control.messages import check_sync_start
from asyncrl.sync.groups import (
    WeightSyncError,
    form_group,
    give_up_send,
    release_group,
    store_prefix,
)
from asyncrl.sync.plan import WeightPlan, plan_buckets, specs_of
from asyncrl.sync.weights import BroadcastAbandoned, send_weights

if TYPE_CHECKING:
    from asyncrl.control.coordinator import Coordinator
    from asyncrl.control.syncs import SyncResult, SyncRound

log = logging.getLogger(__name__)


def pack_device(backend: str) -> str:
    """Where a push packs its flat buffers: NCCL broadcasts only CUDA tensors (the current
    CUDA device, which the learner sets to its own), gloo only CPU ones."""
    return "cuda" if backend == "nccl" else "cpu"


class WeightPusher:
    """Rank 0 of every sync group: forms groups, broadcasts, closes rounds."""

    def __init__(
        self,
        coordinator: Coordinator,
        store: Any,
        *,
        backend: str,
        timeout_s: float,
        bucket_bytes: int,
        device: str | None = None,
        deal_at_send: bool = False,
        max_message_bytes: int = 0,
    ):
        """``max_message_bytes``: the coordinator's ``control.max_message_mb`` in bytes (0:
        its default), the bound the announcement of a sync must fit."""
        self.coordinator = coordinator
        self.max_message_bytes = max_message_bytes
        # staleness.deal_at_send: the admission window moves when the broadcast ends
        self.deal_at_send = deal_at_send
        self.store = store
        self.backend = backend
        self.device = device or pack_device(backend)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.plan: WeightPlan | None = None  # built from the first tensors pushed
        self._group = None
        self._generation = ""

    def plan_for(self, tensors: dict[str, Any]) -> WeightPlan:
        """The plan of these tensors: built the first time, the same one afterwards."""
        if self.plan is None:
            plan = plan_buckets(specs_of(tensors), self.bucket_bytes)
            check_sync_start(plan, self.max_message_bytes)  # a server could not read it
            self.plan = plan
        return self.plan

    def push(self, tensors: dict[str, Any]) -> SyncResult:
        """A new version to every member; failures drop members, never raise."""
        return self.complete(self.begin(tensors), tensors)

    def begin(self, tensors: dict[str, Any]) -> SyncRound:
        """Announce the next version of ``tensors`` (the coordinator numbers it and tells
        the members); :meth:`complete` sends it."""
        return self.coordinator.begin_sync(self.plan_for(tensors))

    def complete(
        self, rnd: SyncRound, tensors: dict[str, Any], on_sent: Callable[[], None] | None = None
    ) -> SyncResult:
        """Broadcast round ``rnd`` and wait for its members' reports (bounded by the
        timeout); ``on_sent`` is called once the broadcast ended (sent or failed), before
        the reports. It may run on another thread than :meth:`begin`, one round at a time."""
        return self._run(rnd, tensors, self.plan_for(tensors), on_sent)

    def serve_catchups(
        self, tensors: dict[str, Any], at_most: int | None = None
    ) -> list[SyncResult]:
        """The current weights to every server waiting for a catch-up (``at_most``: to
        that many), one at a time (a server that leaves while the one before it is served
        is skipped)."""
        plan = self.plan_for(tensors)
        results = []
        for server_id in self.coordinator.pending_catchups()[:at_most]:
            rnd = self.coordinator.begin_catchup(server_id, plan)
            if rnd is not None:
                results.append(self._run(rnd, tensors, plan))
        return results

    def _run(
        self,
        rnd: SyncRound,
        tensors: dict[str, Any],
        plan: WeightPlan,
        on_sent: Callable[[], None] | None = None,
    ) -> SyncResult:
        error, group, fault, busy_s = "", None, None, 0.0
        while rnd.ranks:
            try:
                group = self._group_for(rnd)
                if group is None:  # a member was lost before the group formed
                    rnd = self._successor(rnd)
                    continue
                send_weights(
                    group,
                    tensors,
                    plan,
                    timeout_s=self.timeout_s,
                    device=self.device,
                    abandon=rnd.watch.lost_in_send,
                )
            except WeightSyncError as e:
                error = str(e)
                if isinstance(e, BroadcastAbandoned):  # its collective runs to its timeout
                    busy_s = self.timeout_s
                # Every member still waiting (in its connect or its receive) stops at once:
                # a member killed mid-broadcast broke the learner's send in 0.2 s while
                # another waited in the group for sync.timeout_s and more, the admission
                # window shut behind the failed push all that time.
                prefix = store_prefix(self.coordinator.sync_secret, rnd.generation)
                give_up_send(self.store, prefix, rnd.watch.lost_in_send() or error)
            except Exception as e:  # the learner's own (tensors off the plan, out of memory)
                # The round is closed as failed all the same, then the error raised: left
                # open, it kept every later round from beginning ("still in progress").
                error, fault = f"{type(e).__name__}: {e}", e
            break
        else:  # nobody to send to: the version still becomes current
            return self.coordinator.finish_sync(rnd)
        if not error and self.deal_at_send:
            self.coordinator.weights_sent(rnd)
        if on_sent is not None:
            on_sent()
        if not error:
            return self.coordinator.finish_sync(rnd)
        # Let go of the failed group before waiting for the members' reports: closing its
        # connections makes the members still waiting in the broadcast fail at once
        # instead of after sync.timeout_s. A broadcast given up on a lost member may still
        # run (to its timeout): the group is then held aside that long, not dropped here.
        release_group(group, busy_s=busy_s)
        group = None
        if not rnd.catchup:
            self._group, self._generation = None, ""
        if fault is not None:  # its frames hold the group (send_weights' pg): drop them
            traceback.clear_frames(fault.__traceback__)
        gc.collect()
        if fault is None:
            log.warning("sync %d failed: %s", rnd.sync_id, error)
            return self.coordinator.finish_sync(rnd, sent_ok=False, error=error)
        log.error("sync %d failed on the learner's side, not a member's: %s", rnd.sync_id, error)
        self.coordinator.finish_sync(rnd, sent_ok=False, error=error)
        # Not a member's failure: the same tensors fail every push and catch-up, so the
        # learner stops (and is restarted) rather than train on with servers left behind.
        raise fault

    def _group_for(self, rnd: SyncRound) -> Any:
        """The group to send ``rnd`` on: formed, or the main group kept. None when the
        coordinator lost a member before it formed (the members that came give the meeting
        up with the learner): the round was begun again without it (``rnd.watch``)."""
        try:
            if rnd.catchup:  # a one-off group: the main group stays as it is
                group = self._form(rnd)
            else:
                if rnd.new_group or rnd.generation != self._generation:
                    self.forget()
                    self._group, self._generation = self._form(rnd), rnd.generation
                group = self._group
        except WeightSyncError as e:
            if rnd.watch.fail(str(e)) is None:  # settled: a later loss begins no round
                raise
            return None
        if rnd.watch.form():
            return group
        # Lost as the group formed: the members in it (or, kept, in its receive) are told
        # through the store, and let go.
        prefix = store_prefix(self.coordinator.sync_secret, rnd.generation)
        give_up_send(self.store, prefix, rnd.watch.ended())
        if rnd.catchup:
            release_group(group)
            raise WeightSyncError(f"catch-up {rnd.sync_id} given up: {rnd.watch.ended()}")
        self.forget()
        return None

    def _successor(self, rnd: SyncRound) -> SyncRound:
        again = rnd.watch.successor
        assert again is not None  # set before the round ended (RoundWatch.end)
        log.warning(
            "sync %d given up before its group formed (%s): begun again as sync %d with %s",
            rnd.sync_id,
            rnd.watch.ended(),
            again.sync_id,
            again.members or "nobody",
        )
        return again

    def _form(self, rnd: SyncRound) -> Any:
        return form_group(
            self.store,
            store_prefix(self.coordinator.sync_secret, rnd.generation),
            0,
            rnd.world_size,
            backend=self.backend,
            timeout_s=self.timeout_s,
            abandon=rnd.watch.ended,
        )

    def forget(self) -> None:
        release_group(self._group)
        self._group, self._generation = None, ""
