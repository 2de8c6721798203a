"""The benchmarks' shared repetition helpers: interleaving order, the odd-count rule, and
the median/min/max of per-repetition ratios against hand-computed values."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import common
from benchmarks.common import (
    RatioStats,
    format_ratio,
    hardware,
    headline,
    interleaved_ratio,
    paired_ratio,
    quick_note,
    versions,
)


def _recorder(values: list[float], calls: list[str], side: str):
    """A side that logs each call and returns the next of ``values``."""
    it = iter(values)

    def measure() -> float:
        calls.append(side)
        return next(it)

    return measure


def test_sides_alternate_which_goes_first_each_repetition():
    calls: list[str] = []
    real = _recorder([1.0] * 5, calls, "real")
    baseline = _recorder([1.0] * 5, calls, "base")
    interleaved_ratio(real, baseline, 5)
    pairs = [tuple(calls[i : i + 2]) for i in range(0, len(calls), 2)]
    assert pairs == [
        ("real", "base"),
        ("base", "real"),
        ("real", "base"),
        ("base", "real"),
        ("real", "base"),
    ]


def test_ratios_are_paired_per_repetition_with_median_min_max():
    calls: list[str] = []
    # repetition:      0    1    2    3    4
    real = [10.0, 6.0, 9.0, 4.0, 8.0]
    base = [10.0, 12.0, 10.0, 5.0, 4.0]
    stats = interleaved_ratio(_recorder(real, calls, "r"), _recorder(base, calls, "b"), 5)
    assert stats.real == real and stats.baseline == base
    assert stats.ratios == [1.0, 0.5, 0.9, 0.8, 2.0]
    assert (stats.median, stats.min, stats.max, stats.reps) == (0.9, 0.5, 2.0, 5)
    # The median of the pairs, not the ratio of the two sides' medians (8 / 10 = 0.8).
    assert stats.median != pytest.approx(0.8)
    record = json.loads(json.dumps(stats.to_json()))
    assert record == {
        "reps": 5,
        "real": real,
        "baseline": base,
        "ratios": [1.0, 0.5, 0.9, 0.8, 2.0],
        "median": 0.9,
        "min": 0.5,
        "max": 2.0,
    }


def test_one_repetition_is_its_own_median():
    stats = interleaved_ratio(lambda: 3.0, lambda: 4.0, 1)
    assert (stats.ratios, stats.median, stats.min, stats.max) == ([0.75], 0.75, 0.75, 0.75)


@pytest.mark.parametrize(("reps", "fix"), [(0, "use 1"), (-3, "use 1"), (2, "use 3"), (4, "use 5")])
def test_an_even_or_non_positive_count_is_refused_with_the_fix(reps, fix):
    calls: list[str] = []
    with pytest.raises(ValueError, match=f"odd count of at least 1, got {reps}: {fix}"):
        interleaved_ratio(_recorder([], calls, "r"), _recorder([], calls, "b"), reps)
    assert calls == []  # refused before measuring anything


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_measurement_that_is_not_a_positive_rate_is_refused(bad):
    with pytest.raises(ValueError, match="baseline measurement .* not a positive rate"):
        interleaved_ratio(lambda: 1.0, lambda: bad, 3)


def test_format_and_headline_print_median_and_spread(capsys):
    ratios = [0.871, 0.8, 0.934]
    stats = RatioStats([1.0] * 3, [1.0] * 3, ratios, median=0.871, min=0.8, max=0.934)
    assert format_ratio(stats) == "0.87 (min 0.80, max 0.93, 3 reps)"
    headline("weight sync real/raw GB/s at bucket 32 MB (goal >= 0.8)", stats)
    headline("a deterministic figure", 1.23456)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "weight sync real/raw GB/s at bucket 32 MB (goal >= 0.8): 0.87 (min 0.80, max 0.93, 3 reps)",
        "a deterministic figure: 1.235",
    ]
    one = format_ratio(interleaved_ratio(lambda: 1.0, lambda: 2.0, 1))
    assert one == "0.50 (min 0.50, max 0.50, 1 rep)"


def test_paired_ratio_pairs_runs_already_taken():
    stats = paired_ratio([10.0, 6.0, 9.0], [10.0, 12.0, 10.0])
    assert (stats.ratios, stats.median, stats.min, stats.max) == ([1.0, 0.5, 0.9], 0.9, 0.5, 1.0)
    with pytest.raises(ValueError, match="paired repetitions"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="paired repetitions"):
        paired_ratio([], [])
    with pytest.raises(ValueError, match="real measurement 0.0 of repetition 1"):
        paired_ratio([1.0, 0.0], [1.0, 1.0])


def test_a_quick_single_repetition_says_it_is_not_a_measurement(capsys):
    one = paired_ratio([1.5], [1.0])
    assert quick_note(True, 1) == "quick: not a measurement"
    assert quick_note(True, 3) is None and quick_note(False, 1) is None
    headline("asyncrl / TRL samples/s", one, quick_note(True, 1))
    assert capsys.readouterr().out == (
        "asyncrl / TRL samples/s: 1.50 (min 1.50, max 1.50, 1 rep (quick: not a measurement))\n"
    )


def test_versions_cover_the_model_stack_and_record_a_missing_package_as_null():
    for name in ("torch", "transformers", "vllm", "trl", "peft"):
        assert name in common.PACKAGES
    got = versions(("numpy", "no-such-package-asyncrl-bench"))
    assert got["numpy"] and got["no-such-package-asyncrl-bench"] is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_hardware_records_the_cores_at_start_as_well_as_the_pinned_ones():
    start = os.sched_getaffinity(0)
    at_import = common.AFFINITY_AT_START
    assert at_import
    one = {min(start)}
    try:
        os.sched_setaffinity(0, one)  # as bench_learner pins itself for a case
        info = hardware()
    finally:
        os.sched_setaffinity(0, start)
    assert info["cpus_usable"] == len(at_import) and info["affinity_at_start"] == at_import
    assert info["cpus_pinned"] == 1 and info["affinity_pinned"] == sorted(one)


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_results_are_strict_json_when_a_figure_is_not_a_number(tmp_path):
    """A target never reached (``time_to_target_s``), a mean of nothing: NaN was written as
    a bare ``NaN`` that jq and JavaScript refuse. It is null now, in the results and in a
    partial dump."""
    from benchmarks.throughput import summarise

    figures = {"time_to_target_s": float("nan"), "peak": float("inf"), "rates": [1.0, -1e999]}
    json_path, _ = common.write_results(
        "nan_check", tmp_path, figures=figures, config={}, plot=lambda fig: None
    )
    saved = _strict(json_path.read_text())
    assert saved["figures"] == {"time_to_target_s": None, "peak": None, "rates": [1.0, None]}
    rep = {"samples_per_s": 2.0, "time_to_target_s": float("nan")}
    summary = summarise([{"lag0": rep, "lag1": rep}])
    assert _strict(common.json_text(summary))["lag1"]["time_to_target_s"] is None
