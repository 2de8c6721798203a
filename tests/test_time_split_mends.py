"""Mends of the run summary's time split, the progress command and its plot found by a
review, each with the fault that showed it:

- the servers' waits in a step record are their last heartbeat's, yet the split divided
  their change by the time between the records: a fast run read "generating 0%, waiting
  for tasks 100%, paused 11%, scorer 1%" (112%) while tokens rose. The servers now report
  their own clock (``rollout/uptime_s``) in the same snapshot, and the split divides by it;
- a sync while a server is idle counted as a wait for tasks and as a pause at once: the
  server now counts the second once (the sync's), and the split never adds past 100%;
- ``python -m asyncrl.launch.progress`` of a resumed run summed every launch: the downtime
  read as "other" and "step 1 to end" spanned it; it now summarizes the latest launch;
- the lag plot dropped ``lag/hist_ge8``: lags of 8 or more now have their "8+" bar.

Synthetic records (as ``tests/test_launch_progress.py``) and a hand-driven clock."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from asyncrl.launch.time_split import time_split
from learner.metrics import rollout_summary
from tests.standins.chat import CharTokenizer

STEP = {"timing/step_s": 0.5, "timing/train_s": 0.4, "timing/wait_batch_s": 0.1}


def _record(t: float, uptime: float | None, task: float, pause: float) -> dict:
    """A step record at ``t`` whose two servers' heartbeat said ``uptime`` (summed)."""
    r = STEP | {"time": t, "rollout/task_wait_s": task, "rollout/sync_pause_s": pause}
    r |= {"rollout/score_wait_s": 0.0, "rollout/servers_reporting": 2.0}
    return r if uptime is None else r | {"rollout/uptime_s": uptime}


def _percents(line: str) -> list[int]:
    return [int(p) for p in re.findall(r"(\d+)%", line)]


def test_the_servers_waits_are_shares_of_their_own_clock_not_the_records():
    """Four steps half a second apart, the servers' heartbeats all arriving between the
    first two (a heartbeat every 2 s): 4 server-seconds (50% waiting for tasks, 10% paused)
    over 1.5 s of records read 67% waiting, 13% paused before."""
    records = [_record(100.0, 100.0, 30.0, 5.0)]
    records += [_record(100.0 + 0.5 * k, 104.0, 32.0, 5.4) for k in (1, 2, 3)]
    split = time_split(records)
    assert split[1] == (
        "rollout servers (mean): generating 40%, waiting for tasks 50%, paused for weight syncs 10%"
    ), split
    # A server that started over (its uptime and waits began again) spans no time: the
    # pair around it is left out, the others pooled.
    restarted = [*records, _record(102.0, 60.0, 10.0, 1.0), _record(102.5, 64.0, 12.0, 1.0)]
    assert time_split(restarted)[1] == (
        "rollout servers (mean): generating 45%, waiting for tasks 50%, paused for weight syncs 5%"
    )
    # Servers that do not report their uptime (older runs): the records' time, as before.
    old = [{k: v for k, v in r.items() if k != "rollout/uptime_s"} for r in records]
    assert "waiting for tasks 67%, paused for weight syncs 13%" in time_split(old)[1]


def test_the_shares_never_add_past_the_whole():
    """Servers that counted a sync while idle twice: waiting for tasks 90% of the time and
    paused 30% read 120% before; the sync keeps its seconds, the wait for tasks the rest."""
    records = [_record(float(t), None, 2 * 0.9 * t, 2 * 0.3 * t) for t in range(10)]
    line = time_split(records)[1]
    assert line == (
        "rollout servers (mean): generating 0%, waiting for tasks 70%, paused for weight syncs 30%"
    )
    # Rounded shares add up: three thirds read 100% in all, not 99%, and never 101%.
    thirds = [_record(float(t), 6.0 * t, 2.0 * t, 2.0 * t) for t in range(4)]
    assert sum(_percents(time_split(thirds)[1])) == 100
    for line in time_split(thirds)[:1] + time_split(records)[:2]:
        assert sum(_percents(line)) <= 100, line


def test_a_sync_while_idle_is_counted_once_and_the_snapshot_has_its_clock(monkeypatch):
    """A server idle for 10 s, paused by a 3 s sync within that wait, then scoring for
    4 s with a 1 s sync within that: 7 s waiting for tasks and 3 s waiting for the scorer
    (13 s and 4 s before), so that the waits add up to its uptime of 14 s at most."""
    from rollout_servers import server_stats

    now = [0.0]
    monkeypatch.setattr(server_stats, "time", SimpleNamespace(monotonic=lambda: now[0]))
    engine = {"rollout/sync_pause_s": 0.0}
    stats = server_stats.ServerStats(CharTokenizer())
    assert stats.snapshot([engine], 0, lambda: engine["rollout/sync_pause_s"])[
        "rollout/uptime_s"
    ] == pytest.approx(0.0, abs=1e-6)
    now[0], engine["rollout/sync_pause_s"] = 5.0, 3.0  # a sync from 2 s to 5 s, idle
    now[0] = 10.0
    stats.busy()
    stats.after_generation.slots(4)
    with stats.after_generation.phase("scoring", 4):
        now[0], engine["rollout/sync_pause_s"] = 12.0, 4.0  # a 1 s sync while scoring
        now[0] = 14.0
        out = stats.snapshot([engine], 4)
    assert out["rollout/uptime_s"] == pytest.approx(14.0)
    assert out["rollout/task_wait_s"] == pytest.approx(7.0)
    assert out["rollout/score_wait_s"] == pytest.approx(3.0)
    waits = ("rollout/task_wait_s", "rollout/sync_pause_s", "rollout/score_wait_s")
    assert sum(out[k] for k in waits) <= out["rollout/uptime_s"] + 1e-9
    assert out["rollout/wait_fraction"] == pytest.approx((7.0 + 4.0) / 14.0)


def test_the_step_record_carries_the_servers_summed_uptime():
    servers = {"r0": {"rollout/uptime_s": 50.0}, "r1": {"rollout/uptime_s": 30.0}}
    assert rollout_summary(servers)["rollout/uptime_s"] == 80.0


def _launch(t: float) -> str:
    return json.dumps({"time": t, "role": "launcher", "event": "launch"}) + "\n"


def test_the_progress_command_summarizes_a_resumed_runs_latest_launch(tmp_path, capsys):
    """Launched at 1000, stopped at step 10, launched again half an hour later: the
    summary read "step 1 to end 2040s" and the learner "other 98%" before; the servers'
    counters began again with the second launch."""
    from asyncrl.launch.progress import main

    def step(s: int, t: float, waits: float) -> dict:
        timing = {"timing/train_s": 1.6, "timing/wait_batch_s": 0.4}
        return _record(t, None, waits, 0.0) | timing | {"step": s, "reward/mean": 0.1}

    first = [step(s, 1000.0 + 2 * s, 40.0 + 2 * s) for s in range(1, 11)]
    second = [step(s, 3000.0 + 2 * (s - 10), 0.4 * (s - 10)) for s in range(10, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + second))
    (tmp_path / "launch.jsonl").write_text(_launch(990.0) + _launch(2990.0) + "{")  # torn
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("launch 2 of 2 (the latest, steps 10-20): "), out
    assert re.search(r"step 1 to end\s+20s", out), out
    assert "learner: training 80%, waiting for batches 20%" in out
    assert "generating 90%, waiting for tasks 10%" in out
    # A latest launch without a step record yet: the one before it, said so.
    (tmp_path / "launch.jsonl").write_text(_launch(990.0) + _launch(5000.0))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("launch 1 of 2 (the latest with a step record; 2 wrote none, "), out


def test_the_lag_plot_has_a_bar_for_lags_of_8_or_more():
    from asyncrl.launch import plots

    records = [{"lag/hist_0": 10.0, "lag/hist_7": 2.0, "lag/hist_ge8": 50.0}]
    assert plots.lag_counts(records) == {0: 10.0, 7: 2.0, 8: 50.0}
    assert plots.lag_labels([0, 7, 8], records) == ["0", "7", "8+"]
    # However the last bucket is named: a histogram 12 wide ends at "12+".
    wide = [{"lag/hist_3": 1.0, "lag/hist_ge12": 4.0}]
    assert plots.lag_labels(list(plots.lag_counts(wide)), wide) == ["3", "12+"]
