"""Waiting for a training slot: how a new endpoint group's first request gets its slot of
the staleness budget (``rollout.openai_endpoint.slot_wait_s``).

While no slot is free (the budget is spent, the weights catch up, the server's
``max_groups`` are open) the request is *held*: it asks the coordinator again with a growing
pause, at most every second, and is answered as soon as a slot frees. OpenAI clients retry
a 429 only twice by default, so an immediate refusal would fail an agent for the length of
one learner step. Past the wait the refusal (429 or 503) says how long it was held and
what holds the budget. A hold ends early, refused, when waiting cannot help: the run is
ending, the server is stopping, the group was abandoned (``POST /rl/abandon``), or the
client disconnected (its request may be resent and then opens the group itself); a slot
granted to a group no longer wanted is given back.

One slot request of a server is in flight at a time (held groups share the control lane
with acknowledgements), and while it runs it counts against ``max_groups``: groups
granted at once cannot pass the limit together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

from asyncrl.control.messages import TaskGrant
from rollout_servers.sessions import RequestError

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl.config import Config
    from asyncrl.control.messages import Task
    from rollout_servers.lanes import Lanes
    from rollout_servers.protocols import ControlClient

log = logging.getLogger(__name__)

#: The status of a held request whose client disconnected (nginx's "client closed request").
LEFT = 499
#: A wait for a slot this long is logged.
LONG_WAIT_S = 5.0


def _run_ending() -> RequestError:
    """The answer once the run is over: final, not retried."""
    return RequestError(
        503,
        "the run is ending (its learner finished): no new groups",
        "unavailable",
        retry=False,
    )


class SlotWaiter:
    """Takes slots for one server's endpoint groups (see the module docstring).

    ``open_groups`` counts the server's open groups; ``holders`` describes them for a
    refusal. ``stopping`` and ``abandoned`` (group names) end holds early."""

    def __init__(
        self,
        cfg: Config,
        client: ControlClient,
        lanes: Lanes,
        metrics: Counter[str],
        open_groups: Callable[[], int],
        holders: Callable[[], str],
    ) -> None:
        oe = cfg.rollout.openai_endpoint
        self.cfg, self.client, self.lanes, self.metrics = cfg, client, lanes, metrics
        self.open_groups, self.holders = open_groups, holders
        self.slot_wait_s, self.max_groups = oe.slot_wait_s, oe.max_groups
        self.stopping = False
        self.abandoned: set[str] = set()  # groups abandoned while they wait
        self._reserved = 0  # slot requests in flight: they count against max_groups
        self._asking = asyncio.Lock()
        self._late: set[asyncio.Future] = set()  # give-backs of grants that came too late

    async def take(self, name: str, gone: Callable[[], bool]) -> Task:
        """A slot of the admission budget for group ``name``. While none is free (the
        budget is spent, the weights catch up, this server's ``max_groups`` are open) the
        request is held up to ``slot_wait_s``, asking again with a growing pause (at most
        1 s): backpressure, so that a client with the default two retries is not failed by
        one learner step. Past the wait, or when waiting cannot help (the run ends, this
        server stops, the group is abandoned, the client left), the refusal; a slot granted
        to a group no longer wanted is given back."""
        start, pause = time.monotonic(), 0.1
        while True:
            self._still_wanted(name, gone)
            grant = None
            if self.open_groups() + self._reserved < self.max_groups:
                grant = await self._ask(start + self.slot_wait_s)
                if grant.tasks:
                    try:
                        self._still_wanted(name, gone)
                    except RequestError:
                        await self.lanes.control(
                            self.client.nack, [grant.tasks[0].task_id], "not wanted after its wait"
                        )
                        raise
                    self._waited(start, "")
                    return grant.tasks[0]
            waited = time.monotonic() - start
            if (grant is not None and grant.reason == "shutdown") or waited >= self.slot_wait_s:
                # (no grant: max_groups are open here)
                self._waited(start, grant.reason if grant is not None else "max_groups")
                raise self._refusal(grant, waited)
            await asyncio.sleep(min(pause, self.slot_wait_s - waited))
            pause = min(1.0, 2 * pause)

    async def _ask(self, deadline: float) -> TaskGrant:
        """One slot request of this server's at a time (held groups share the control
        lane with acknowledgements); while it runs it counts against ``max_groups``, so
        groups granted at once cannot pass the limit together. Refused (``busy``) when the
        turn to ask did not come before ``deadline``. A grant that comes after its request was
        cancelled is given back."""
        self._reserved += 1
        try:
            if self._asking.locked():  # another group is asking: wait for the turn
                try:
                    left = max(0.0, deadline - time.monotonic())
                    await asyncio.wait_for(self._asking.acquire(), left)
                except asyncio.TimeoutError:  # the builtin only from Python 3.11
                    return TaskGrant(tasks=[], policy_version=-1, reason="busy")
            else:
                await self._asking.acquire()
            try:
                call = asyncio.ensure_future(self.lanes.control(self.client.request_slot))
                try:
                    return await asyncio.shield(call)
                except asyncio.CancelledError:
                    call.add_done_callback(self._give_back_late)
                    raise
            finally:
                self._asking.release()
        finally:
            self._reserved -= 1

    async def give_back_unanswered(self, older_than_s: float) -> None:
        """The slots of requests whose every reply was lost and that no later request
        repeated (the group gave up its wait, the agent left): given back, or each would
        hold the admission budget while this server lives."""
        back = await self.lanes.control(self.client.give_back_unanswered_slots, older_than_s)
        if back:
            self.metrics["rollout/openai/unanswered_slots_given_back"] += back
            log.warning(
                "%d training slots granted to requests whose replies were lost given back "
                "(no group waits for them)",
                back,
            )

    def _give_back_late(self, call: asyncio.Future[TaskGrant]) -> None:
        if call.cancelled() or call.exception() is not None or not call.result().tasks:
            return
        ids = [t.task_id for t in call.result().tasks]
        t = asyncio.ensure_future(self.lanes.control(self.client.nack, ids, "request cancelled"))
        self._late.add(t)
        t.add_done_callback(self._late.discard)

    def _still_wanted(self, name: str, gone: Callable[[], bool]) -> None:
        """Refuse a held request that waiting cannot help any more."""
        ending = getattr(self.client, "shutdown", None)
        if ending is not None and ending.is_set():
            raise _run_ending()
        if self.stopping:
            raise RequestError(503, "this rollout server is stopping: retry", "unavailable")
        if name in self.abandoned:
            raise RequestError(
                409, f"group {name!r} was abandoned while it waited for a slot", retry=False
            )
        if gone():
            raise RequestError(LEFT, "the client left while its request waited for a slot")

    def _waited(self, start: float, refused: str) -> None:
        """Count a held request's wait (and say so when it was long)."""
        waited = time.monotonic() - start
        if waited < 0.05:
            return
        self.metrics["rollout/openai/slot_waits"] += 1
        self.metrics["rollout/openai/slot_wait_ms"] += round(1000 * waited)
        if waited >= LONG_WAIT_S:
            outcome = f"refused ({refused})" if refused else "granted"
            log.info("a new endpoint group waited %.0f s for a training slot: %s", waited, outcome)

    def _refusal(self, grant: TaskGrant | None, waited: float) -> RequestError:
        """The answer to a refused slot: what holds the budget and what frees it."""
        reason = grant.reason if grant is not None else "max_groups"
        self.metrics[f"rollout/openai/slots_refused/{reason}"] += 1
        held = (
            f" (held {waited:.0f} s, rollout.openai_endpoint.slot_wait_s={self.slot_wait_s:g})"
            if waited >= 0.5
            else ""
        )
        if grant is None:
            return RequestError(
                429,
                f"{self.max_groups} groups are open on this server "
                f"(rollout.openai_endpoint.max_groups){held}: {self.holders()}",
                "rate_limit",
            )
        if grant.reason == "shutdown":
            return _run_ending()
        if grant.reason != "budget":
            return RequestError(
                503,
                f"no training slot now ({grant.reason}){held}; retry shortly",
                "unavailable",
            )
        lag = self.cfg.staleness.max_policy_lag
        detail = grant.detail or "the learner has not trained the groups dealt yet"
        return RequestError(
            429,
            f"no training slot now{held}: the staleness budget (staleness.max_policy_lag="
            f"{lag}) is full; {detail}. {self.holders()} A slot frees when the learner "
            "trains its next step; retry.",
            "rate_limit",
        )
