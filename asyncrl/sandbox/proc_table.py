"""The process table as ``/proc`` shows it: each process's parent, process group, session,
state and start time (:func:`scan`), and the walk from some processes to all their
descendants (:func:`descendants`). The sandbox kills a worker's descendants with it
(:mod:`asyncrl.sandbox.process`); the launcher finds a role's whole tree with it
(:mod:`asyncrl.launch.process_tree`). Linux only; standard library only.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    """One line of the process table (``/proc/<pid>/stat``)."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str  # R, S, D, Z (zombie: exited, not yet reaped), ...
    start: int  # clock ticks after boot


def scan() -> dict[int, Proc]:
    """The process table as this process sees it."""
    out: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        rest = data[data.rindex(b")") + 2 :].split()
        out[int(name)] = Proc(
            int(name), int(rest[1]), int(rest[2]), int(rest[3]), rest[0].decode(), int(rest[19])
        )
    return out


def descendants(procs: dict[int, Proc], seeds: Iterable[int]) -> set[int]:
    """``seeds`` and every descendant of them in ``procs`` (zombies included)."""
    children: dict[int, list[int]] = defaultdict(list)
    for p in procs.values():
        children[p.ppid].append(p.pid)
    tree: set[int] = set()
    stack = list(seeds)
    while stack:
        pid = stack.pop()
        if pid not in tree:
            tree.add(pid)
            stack.extend(children[pid])
    return tree
