"""Where a rollout server's blocking calls run: one thread pool per kind of wait, so one
kind never queues behind another.

asyncio's default executor (``asyncio.to_thread``) is one shared pool of
``min(32, cores + 4)`` threads. Calls that wait long for a scarce resource (a reward worker,
a tool worker, the buffer reading again) can fill it, and a weight sync's start then waits
for them: the learner's broadcast times out and drops this server. So:

- ``sync``: the sync loop alone (its poll for sync starts, its reports); one thread, never
  shared, so a sync is picked up within one poll whatever else waits;
- ``control``: the coordinator client's requests (tasks, external slots, acknowledgements,
  failure reports), which the coordinator answers at once or within its long-poll;
- ``scoring``: scoring a group, which waits for a reward worker; as many threads as workers
  (more would only wait).

Tool calls wait in the tool pool's own threads (:meth:`asyncrl.tools.ToolPool.
call_many_async`); pushes keep the default executor (:meth:`asyncrl.net.transport.
TrajectoryPusher.send_async`), which nothing else of the server's waits in now.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: Threads for the coordinator client's requests: one long-polled task request, plus acks
#: and reports (serialized on the client's control socket anyway).
CONTROL_THREADS = 4


class Lanes:
    """The thread pools of one rollout server (see the module docstring)."""

    def __init__(self, scoring_threads: int = 2) -> None:
        self._sync = ThreadPoolExecutor(1, thread_name_prefix="lane-sync")
        self._control = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="lane-control")
        self._scoring = ThreadPoolExecutor(scoring_threads, thread_name_prefix="lane-scoring")

    async def sync(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the sync loop's own thread."""
        return await _run(self._sync, fn, args)

    async def control(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (a coordinator client call) in the control threads."""
        return await _run(self._control, fn, args)

    async def scoring(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (scoring a group) in the scoring threads."""
        return await _run(self._scoring, fn, args)

    def close(self) -> None:
        """Take no more calls; queued ones are dropped, running ones finish on their own."""
        for pool in (self._sync, self._control, self._scoring):
            pool.shutdown(wait=False, cancel_futures=True)


async def _run(pool: ThreadPoolExecutor, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
