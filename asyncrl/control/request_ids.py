"""Request ids that make a retried request idempotent, safe to take from any thread.

The coordinator answers a request id it has seen with the grant it gave that id (its reply
was lost; the tasks are outstanding at the server already). So an id must belong to one
call at a time: two concurrent calls with one id would share one grant, e.g. two agent
groups carrying one external slot. :class:`RequestIds` hands each call its own id; a call
that was never answered gives its id back, and the next call asks with it again, so a
grant whose reply was lost still reaches this server instead of waiting for the
coordinator's task timeout.
"""

from __future__ import annotations

import threading
import time


class RequestIds:
    """Ids of one kind of request: :meth:`take` one per call (its retries repeat it),
    :meth:`unanswered` when the call gave up without a reply, :meth:`stale` for those no
    call asked with again for a while."""

    def __init__(self, first: int = 1) -> None:
        self._next = first
        self._unanswered: list[tuple[int, float]] = []  # (id, when it was given back)
        self._lock = threading.Lock()

    def take(self) -> int:
        """An id no other call holds now: one given back unanswered, else a new one."""
        with self._lock:
            if self._unanswered:
                return self._unanswered.pop()[0]
            rid = self._next
            self._next += 1
            return rid

    def unanswered(self, rid: int) -> None:
        """The call holding ``rid`` got no reply: the next call asks with it again."""
        with self._lock:
            self._unanswered.append((rid, time.monotonic()))

    def stale(self, older_than_s: float) -> list[int]:
        """Take the ids given back unanswered more than ``older_than_s`` ago: no call asked
        with them since, so a grant their lost replies carried reaches nobody (the caller
        asks once more and gives back what it gets)."""
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            old = [rid for rid, when in self._unanswered if when <= cutoff]
            self._unanswered = [(r, w) for r, w in self._unanswered if w > cutoff]
        return old
