"""The start-up timeline: roles mark phases into one file, the launcher's summary shows
seconds since launch; a rollout server pins itself and its children once its engine is up;
``rollout.enforce_eager: auto`` skips compilation where it cannot pay back."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref

import pytest

from asyncrl.config import load_config
from asyncrl.launch import startup
from rollout_servers.affinity import cpus_from_env, pin_tree
from rollout_servers.main import eager_engine, inline_engine


def test_marks_from_several_processes_make_one_table(tmp_path):
    t0 = startup.begin(tmp_path)
    code = (
        "import sys; from pathlib import Path; from asyncrl.launch import startup; "
        "[startup.mark(Path(sys.argv[1]), sys.argv[2], e) for e in ('started', 'engine_ready')]"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"rollout-{i}"])
        for i in range(4)
    ]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    startup.mark(tmp_path, "learner", "first_step")
    startup.mark(tmp_path, "learner", "first_step")  # a restarted learner: the first counts
    events = startup.read(tmp_path)
    assert len(events) == 1 + 4 * 2 + 2  # every line whole: appends did not interleave
    times = startup.first_times(events)
    assert all(0 <= t < time.time() - t0 + 1 for t in times.values())
    assert times[("learner", "first_step")] == min(
        e["t"] - t0 for e in events if e["role"] == "learner"
    )
    table = startup.startup_table(events)
    assert table.startswith("start-up, seconds since launch:")
    assert "rollout-3  started" in table and "engine ready" in table
    assert table.splitlines()[-1].startswith("  launch to first learner step: ")


def test_a_timeline_without_launch_counts_from_its_first_event(tmp_path):
    path = tmp_path / startup.STARTUP_FILE
    lines = [
        {"role": "learner", "event": "started", "t": 100.0},
        {"role": "learner", "event": "first_step", "t": 112.5},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    table = startup.startup_table(startup.read(tmp_path))
    assert "learner  started 0.0, first step 12.5" in table
    assert "launch to first learner step: 12.5s" in table
    assert startup.startup_table([]) == ""


def test_pin_tree_pins_this_process_and_its_children():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable cores")
    before = os.sched_getaffinity(0)
    core = min(before)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pin_tree({core}) >= 2  # this process's threads and the child's
        assert os.sched_getaffinity(child.pid) == {core}
        assert os.sched_getaffinity(0) == {core}
    finally:
        child.kill()
        child.wait()
        for tid in os.listdir("/proc/self/task"):  # every thread back, not only this one
            os.sched_setaffinity(int(tid), before)


def test_cpus_from_env(monkeypatch):
    monkeypatch.delenv("ASYNCRL_PIN_CPUS", raising=False)
    assert cpus_from_env() is None
    monkeypatch.setenv("ASYNCRL_PIN_CPUS", "1,3")
    assert cpus_from_env() == {1, 3}
    monkeypatch.setenv("ASYNCRL_PIN_CPUS", "1|3")
    with pytest.raises(ValueError, match="ASYNCRL_PIN_CPUS='1|3'.*commas"):
        cpus_from_env()


@pytest.mark.parametrize(
    ("overrides", "eager"),
    [
        ([], True),  # CPU
        (["trainer.device=cuda", "trainer.total_training_steps=1000"], False),
        (["trainer.device=cuda", "trainer.total_training_steps=50"], True),
        (["trainer.device=cuda", "rollout.enforce_eager=true"], True),
        (["rollout.enforce_eager=false"], False),
    ],
)
def test_enforce_eager_auto(overrides, eager):
    assert eager_engine(load_config(None, overrides)) is eager


@pytest.mark.parametrize(
    ("overrides", "inline"),
    [
        ([], True),  # CPU, one worker, keep mode
        (["rollout.sync_mode=abort"], False),
        (["rollout.tensor_model_parallel_size=2"], False),
        (["trainer.device=cuda"], False),
        (["trainer.device=cuda", "rollout.inline_engine=true"], True),
        (["rollout.inline_engine=false"], False),
    ],
)
def test_inline_engine_auto(overrides, inline):
    assert inline_engine(load_config(None, overrides)) is inline


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # only the cyclic collector frees it


def test_a_roles_loop_runs_with_its_start_up_heap_out_of_the_collectors_scans():
    """What exists on entry is frozen (a full collection does not look at it, so a cycle
    dropped inside stays); on exit it is the collector's again and the cycle is freed."""
    gc.collect()
    before = gc.get_freeze_count()
    kept = [_Cycle() for _ in range(100)]
    refs = [weakref.ref(c) for c in kept]
    with startup.startup_heap_frozen():
        assert gc.get_freeze_count() >= before + 100
        kept.clear()
        gc.collect()
        assert sum(r() is not None for r in refs) == 100  # frozen: not scanned
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_a_roles_collector_metrics_count_its_frozen_heap_and_its_collection_time():
    """``<role>/gc_frozen_objects`` is what the loop's freeze keeps out of the scans (0
    outside it), and ``<role>/gc_s`` grows with every collection once a loop has run."""
    with startup.startup_heap_frozen():
        inside = startup.collector_metrics("learner")
        for _ in range(3):
            gc.collect()
        after = startup.collector_metrics("learner")
    assert inside["learner/gc_frozen_objects"] > 1000
    assert after["learner/gc_s"] > inside["learner/gc_s"]
    assert startup.collector_metrics("rollout")["rollout/gc_frozen_objects"] == 0
