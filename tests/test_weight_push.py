"""Rank 0's wait for the push in flight (:class:`learner.weight_push.WeightPushes`): every
wait of a push is bounded by ``sync.timeout_s``, but a push of many buckets may take
minutes; the learner says how long it has waited instead of waiting in silence."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from learner import weight_push
from learner.weight_push import WeightPushes


class SlowPusher:
    """The broadcast ends when :attr:`release` is set (a push of many buckets)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def begin(self, tensors: dict) -> SimpleNamespace:
        return SimpleNamespace(version=7)

    def complete(self, rnd, tensors: dict, on_sent) -> SimpleNamespace:
        self.release.wait(10)
        on_sent()
        return SimpleNamespace(failed=[], probes={}, version=rnd.version)


class Coordinator:
    def adopt(self, target: int) -> bool:
        return False  # not a replay: the push goes out


@pytest.mark.parametrize("overlap", [True, False])
def test_a_long_push_is_waited_for_with_a_line_saying_how_long(overlap, monkeypatch, caplog):
    cfg = load_config("configs/cpu_demo.yaml", [f"sync.overlap_push={str(overlap).lower()}"])
    monkeypatch.setattr(weight_push, "WAIT_LOG_S", 0.1)
    pusher = SlowPusher()
    pushes = WeightPushes(cfg, Coordinator(), pusher)
    timer = threading.Timer(0.45, pusher.release.set)
    timer.start()
    with caplog.at_level(logging.INFO, logger="learner.weight_push"):
        pushes.push({"w": 0}, target=7)  # without overlap: waits for the send here
        pushes.wait()  # with overlap: here
    timer.cancel()
    lines = [r.getMessage() for r in caplog.records if "waiting for the push" in r.getMessage()]
    assert len(lines) >= 2, lines  # 0.45 s in rounds of 0.1 s
    assert "version 7 to be " + ("done" if overlap else "sent") in lines[0]
    assert not pushes._push_thread
    # The run's last push: no later push collects its results, the run's end takes them
    # (a review found the final push's metrics never logged).
    assert pushes.take_results()["timing/weight_sync_s"] >= 0.4
    assert pushes.take_results() == {}


def test_catch_ups_are_served_one_a_call_so_the_other_ranks_hear_between_them():
    """Every server needs a catch-up after a learner restart; served back to back they kept
    the other learner ranks in one collective for all of them, past its timeout. One a
    call, rank 0's loop sends its keepalive between them."""
    cfg = load_config("configs/cpu_demo.yaml", [])

    class Waiting(Coordinator):
        def __init__(self) -> None:
            self.pending = ["s0", "s1", "s2"]

        def pending_catchups(self) -> list[str]:
            return list(self.pending)

    class Served:
        def serve_catchups(self, tensors: dict, at_most: int | None = None) -> list:
            served = waiting.pending[:at_most]
            del waiting.pending[: len(served)]
            calls.append(served)
            return served

    waiting, calls = Waiting(), []
    pushes = WeightPushes(cfg, waiting, Served())
    pushes.pushed = {"w": 0}
    for _ in range(4):
        pushes.serve_catchups()
    assert calls == [["s0"], ["s1"], ["s2"]]


def test_a_push_that_fails_on_the_learners_side_is_raised_in_the_loop_naming_its_cause():
    """The pusher closes such a round and raises its error (asyncrl.sync.sender): the
    loop's next wait raises it, with its type (a KeyError's text is the bare key)."""
    cfg = load_config("configs/cpu_demo.yaml", [])

    class Failing(SlowPusher):
        def complete(self, rnd, tensors: dict, on_sent) -> SimpleNamespace:
            raise KeyError("layers.0.proj.weight")

    pushes = WeightPushes(cfg, Coordinator(), Failing())
    pushes.push({"w": 0}, target=7)
    with pytest.raises(RuntimeError, match="weight push failed: KeyError: 'layers.0.proj"):
        pushes.wait()
    pushes.wait()  # raised once: the next push may begin
