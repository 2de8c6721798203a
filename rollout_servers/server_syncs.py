"""A rollout server's side of the learner's weight pushes: join the push's group (once per
group), load the weights while generation goes on (:meth:`RolloutEngine.sync_weights`),
score the post-sync probe under them, and report to the coordinator.

A failed sync is reported too (the coordinator drops this server from the group; it catches
up later). Whether the failure leaves the engine unable to go on is the server's call: it
is handed every failure (``on_failure``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable

from asyncrl.control.messages import WEIGHTS_PARTIAL, SyncStart
from asyncrl.sync.groups import store_prefix
from asyncrl.sync.probe import probe_ids
from rollout_servers.engine import SyncJoin
from rollout_servers.lanes import Lanes
from rollout_servers.protocols import ControlClient, GenerationEngine

log = logging.getLogger(__name__)

#: Longest wait for the post-sync probe's scores (at most a quarter of the sync's timeout):
#: the sync's report waits for them, and so does the learner's next push.
PROBE_S = 10.0

#: Told of a failed sync: (the error, the weights were partly loaded before it, it was a
#: catch-up).
FailureHook = Callable[[BaseException, bool, bool], None]


class WeightSyncs:
    """The weight syncs of one server's engine. ``metrics`` is the server's counter dict
    (``rollout/probe_timeouts`` is added to it); ``probe``: ``trainer.health.probe``."""

    def __init__(
        self,
        engine: GenerationEngine,
        client: ControlClient,
        lanes: Lanes,
        metrics: dict[str, float],
        probe: bool,
        on_failure: FailureHook,
    ) -> None:
        self.engine = engine
        self.client = client
        self.lanes = lanes
        self.metrics = metrics
        self.probe = probe
        self.on_failure = on_failure
        # The sync group this engine's workers are in, with the coordinator session that
        # formed it: a restarted learner numbers its groups from its checkpoint's sync ids.
        self.generation: tuple[str, str] = ("", "")

    async def loop(self, stopping: Callable[[], bool]) -> None:
        """Consumes sync starts delivered by the heartbeat thread; produces sync reports.
        Waits for a sync start (polling the client's queue every 0.2 s); a sync waits for
        the learner's broadcast, bounded by the sync's timeout. Ends once ``stopping()``."""
        while not stopping():
            start = await self.lanes.sync(self.client.next_sync, 0.2)
            if start is not None:
                await self.sync(start)

    def _join(self, start: SyncStart) -> SyncJoin | None:
        """The group to join before receiving ``start``'s weights: None when this engine's
        workers are in its group already."""
        if (start.session, start.generation) == self.generation:
            return None
        reg = self.client.registered
        if reg is None:  # sync starts come in heartbeat answers, after registration
            raise RuntimeError(f"sync {start.sync_id} started before registration")
        return SyncJoin(
            host=reg.sync_store_host,
            port=reg.sync_store_port,
            generation=store_prefix(reg.sync_secret, start.generation),
            rank_offset=start.rank,
            world_size=start.world_size,
            backend=start.backend,
        )

    async def sync(self, start: SyncStart) -> None:
        """Load ``start``'s weights and report how it went (with the probe's scores). A
        start of an earlier coordinator session (queued before this server registered
        again with a restarted learner) is skipped: joined under the new registration's
        store, it met in an empty or, its sync id reused, another round's meeting."""
        reg = self.client.registered
        if reg is not None and start.session and start.session != reg.session:
            log.info(
                "sync %d of an earlier coordinator session skipped (registered again since)",
                start.sync_id,
            )
            return
        join = self._join(start)
        was_partial = self.engine.partial
        try:
            stats = await self.engine.sync_weights(
                start.version, start.plan, join=join, timeout_s=start.timeout_s
            )
        except Exception as e:  # the coordinator drops us from the group; we catch up later
            self.generation = ("", "")
            log.warning("sync to version %d failed: %s", start.version, e)
            self.on_failure(e, was_partial, start.catchup)
            error = f"{type(e).__name__}: {e}"
            if self.engine.partial:  # said at a registration (a learner restart): a catch-up
                error = f"{WEIGHTS_PARTIAL} ({error})"
            await self.lanes.sync(self.client.sync_done, start, False, error)
            return
        self.generation = (start.session, start.generation)
        probe = await self._probe(min(PROBE_S, start.timeout_s / 4))
        report = functools.partial(self.client.sync_done, probe=probe)
        await self.lanes.sync(report, start, True, "", stats["seconds"])

    async def _probe(self, timeout_s: float) -> list[float]:
        """The post-sync probe under the weights just loaded (empty when it fails or takes
        over ``timeout_s``: the learner then has nothing to compare, and the sync itself
        stands). The engine keeps a slot for it (``max_num_seqs``, see
        :func:`rollout_servers.main.engine_sequences`); without one it queued behind the
        running requests until one finished, and the sync's report with it."""
        if not self.probe:
            return []
        try:
            probe = await asyncio.wait_for(self.engine.score(probe_ids()), timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on
            self.metrics["rollout/probe_timeouts"] += 1
            log.warning(
                "post-sync probe not scored within %.1fs (the engine is slower than its "
                "slots allow: a device shared with other work?); this sync is reported "
                "without it",
                timeout_s,
            )
            return []
        except Exception as e:
            log.warning("post-sync probe not scored: %s: %s", type(e).__name__, e)
            return []
        if not all(math.isfinite(x) for x in probe):
            # Reported as scored: the learner names this server (an infinite difference);
            # left out, the worst case the probe is there for passed without a word.
            log.warning(
                "post-sync probe scored NaN or inf with the weights just loaded (%d of %d "
                "values): they arrived broken; reported for the learner to name",
                sum(not math.isfinite(x) for x in probe),
                len(probe),
            )
        return probe
