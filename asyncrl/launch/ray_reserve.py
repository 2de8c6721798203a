"""The reservation of a ``--ray`` run's placement group (:func:`reserve`): the launcher
waits for Ray to place every bundle in steps of :data:`WAIT_STEP_S`, saying at each step
what the unplaced bundles ask for that the cluster does not have; at ``start_timeout_s``
it gives up in one line naming the missing resource and the config key that asks for it.
Ctrl-C or SIGTERM during the wait removes the placement group and ends the launch with
130 or 143, as the launcher exits on those signals once the roles run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from asyncrl.launch.ray_plan import Placement

log = logging.getLogger("asyncrl.launch")

WAIT_STEP_S = 10.0  # how often the wait for the bundles says what it waits for


class Stopped(Exception):
    """Ctrl-C or SIGTERM during the reservation; ``code``: the launcher's exit code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _signals_stop() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Stopped` (130, 143) from the body; the handlers in
    place before (Ray's own SIGTERM handler among them) come back afterwards. The handler
    raises KeyboardInterrupt, the one exception ``ray.get`` lets through from a signal
    handler, and the signal's number says which it was."""
    got: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        raise KeyboardInterrupt

    before = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except KeyboardInterrupt:
        raise Stopped(128 + (got[0] if got else signal.SIGINT)) from None
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _key(resource: str, kinds: set[str]) -> str:
    """The config key(s) that make bundles of ``kinds`` ask for ``resource``."""
    if resource == "CPU":
        return " / ".join(f"launch.ray.{k}_cpus" for k in sorted(kinds))
    if resource == "GPU":
        keys = {"learner": "trainer.nproc", "rollout": "rollout.tensor_model_parallel_size"}
        return " / ".join(keys[k] for k in sorted(kinds)) + " (or trainer.device=cpu)"
    return " / ".join(f"launch.ray.resources.{k}.{resource}" for k in sorted(kinds))


def shortfall(
    placement: Placement,
    free: Mapping[str, float],
    total: Mapping[str, float],
    nodes: Sequence[Mapping[str, float]] = (),
) -> list[str]:
    """One line per resource the run's bundles ask for, all together, beyond what the
    cluster has free (``free``, of ``total``), with the config key asking for it; failing
    those, one per bundle no single node (``nodes``: each live node's resources) holds.
    Empty when neither explains the wait (the strategy, or nodes still joining)."""
    kinds = placement.kinds
    need: dict[str, float] = {}
    asked_by: dict[str, set[str]] = {}
    for bundle, kind in zip(placement.bundles, kinds, strict=True):
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v
            asked_by.setdefault(k, set()).add(kind)
    out = [
        f"{k}: the bundles ask for {v:g}, the cluster has {total.get(k, 0.0):g} "
        f"({free.get(k, 0.0):g} free); set by {_key(k, asked_by[k])}"
        for k, v in sorted(need.items())
        if v > free.get(k, 0.0) + 1e-9
    ]
    if out or not nodes:
        return out
    for i, (bundle, kind) in enumerate(zip(placement.bundles, kinds, strict=True)):
        if not any(all(n.get(k, 0.0) >= v for k, v in bundle.items()) for n in nodes):
            keys = ", ".join(_key(k, {kind}) for k in sorted(bundle))
            out.append(f"bundle {i} {bundle}: no single node has that much; set by {keys}")
    return out


def _missing(placement: Placement) -> list[str]:
    """:func:`shortfall` from what the cluster has now."""
    import ray

    nodes: list[Mapping[str, float]] = [
        {k: float(v) for k, v in n.get("Resources", {}).items()}
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return shortfall(placement, ray.available_resources(), ray.cluster_resources(), nodes)


def reserve(
    placement: Placement, strategy: str, timeout_s: float, step_s: float = WAIT_STEP_S
) -> Any:
    """The run's placement group once Ray has placed every bundle; None, with one line
    naming what is missing, when the cluster cannot hold them within ``timeout_s``.
    Raises :class:`Stopped` on Ctrl-C or SIGTERM, the placement group removed."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    start = time.monotonic()
    pg = placement_group(placement.bundles, strategy=strategy)
    try:
        with _signals_stop():
            ready = pg.ready()
            while (left := timeout_s - (time.monotonic() - start)) > 0:
                try:
                    ray.get(ready, timeout=min(step_s, left))
                    return pg
                except GetTimeoutError:
                    if time.monotonic() - start >= timeout_s:
                        break  # the line below says it
                missing = "; ".join(_missing(placement)) or "nothing the cluster lacks now"
                log.warning(
                    "waiting %.0fs for bundles %s (strategy %s; launch.ray.start_timeout_s=%g) "
                    "(missing: %s)",
                    time.monotonic() - start,
                    placement.bundles,
                    strategy,
                    timeout_s,
                    missing,
                )
            missing = "; ".join(_missing(placement)) or (
                f"the cluster has enough in all, but not as strategy {strategy} places it: "
                "set launch.ray.strategy, or add nodes"
            )
    except Stopped:
        with _signals_ignored():  # a second Ctrl-C must not leave the group reserved
            remove_placement_group(pg)
        log.warning("interrupted while waiting for the run's bundles: nothing was started")
        raise
    except BaseException:
        remove_placement_group(pg)
        raise
    remove_placement_group(pg)
    log.error(
        "the cluster cannot hold the run's bundles after %.0fs: %s; add nodes, or change "
        "the key named",
        timeout_s,
        missing,
    )
    return None
