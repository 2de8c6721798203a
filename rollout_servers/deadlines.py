"""An agent episode's deadline (``rollout.multi_turn.episode_timeout_s``) that does not count
the time its engine was paused for weight syncs.

A full-weight sync pauses generation (:meth:`rollout_servers.engine.RolloutEngine.
sync_weights`): a turn in flight then waits for the learner's broadcast, through no fault of
the model or the tools, and an episode ended there as ``timeout`` would be trained as if the
model had run long. So the deadline moves on by the seconds the engine has been paused since the
episode started (:meth:`~rollout_servers.engine.RolloutEngine.paused_s`, the pause in
progress included, and the hold of partly loaded weights until a whole load), and a wait
that reaches the deadline looks at it again before giving up (:func:`within`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rollout_servers.protocols import GenerationEngine

T = TypeVar("T")

#: Longest wait of a dealt group for the weights it was dealt under (``Task.dealt_version``,
#: :meth:`~rollout_servers.engine.RolloutEngine.reach`): the wait normally ends within a
#: sync's load (under 0.1 s on the CPU demo) or its failure.
REACH_S = 5.0


class Deadline:
    """``timeout_s`` from now, moved on by the time ``engine`` spends paused for syncs from
    now on (pauses before the episode started are not its)."""

    def __init__(self, timeout_s: float, engine: GenerationEngine) -> None:
        self.engine = engine
        self._end = time.monotonic() + timeout_s
        self._paused_before = engine.paused_s()

    def left(self) -> float:
        """Seconds left (0 or less: passed)."""
        paused = self.engine.paused_s() - self._paused_before
        return self._end + paused - time.monotonic()


async def within(aw: Awaitable[T], deadline: Deadline) -> T:
    """``aw``'s result; ``asyncio.TimeoutError`` once ``deadline`` has passed, ``aw``
    cancelled and ended. Unlike ``asyncio.wait_for``, a deadline that a sync moved on while
    waiting is looked at again instead of ending the wait at the first bound."""
    task = asyncio.ensure_future(aw)
    try:
        while not task.done():
            left = deadline.left()
            if left <= 0:
                raise asyncio.TimeoutError  # the builtin TimeoutError from Python 3.11 on
            await asyncio.wait({task}, timeout=left)
        return task.result()
    finally:
        if not task.done():  # timed out, or this wait was cancelled: the turn ends with it
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
