"""Pinning a rollout server to its cores once its engine is up.

``asyncrl-launch`` starts a rollout server on every core and names its cores in
``ASYNCRL_PIN_CPUS`` (vLLM's OpenMP threads are bound to them from the start through
``VLLM_CPU_OMP_THREADS_BIND``). The reason: a server's start-up is mostly Python imports in
two processes (this one and vLLM's engine core), single-threaded work that a server pinned
to one core from the start would have to share with every other role pinned there; on the
CPU demo (two servers on core 1) the engines were ready after 33 s pinned, while core 0 sat
idle once the learner had loaded. Once the engine is up, :func:`pin_tree` moves the server,
its engine processes and every one of their threads onto its cores, where it then
generates as before; processes it starts later (reward workers) inherit the pinning.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "ASYNCRL_PIN_CPUS"


def cpus_from_env() -> set[int] | None:
    """The cores named in ``ASYNCRL_PIN_CPUS`` (``"1"``, ``"0,1"``), or None if unset."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        return {int(c) for c in value.split(",")}
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: give core ids separated by commas, e.g. 0,1") from None


def pin_tree(cpus: set[int]) -> int:
    """Pin every thread of this process and of its descendants to ``cpus``; returns how
    many threads were pinned. Threads or processes that end meanwhile are skipped."""
    import psutil  # a dependency of vLLM, which this package requires anyway

    me = psutil.Process()
    pinned = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            threads = proc.threads()
        except psutil.Error:
            continue
        for thread in threads:
            try:
                os.sched_setaffinity(thread.id, cpus)
                pinned += 1
            except OSError:  # the thread ended
                continue
    log.info("pinned %d threads of this server and its engine to cores %s", pinned, sorted(cpus))
    return pinned
