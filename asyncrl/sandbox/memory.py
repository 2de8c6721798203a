"""A worker process's memory cap (``reward.max_memory_mb``, ``rollout.multi_turn.
tool_max_memory_mb``): what a pool is given (:class:`MemoryCap`), how a worker sets it
(:func:`limit_memory`) and how a job's error is told to be the cap's (:func:`from_memory`).

Standard library only, as the rest of :mod:`asyncrl.sandbox`.
"""

from __future__ import annotations

import errno
import resource
from typing import NamedTuple

_CAUSES_CHECKED = 5  # how deep a raise's causes are searched for a memory error


class MemoryCap(NamedTuple):
    """The memory each worker process may take: ``mb`` MiB (0: no cap), set by the config
    ``key`` that a worker's out-of-memory messages name as the fix."""

    mb: int = 0
    key: str = ""

    def hit(self) -> str:
        """What a job that ran out of memory under the cap reports (one line)."""
        return f"MemoryError under the {self.mb} MiB cap of {self.key}"


NO_CAP = MemoryCap()  # workers whose owner sets no cap


def limit_memory(mb: int) -> None:
    """Cap this process's memory at ``mb`` MiB (0: leave it as it is).

    RLIMIT_DATA, not RLIMIT_AS: since Linux 4.7 it counts the heap and every private
    writable mapping (what malloc, numpy and thread stacks get), but not address space
    that is only reserved (glibc's 64 MB malloc arena per thread, PROT_NONE until used)
    nor shared libraries' code. On this project's Linux a 600 MB RLIMIT_AS made
    ``import torch`` (300 MB resident) raise MemoryError; the same RLIMIT_DATA did not.
    Only the soft limit is lowered, and never raised: a guard against a runaway scorer,
    not a security boundary. Processes the user code starts inherit it, each capped alone.
    """
    if mb <= 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = mb << 20
    for other in (soft, hard):  # keep a stricter limit set by whoever started us
        if other != resource.RLIM_INFINITY:
            limit = min(limit, other)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _text(exc: BaseException) -> str:
    """``str(exc)``, or "" where the user's exception cannot say it (its ``__str__``
    raises): the worker answers its job, not dies of the question."""
    try:
        return str(exc)
    except Exception:
        return ""


def from_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the memory ran out, or was raised while handling such an error
    (a scorer that wraps its errors): the cap, not the user's logic, ended the job. Python
    raises MemoryError; an ``mmap`` or other system call OSError(ENOMEM); torch's CPU
    allocator a RuntimeError naming it ("can't allocate memory")."""
    seen: BaseException | None = exc
    for _ in range(_CAUSES_CHECKED):
        if seen is None:
            return False
        if isinstance(seen, MemoryError):
            return True
        if isinstance(seen, OSError) and seen.errno == errno.ENOMEM:
            return True
        if isinstance(seen, RuntimeError) and "can't allocate memory" in _text(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
