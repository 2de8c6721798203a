"""The repetition logic of the launch-based benchmarks, without launching anything:
throughput's round-robin and per-repetition ratios, bench_lora's interleaved arms, and the
figures filter_groups reads from a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_lora, filter_groups, throughput


# ----------------------------------------------------------------------- throughput
def test_modes_run_round_robin_in_alternating_order():
    names = ["lag0", "lag2", "lag0-shared"]
    assert throughput.round_robin(names, 0) == names
    assert throughput.round_robin(names, 1) == ["lag0-shared", "lag2", "lag0"]
    assert throughput.round_robin(names, 2) == names


def test_ratio_to_sync_is_per_repetition_against_that_repetitions_best_sync():
    nan = float("nan")
    per_rep = [  # repetition 1 ran on a slower machine: both modes slower
        {"lag0": {"samples_per_s": 10.0, "t": 5.0}, "lag2": {"samples_per_s": 15.0, "t": nan}},
        {"lag0": {"samples_per_s": 5.0, "t": 7.0}, "lag2": {"samples_per_s": 6.0, "t": 3.0}},
        {"lag0": {"samples_per_s": 10.0, "t": nan}, "lag2": {"samples_per_s": 14.0, "t": 4.0}},
    ]
    modes = throughput.summarise(per_rep)
    lag2 = modes["lag2"]
    assert lag2["ratio_to_sync_stats"]["ratios"] == pytest.approx([1.5, 1.2, 1.4])
    # The median of the pairs (1.4), not the ratio of the medians (14 / 10).
    assert lag2["ratio_to_sync"] == pytest.approx(1.4)
    stats = throughput.ratio_stats(lag2)
    assert (stats.min, stats.max, stats.reps) == pytest.approx((1.2, 1.5, 3))
    assert modes["lag0"]["ratio_to_sync_stats"]["ratios"] == [1.0, 1.0, 1.0]
    assert lag2["samples_per_s"] == 14.0 and lag2["t"] == 3.5  # medians, NaN left out
    assert len(lag2["reps"]) == 3


def test_the_time_to_the_target_says_how_many_runs_reached_it():
    """Found by a review: the median time to the target is over the runs that reached it,
    and the table showed one run's time as the mode's when two of three never did."""
    nan = float("nan")
    times = {"lag0": [30.0, 34.0, 32.0], "lag2": [nan, 20.0, nan]}
    per_rep = [
        {name: {"samples_per_s": 10.0, "time_to_target_s": t[i]} for name, t in times.items()}
        for i in range(3)
    ]
    modes = throughput.summarise(per_rep)
    assert modes["lag2"]["time_to_target_reached"] == 1
    assert modes["lag2"]["time_to_target_s"] == 20.0
    rows = throughput.table(
        "tiny", {"modes": modes, "phases": {"sync@1": {"sync_s": 0.1, "bytes": 1e6}}}
    )
    lag0, lag2 = rows.splitlines()[1:3]
    assert "20 (1/3)" in lag2 and "32" in lag0 and "/3)" not in lag0


def test_the_better_sync_layout_of_each_repetition_is_the_baseline():
    per_rep = [
        {"lag0": {"samples_per_s": 10.0}, "lag0-shared": {"samples_per_s": 4.0}},
        {"lag0": {"samples_per_s": 3.0}, "lag0-shared": {"samples_per_s": 6.0}},
        {"lag0": {"samples_per_s": 8.0}, "lag0-shared": {"samples_per_s": 2.0}},
    ]
    got = throughput.summarise(per_rep)["lag0"]["ratio_to_sync_stats"]["ratios"]
    assert got == pytest.approx([1.0, 0.5, 1.0])


# ----------------------------------------------------------------------- bench_lora
class _FakeWorker:
    """A learner process that answers with the next of its step times."""

    calls: list[str] = []

    def __init__(self, _target: Any, _base: str, rank: int, _steps: int) -> None:
        self.which = "lora" if rank else "full"
        self.times = iter({"full": [2.0, 4.0, 2.0], "lora": [1.0, 1.0, 2.0]}[self.which])
        self.info = {"trainable_params": rank or 100}

    def ask(self) -> float:
        _FakeWorker.calls.append(self.which)
        return next(self.times)

    def close(self) -> dict[str, float]:
        return {"peak_rss_mb": 1.0}


def test_learner_arms_are_interleaved_with_a_ratio_per_repetition(monkeypatch):
    _FakeWorker.calls = []
    monkeypatch.setattr(bench_lora, "Worker", _FakeWorker)
    got = bench_lora.learner_arms("base", 16, 1, 3)
    assert _FakeWorker.calls == ["lora", "full", "full", "lora", "lora", "full"]
    assert got["speedup"]["ratios"] == pytest.approx([2.0, 4.0, 1.0])  # full s / LoRA s
    assert got["speedup"]["median"] == pytest.approx(2.0)
    assert got["full"]["step_s_reps"] == [2.0, 4.0, 2.0] and got["full"]["step_s"] == 2.0
    assert got["lora"]["trainable_params"] == 16 and got["lora"]["peak_rss_mb"] == 1.0


def test_generation_arms_are_interleaved_with_a_ratio_per_repetition(monkeypatch):
    rates = {"merged": iter([100.0, 50.0, 100.0]), "adapter": iter([30.0, 25.0, 40.0])}
    order: list[str] = []

    def fake(_target: Any, model: str, adapter: str | None, *_: Any) -> dict[str, float]:
        which = "adapter" if adapter else "merged"
        order.append(which)
        return {"tokens_per_s": next(rates[which])}

    monkeypatch.setattr(bench_lora, "in_process", fake)
    got = bench_lora.generation_arms("base", "ad", "merged", 16, 4, 8, 3)
    assert order == ["adapter", "merged", "merged", "adapter", "adapter", "merged"]
    assert got["ratio"]["ratios"] == pytest.approx([0.3, 0.5, 0.4])
    assert got["ratio"]["median"] == pytest.approx(0.4)
    assert got["merged"]["tokens_per_s"] == 100.0 and len(got["adapter"]["samples"]) == 3


# ----------------------------------------------------------------------- filter_groups
def _run(tmp: Path, waits: list[float], updates: list[float]) -> Path:
    records: list[dict[str, Any]] = []
    for i, (w, u) in enumerate(zip(waits, updates, strict=True)):
        records.append(
            {
                "step": i + 1,
                "time": 100.0 + i,
                "loss/pg": 0.0,
                "batch/sequences": 128.0,
                "batch/groups": 16.0,
                "batch/response_tokens": 256.0,
                "prompt_length/mean": 20.0,
                "lag/mean": 0.0,
                "timing/wait_batch_s": w,
                "timing/update_s": u,
            }
        )
    records.append({"step": len(waits), "time": 110.0, "val/score": 0.5})
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp


def test_filter_figures_average_the_update_over_the_steps_the_wait_uses(tmp_path):
    # The first three steps (engine start-up) are left out of both means.
    run = _run(tmp_path, [20.0, 1.0, 1.0, 0.1, 0.3], [9.0, 9.0, 9.0, 0.2, 0.4])
    got = filter_groups.figures(run)
    assert got["wait_batch_s_mean"] == pytest.approx(0.2)
    assert got["update_s_mean"] == pytest.approx(0.3)


def test_filter_arms_pair_the_update_by_repetition():
    on = [{"update_s_mean": 0.2}, {"update_s_mean": 0.3}, {"update_s_mean": 0.5}]
    off = [{"update_s_mean": 0.1}, {"update_s_mean": 0.3}, {"update_s_mean": 0.25}]
    got = filter_groups.paired(on, off, "update_s_mean")
    assert got["ratios"] == pytest.approx([2.0, 1.0, 2.0])
    assert (got["median"], got["min"], got["max"]) == pytest.approx((2.0, 1.0, 2.0))
    assert filter_groups.summary(on)["update_s_mean"]["median"] == pytest.approx(0.3)


def test_throughput_runs_modes_round_robin_and_heads_with_the_spread(monkeypatch, tmp_path, capsys):
    """``main`` with the phases and launches faked: the run order, each repetition's run
    directory, and a headline of per-repetition ratios marked as quick."""
    from types import SimpleNamespace

    from asyncrl.config import load_config

    rates = iter([10.0, 15.0, 12.0, 6.0, 10.0, 14.0])  # lag0, lag2; lag2, lag0; lag0, lag2
    launched: list[str] = []

    def fake_run(_config: str, overrides: list[str], out_dir: Path) -> dict[str, float]:
        launched.append(str(out_dir.relative_to(tmp_path)))
        # One version per step (a review: at the demo's push every second step, lag 0
        # generated while the step before trained, and was called synchronous).
        assert load_config(_config, overrides).staleness.sync_every == 1
        return {"samples_per_s": next(rates), "time_to_target_s": float("nan")}

    phases = {
        "generate@1": {"concurrency": {"1": {"tokens_per_s": 100.0}}},
        "train@0": {"tokens_per_s": 50.0},
        "sync@1": {"sync_s": 0.5, "bytes": 1e6},
    }
    monkeypatch.setattr(throughput, "_ensure_model", lambda name: "artifacts/models/tiny-demo")
    monkeypatch.setattr(throughput, "measure_phases", lambda *_: phases)
    monkeypatch.setattr(throughput, "calibrate", lambda *_a, **_k: SimpleNamespace(lengths=[]))
    monkeypatch.setattr(throughput, "predict", lambda *_: {"samples_per_s": 12.0})
    monkeypatch.setattr(throughput, "run_pipeline", fake_run)
    throughput.main(["--quick", "--reps", "3", "--out", str(tmp_path)])
    assert launched == [
        f"runs/tiny/{name}/{rep}"
        for rep, name in [
            (0, "lag0"),
            (0, "lag2"),
            (1, "lag2"),
            (1, "lag0"),
            (2, "lag0"),
            (2, "lag2"),
        ]
    ]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # lag2/lag0 per repetition: 15/10, 12/6, 14/10
    assert last == "throughput tiny lag2/sync samples per s: 1.50 (min 1.40, max 2.00, 3 reps)"
    record = json.loads((tmp_path / "throughput.json").read_text())
    lag2 = record["figures"]["tiny"]["modes"]["lag2"]
    assert lag2["ratio_to_sync_stats"]["ratios"] == pytest.approx([1.5, 2.0, 1.4])
    assert record["config"]["reps"] == 3
