"""Which pooled groups a FIFO release takes: a pure function of the buffer's state."""

from __future__ import annotations

from buffer.state import State


def oldest_first(s: State, k: int) -> list[str]:
    """The ``k`` pooled groups with the oldest policy versions, ties in arrival order: the
    first ``k`` of the pool sorted stably by version, without sorting the pool.

    The version counts say how many of the oldest versions fill ``k`` (all groups of
    versions below a threshold, the first ones of the threshold version), so the scan stops
    once both are found: after about ``k`` groups when older groups arrived first, as they
    usually do, instead of keying every group of a pool that can hold thousands.
    """
    need: dict[int, int] = {}
    left = k
    for version in sorted(s.pool_versions):
        take = min(left, s.pool_versions[version])
        need[version] = take
        left -= take
        if not left:
            break
    picked: list[str] = []
    missing = k - left  # k, or the whole pool when it holds fewer
    for tid in s.pool:
        version = s.held[tid].oldest_version
        if need.get(version, 0) > 0:
            need[version] -= 1
            picked.append(tid)
            missing -= 1
            if not missing:
                break
    return sorted(picked, key=lambda t: s.held[t].oldest_version)  # stable: arrival order
