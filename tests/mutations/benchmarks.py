"""Mutation rows for the benchmarks' own figures (see :mod:`tests.mutations`)."""

from __future__ import annotations

from tests.mutations.row import Mutation

ROWS = (
    Mutation(
        "the fault simulation fails when it finds violations",
        "it exits 0 whatever it found",
        "benchmarks/fault_sim.py",
        "    return 1 if failing else 0  # a run that found violations is not a success",
        "    return 0",
        ("tests/test_fault_sim.py",),
    ),
    Mutation(
        "a run's health alarms are the last step's counters",
        "they are read from the run's closing record, which carries none",
        "benchmarks/staleness_stats.py",
        '        "health_alarms": sum(v for k, v in steps[-1].items() if k.startswith("health/")),',
        '        "health_alarms": sum(v for k, v in records[-1].items() if k.startswith("health/")),',
        ("tests/test_staleness_study.py::test_run_figures_read_the_curve_threshold_and_rates",),
    ),
    Mutation(
        "the t interval is t's past 10 degrees of freedom",
        "from 11 degrees of freedom the normal's 1.96 is taken",
        "benchmarks/staleness_stats.py",
        "    if df > max(_T95):",
        "    if df > 10:",
        ("tests/test_staleness_study.py::test_mean_ci_is_the_t_interval",),
    ),
    Mutation(
        "the throughput sweep's lag 0 is synchronous",
        "the sweep keeps the config's push every second step, so lag 0 overlaps",
        "benchmarks/throughput.py",
        '        "staleness.sync_every=1",\n',
        "",
        (
            "tests/test_bench_repeats.py::"
            "test_throughput_runs_modes_round_robin_and_heads_with_the_spread",
        ),
    ),
    Mutation(
        "both sides of the TRL comparison run on the same two cores",
        "TRL runs unpinned with a thread per core of the machine",
        "benchmarks/vs_trl.py",
        '        "--threads", str(len(cores)), "--seed", str(seed), "--out", str(out),',
        '        "--threads", str(os.cpu_count()), "--seed", str(seed), "--out", str(out),',
        ("tests/test_bench_vs_trl.py::test_both_sides_run_on_the_same_two_cores",),
    ),
    Mutation(
        "the time to the target says how many runs reached it",
        "the median of the runs that reached it reads as the mode's",
        "benchmarks/throughput.py",
        '            if key == "time_to_target_s" and reached is not None and reached < runs:',
        "            if False:",
        ("tests/test_bench_repeats.py::test_the_time_to_the_target_says_how_many_runs_reached_it",),
    ),
    Mutation(
        "benchmark results are strict JSON",
        "a target never reached is written as a bare NaN that strict readers refuse",
        "benchmarks/common.py",
        "    if isinstance(value, float) and not math.isfinite(value):\n        return None\n",
        "",
        ("tests/test_bench_common.py::test_results_are_strict_json_when_a_figure_is_not_a_number",),
    ),
)
