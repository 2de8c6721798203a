"""The buffer service's own bookkeeping (:mod:`buffer.service_stats`) and the settings
:meth:`BufferService.from_config` passes on. No sockets: callers give the clock."""

from __future__ import annotations

import logging

from asyncrl.config import load_config
from buffer.service import BufferService
from buffer.service_stats import PAUSE_WARN_S, ServiceStats, summary


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_long_pause_is_warned_at_each_doubling_and_a_new_pause_starts_over(caplog):
    """A full buffer nobody empties must say how long it has been full (it read as idle:
    every summary line showed only its size)."""
    stats = ServiceStats()
    stats.start(0.0)
    stats.set_paused(True, 10.0)
    with caplog.at_level(logging.WARNING, logger="buffer.service_stats"):
        for t in (10.0 + PAUSE_WARN_S - 1, 10.0 + PAUSE_WARN_S, 10.0 + 1.5 * PAUSE_WARN_S):
            stats.check_pause(t)
        assert len(_warnings(caplog)) == 1
        assert f"buffer full for {PAUSE_WARN_S:.0f}s" in _warnings(caplog)[0]
        stats.check_pause(10.0 + 2 * PAUSE_WARN_S)
        assert len(_warnings(caplog)) == 2
        stats.set_paused(False, 10.0 + 2 * PAUSE_WARN_S + 1)
        stats.check_pause(10.0 + 10 * PAUSE_WARN_S)  # not paused: nothing to say
        stats.set_paused(True, 1000.0)
        stats.check_pause(1000.0 + PAUSE_WARN_S)  # a new pause warns from the start
        assert len(_warnings(caplog)) == 3


def test_the_summary_line_says_how_long_reading_was_paused():
    stats = ServiceStats()
    stats.start(0.0)
    stats.set_paused(True, 1.0)
    stats.set_paused(False, 8.0)
    assert summary(stats.metrics(9.0)).endswith("paused=7s")
    assert "paused" not in summary(ServiceStats().metrics(1.0))


def test_the_queue_bound_comes_from_the_config():
    cfg = load_config(None, ["buffer.queued_messages=16"])
    assert BufferService.from_config(cfg).rcvhwm == 16
    assert BufferService.from_config(load_config(None, [])).rcvhwm == 1000
