"""Memory settings of the buffer's process (not of a service started inside another
program: they are process-wide)."""

from __future__ import annotations

import ctypes
import gc
import sys

# glibc's malloc thresholds (mallopt parameters) of the buffer's process, see reuse_freed_memory
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20
# How often the buffer's loop runs the cyclic garbage collector itself, see collect_on_schedule
COLLECT_EVERY_S = 30.0


def reuse_freed_memory() -> bool:
    """Let glibc's malloc serve batch-sized blocks from memory this process freed.

    Each batch reply joins its groups' arrays into fresh bytes (about 1 MB for 16 groups of
    8 x 1024 tokens). Past glibc's default thresholds every such block is mapped fresh and
    returned on free, so each batch page-faults its whole size in again: 0.58 ms a batch
    against 0.04 ms into reused memory (bench_transport --quick: the service's CPU per
    round 0.36-0.38 s against 0.40-0.45 s, transport ratio 0.64-0.69 against 0.54-0.56).
    Raising the thresholds keeps up to ``TRIM_THRESHOLD`` of freed memory for reuse. It is
    process-wide, so the buffer's own process sets it (``buffer/main.py``). True when set; elsewhere than glibc Linux nothing
    changes.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        return bool(
            libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD)
            and libc.mallopt(m_trim_threshold, TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False


def collect_on_schedule() -> float:
    """Stop the cyclic garbage collector from running on allocation counts in this process;
    return the period at which the service loop should run it instead.

    A full buffer holds every waiting group's headers: about 166,000 objects the collector
    tracks at the default capacity of 4096 groups of 8. Python starts a collection every 700
    allocations and a full one whenever a quarter as many objects have survived since the
    last, and each message allocates about 40, so the collector kept rescanning the whole
    buffer: about 0.2 of the service's 1.4 s of CPU per round of ``bench_transport.py``
    (8192 groups). With this, four interleaved pairs of its full run read 0.65-0.69
    against 0.54-0.59. The service's own objects form no reference
    cycles (3000 groups through the whole service left none behind), so one full
    collection every :data:`COLLECT_EVERY_S` (about 70 ms on a full buffer) frees whatever
    a library leaves. Process-wide: only the buffer's own process calls it.
    """
    gc.disable()
    return COLLECT_EVERY_S
