"""The learner loop's view of the run's control plane (:class:`ControlPeer`), what a
checkpoint brings back for it (:class:`Restored`), and the peer of ranks other than 0
(:class:`NoControl`), which answers every call with nothing, so the loop reads the same on
every rank and never asks "am I rank 0?". Rank 0's peer is
:class:`learner.control_plane.RankZero`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

# A batch as the buffer numbers it: (buffer session, batch id). An id alone is ambiguous
# across a buffer restart, where the new session numbers its batches from 0 again.
BatchRef = tuple[str, int]


def _nothing() -> None:
    """The default ``keepalive`` of :meth:`ControlPeer.finish`: no other rank waits."""


class Restored(NamedTuple):
    """What a checkpoint brought back for the control plane (all None on a fresh start)."""

    path: Path | None
    last_batch_id: int | None  # the buffer resends what came after it
    coordinator: dict[str, Any] | None  # the coordinator's saved state
    step: int = 0  # the checkpoint's step and policy version
    version: int = 0
    last_batch_session: str = ""  # the buffer session that numbered last_batch_id
    validation: dict[str, Any] | None = None  # the validation rounds reported
    lag_controller: dict[str, Any] | None = None  # the adaptive lag reached
    saved_at: float | None = None  # wall time the control plane's state was taken

    def records_lost_after(self, run: Path) -> float | None:
        """The wall time after which the run's records were lost with the learner that
        wrote them (:meth:`~asyncrl.metrics.MetricsLogger.mark_resumed`): ``saved_at``;
        None for the checkpoint a run ended whole at (:func:`~asyncrl.config.ending.ended_at`),
        whose later records are its ending (the final validation, the accounting) and are
        never written again. Found by a review: a run extended past its end lost its final
        round's record from every reader."""
        from asyncrl.config.ending import ended_at

        return None if ended_at(run) == self.step else self.saved_at


class ControlPeer(Protocol):
    """The loop's view of the control plane; every method is a no-op off rank 0."""

    def wait_batch(
        self, version: int, step: int, keepalive: Callable[[], None] | None = None
    ) -> Any: ...
    def trained(self, task_ids: list[str]) -> None: ...
    def acknowledge(self, batches: list[BatchRef]) -> None: ...
    def acknowledge_on_next_request(self, batches: list[BatchRef]) -> None: ...
    def resume(self, tensors: dict[str, Any]) -> None: ...
    def push(
        self, tensors: dict[str, Any], target: int, probe: list[float] | None = None
    ) -> dict[str, float]: ...
    def version(self, current: int) -> int: ...
    def steer_lag(self, step: int, metrics: dict[str, float]) -> None: ...
    def checkpoint_extra(self, step: int) -> dict[str, Any]: ...
    def export(self, tensors: dict[str, Any], out: Path, step: int) -> None: ...
    def log_step(self, step: int, metrics: dict[str, float], version: int) -> None: ...
    def after_step(self, step: int) -> None: ...
    def finish(
        self,
        step: int,
        validate: bool,
        wait_rounds: bool = True,
        complete: bool = False,
        keepalive: Callable[[], None] = _nothing,
    ) -> None: ...
    def abandon(self) -> None: ...


class NoControl:
    """The control plane as ranks other than 0 see it: nothing to do, nothing to report."""

    def wait_batch(
        self, version: int, step: int, keepalive: Callable[[], None] | None = None
    ) -> Any:
        return None  # the batch arrives by broadcast from rank 0

    def trained(self, task_ids: list[str]) -> None:
        pass

    def acknowledge(self, batches: list[BatchRef]) -> None:
        pass

    def acknowledge_on_next_request(self, batches: list[BatchRef]) -> None:
        pass

    def resume(self, tensors: dict[str, Any]) -> None:
        pass

    def push(
        self, tensors: dict[str, Any], target: int, probe: list[float] | None = None
    ) -> dict[str, float]:
        return {}

    def version(self, current: int) -> int:
        return current  # replaced by rank 0's in the broadcast that follows

    def steer_lag(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def checkpoint_extra(self, step: int) -> dict[str, Any]:
        return {}

    def export(self, tensors: dict[str, Any], out: Path, step: int) -> None:
        pass

    def log_step(self, step: int, metrics: dict[str, float], version: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def finish(
        self,
        step: int,
        validate: bool,
        wait_rounds: bool = True,
        complete: bool = False,
        keepalive: Callable[[], None] = _nothing,
    ) -> None:
        pass

    def abandon(self) -> None:
        pass


class EndedAlone(NoControl):
    """Rank 0 of a run whose ending is done, started again with no buffer answering: no
    peer to tell, but a ``final/`` found missing is still exported (with a plain
    :class:`NoControl` it was not, while ``final_adapter/`` was)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def export(self, tensors: dict[str, Any], out: Path, step: int) -> None:
        from learner.export import export_final

        export_final(self.cfg, tensors, out, step)
