"""A store whose blocking waits ask, between short looks, whether to stop: the store gloo's
group constructor is given (:func:`asyncrl.sync.groups.form_group`).

Gloo's constructor waits in the store for every member's address, up to the group's
timeout. A member that died after the members met held every other one there that long
(600 s in one run), and a ``TCPStore`` wait cannot be interrupted. Torch lets a Python class
stand for a store: gloo's waits then run here, in the caller's thread, and end as soon as
``stop`` gives a reason (the learner lost the member, or told the members so).

Python now runs inside gloo's constructor, so a thread there must leave it before the
interpreter finalizes: a daemon thread that took the GIL back in it then crashed the
process (SIGSEGV at exit; a server's inline engine thread is a daemon). At exit
(``atexit``, before finalizing) the waits stop, and the exit waits up to
:data:`EXIT_WAIT_S` for the constructors to end. Imported only where torch is.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

from torch.distributed import Store  # pyright: ignore[reportPrivateImportUsage]

#: The longest a wait goes without asking ``stop``, seconds (the first looks come sooner:
#: a group's members post their addresses within milliseconds of each other).
ASK_EVERY_S = 0.1


#: The longest the interpreter's exit waits for threads to leave gloo's constructor, s.
EXIT_WAIT_S = 2.0

_exiting = threading.Event()
_inside_lock = threading.Lock()
_inside = [0]  # threads in a constructor over an AskingStore now


@contextmanager
def inside_constructor() -> Iterator[None]:
    """Count the calling thread inside gloo's constructor while the block runs."""
    with _inside_lock:
        _inside[0] += 1
    try:
        yield
    finally:
        with _inside_lock:
            _inside[0] -= 1


def _let_constructors_out() -> None:
    """At exit: every wait stops, and the exit waits (bounded) until no thread is left in
    a constructor."""
    _exiting.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    while _inside[0] and time.monotonic() < deadline:
        time.sleep(0.01)


atexit.register(_let_constructors_out)


class StoreWaitStopped(RuntimeError):
    """A wait ended because ``stop`` gave a reason (the message)."""


class AskingStore(Store):
    """``inner`` with waits that look at it in slices and ask ``stop`` between them; a
    reason ends the wait with :class:`StoreWaitStopped`, the timeout with a
    ``TimeoutError``. Only what gloo's constructor calls (``set``, ``get``, ``wait``, logged
    on torch 2.13: a Python store offers gloo no extended operations) is written."""

    def __init__(self, inner: Store, stop: Callable[[], str], timeout_s: float) -> None:
        super().__init__()
        self._inner = inner
        self._stop = stop
        self._timeout_s = timeout_s
        self.why = ""  # the reason a wait stopped on, kept for the caller's message

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        pause = 0.002
        while not self._inner.check(keys):
            if _exiting.is_set():
                self.why = self.why or "the process is exiting"
            self.why = self.why or self._stop()
            if self.why:
                raise StoreWaitStopped(self.why)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"keys {keys} not set within {limit:.0f}s")
            time.sleep(pause)
            pause = min(2 * pause, ASK_EVERY_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        # gloo hands bytes (its addresses); torch's stub says str, and both are taken
        self._inner.set(key, value)  # pyright: ignore[reportArgumentType]
