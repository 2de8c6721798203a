"""Rank 0's weight pushes (:class:`WeightPushes`): each new version is announced at once,
broadcast to the rollout servers on a thread while the next step trains
(``sync.overlap_push``), and its reports collected by the next push; servers that join late
or restart catch up to the last pushed weights between pushes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncrl.config import Config
from learner.health import check_probe

log = logging.getLogger(__name__)

#: How often a wait for the push in flight says how long it has lasted, seconds.
WAIT_LOG_S = 30.0


class WeightPushes:
    """The push in flight (its thread, version and outcome) and the last pushed weights.

    ``coordinator`` (the version and the catch-up requests) and ``pusher`` (a
    :class:`asyncrl.sync.sender.WeightPusher`) belong to rank 0's control plane."""

    def __init__(self, cfg: Config, coordinator: Any, pusher: Any):
        self.cfg = cfg
        self.coordinator = coordinator
        self.pusher = pusher
        self.overlap_push = cfg.sync.overlap_push
        self.pushed: dict[str, Any] = {}  # the last pushed weights, for catch-ups
        self._push_thread: threading.Thread | None = None
        self.pushing_version = 0
        self._push_done: dict[str, float] = {}
        self._push_error: BaseException | None = None

    def push(
        self, tensors: dict[str, Any], target: int, probe: list[float] | None = None
    ) -> dict[str, float]:
        """Push ``tensors`` (a copy: training may go on) as the next version, ``target`` by
        the learner's schedule; skipped when a replay reached a version the servers hold.
        ``probe``: the learner's logprobs of the post-sync probe under these weights, which
        each server's report is compared with (:func:`~asyncrl.sync.probe.probe_metrics`).

        The version is announced here; the broadcast and the wait for the members' reports
        (bounded by ``sync.timeout_s``) run on a thread while the next step trains
        (``sync.overlap_push``), so this call waits only for the previous push to end, and
        returns that push's metrics. Without overlap it also waits until this one is sent
        (not for its reports). On the CPU
        demo a push kept the learner 0.09 s a step (the servers pause, load, report), a
        third of the step, for nothing it needed."""
        start = time.monotonic()
        self.wait()
        done = self.take_results()
        self.pushed = tensors
        if self.coordinator.adopt(target):
            log.info("version %d replayed: the servers that hold it keep it (no push)", target)
            return {**done, "sync/replayed": 1.0, "timing/push_wait_s": time.monotonic() - start}
        rnd = self.pusher.begin(tensors)
        self.pushing_version = rnd.version
        sent = threading.Event()
        self._push_thread = threading.Thread(
            target=self._complete_push,
            args=(rnd, tensors, probe or [], sent),
            name="weight-push",
            daemon=True,
        )
        self._push_thread.start()
        if not self.overlap_push:
            # Until every member has the weights (the servers pause for this), not for
            # their reports: those come after each server's post-sync probe, which runs in
            # the engine slot kept for it, among the running requests (0.1-0.3 s on the
            # CPU long shape, against 0.02 s for the send; bounded at 10 s or a quarter of
            # sync.timeout_s). The next push collects them.
            # Set by the push thread however it ends; its waits are bounded.
            self._wait_logged(sent.wait, "sent")
        return {**done, "timing/push_wait_s": time.monotonic() - start}

    def _complete_push(
        self, rnd: Any, tensors: dict[str, Any], probe: list[float], sent: threading.Event
    ) -> None:
        """The push thread: consumes one announced round; produces its metrics (with the
        post-sync probe's). Waits for the broadcast (then sets ``sent``) and the reports,
        each bounded by ``sync.timeout_s``."""
        start = time.monotonic()
        try:
            result = self.pusher.complete(rnd, tensors, on_sent=sent.set)
        except BaseException as e:  # handed to the loop's thread by wait()
            self._push_error = e
            return
        finally:
            sent.set()
        self._push_done = {
            "timing/weight_sync_s": time.monotonic() - start,
            "sync/failed_members": float(len(result.failed)),
            **check_probe(probe, result.probes, result.version, self.cfg.trainer.health),
        }

    def take_results(self) -> dict[str, float]:
        """The metrics of the last push that ended, not yet returned by :meth:`push` (the
        run's final push: no push follows to collect them)."""
        done, self._push_done = self._push_done, {}
        return done

    def wait(self) -> None:
        """Wait for the push in flight, if any; its failure (not a member's: those drop the
        member) is raised here, in the loop's thread."""
        if self._push_thread is not None:
            thread = self._push_thread
            self._wait_logged(lambda s: thread.join(s) or not thread.is_alive(), "done")
            self._push_thread = None
        if self._push_error is not None:
            error, self._push_error = self._push_error, None
            # Named with its type: a KeyError's text alone is the bare key.
            raise RuntimeError(f"weight push failed: {type(error).__name__}: {error}") from error

    def _wait_logged(self, wait: Callable[[float], bool], what: str) -> None:
        """``wait(seconds)`` (true once it ended) in rounds of :data:`WAIT_LOG_S`, saying how
        long the push has taken after each: its every wait is bounded by
        ``sync.timeout_s``, but a push of many buckets may take minutes."""
        start = time.monotonic()
        while not wait(WAIT_LOG_S):
            log.info(
                "waiting for the push of version %d to be %s: %.0fs so far (sync.timeout_s "
                "bounds each of its waits)",
                self.pushing_version,
                what,
                time.monotonic() - start,
            )

    def serve_catchups(self) -> None:
        """Late or restarted servers get the current weights (not while a push is in
        flight: the coordinator's version is not yet the pushed weights'). One server a
        call: the other learner ranks wait meanwhile in a collective, which rank 0's
        keepalives between calls hold within the process group's timeout; several
        catch-ups in a row (every server after a learner restart) could outlast it."""
        if self._push_thread is not None and self._push_thread.is_alive():
            return
        if self.pushed and self.coordinator.pending_catchups():
            self.wait()
            self.pusher.serve_catchups(self.pushed, at_most=1)
