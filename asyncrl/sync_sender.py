"""The learner's side of a weight push, driven by the coordinator.

:class:`WeightPusher` runs a sync round the coordinator planned: it forms (or reuses) the
group of the round's generation as rank 0 and broadcasts the tensors; the coordinator then
collects every member's report. Catch-up rounds (a server that joined late or failed a
sync) get a one-off group and leave the main group as it is. Used by the learner and by
the stand-in learner of the tests, so both run the same protocol.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from asyncrl.weight_sync import WeightSyncError, form_group, send_weights

log = logging.getLogger(__name__)


class WeightPusher:
    """Rank 0 of every sync group: forms groups, broadcasts, closes rounds."""

    def __init__(self, coordinator: Any, store: Any, *, backend: str, timeout_s: float):
        self.coordinator = coordinator
        self.store = store
        self.backend = backend
        self.timeout_s = timeout_s
        self._group = None
        self._generation = ""

    def push(self, tensors: dict[str, Any], plan: list, plan_wire: list[dict]) -> Any:
        """A new version to every member; failures drop members, never raise."""
        return self._run(self.coordinator.begin_sync(plan_wire), tensors, plan)

    def serve_catchups(self, tensors: dict[str, Any], plan: list, plan_wire: list[dict]) -> list:
        """The current weights to every server waiting for a catch-up, one at a time."""
        return [
            self._run(self.coordinator.begin_catchup(server_id, plan_wire), tensors, plan)
            for server_id in self.coordinator.pending_catchups()
        ]

    def _run(self, rnd: Any, tensors: dict[str, Any], plan: list) -> Any:
        if not rnd.ranks:  # nobody to send to: the version still becomes current
            return self.coordinator.finish_sync(rnd)
        error = ""
        try:
            if rnd.catchup:  # a one-off group: the main group stays as it is
                group = self._form(rnd)
            else:
                if rnd.new_group or rnd.generation != self._generation:
                    self._group, self._generation = None, ""
                    self._group, self._generation = self._form(rnd), rnd.generation
                group = self._group
            send_weights(group, tensors, plan, timeout_s=self.timeout_s)
        except WeightSyncError as e:
            error = str(e)
        if not error:
            return self.coordinator.finish_sync(rnd)
        # Let go of the failed group before waiting for the members' reports: closing its
        # connections makes the members still waiting in the broadcast fail at once
        # instead of after sync.timeout_s.
        group = None
        if not rnd.catchup:
            self._group, self._generation = None, ""
        gc.collect()
        log.warning("sync %d failed: %s", rnd.sync_id, error)
        return self.coordinator.finish_sync(rnd, sent_ok=False, error=error)

    def _form(self, rnd: Any) -> Any:
        return form_group(
            self.store, rnd.generation, 0, rnd.world_size, backend=self.backend,
            timeout_s=self.timeout_s,
        )  # fmt: skip

    def forget(self) -> None:
        self._group, self._generation = None, ""
