"""DAPO's dynamic sampling on the demo: the same run with ``algorithm.filter_groups`` off
and on, interleaved and repeated on this machine.

``python benchmarks/filter_groups.py [--quick] [--steps 120] [--reps 3] [--set KEY=VALUE]``

Per run: trained samples/s, the learner's batch wait (mean ``timing/wait_batch_s`` over
the steps after the warm-up, and the waiting share of that window: the first step's wait
is the engines' start-up, 16-20 s on the demo, which swamps a steady step's 0.07 s), the
learner's update per step (mean ``timing/update_s`` over the same steps: a filter that
trains other groups may change it, and a longer update hides more of the wait), groups
trained with zero variance (``batch/zero_variance_groups``), the share of groups filtered
and prompts dealt per trained group, and the validation curve. Each arm's figures are
summarised as median, min and max over its repetitions; the on/off ratios (trained
samples/s, batch wait and update per step) are paired by repetition, as
``interleaved_ratio`` pairs them. Results in ``results/filter_groups/`` (JSON, a plot of
every run's validation curve against trained samples and seconds); the last line is on/off
in trained samples/s. ``--quick``: three repetitions of 15 steps (``--reps`` as in a full
run).
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.metrics import read_metrics, val_step, validation_rounds  # noqa: E402
from benchmarks.common import (  # noqa: E402
    check_reps,
    headline,
    interleaved_ratio,
    launch_run,
    parse_args,
    spread,
    write_results,
)
from benchmarks.pipeline_stats import WARMUP_STEPS, run_stats  # noqa: E402

NAME = "filter_groups"
CONFIG = "configs/cpu_demo.yaml"
MODEL = "artifacts/models/tiny-demo"
DATA = "artifacts/data/arithmetic"
log = logging.getLogger("benchmarks.filter_groups")


def _extra(p) -> None:
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (120)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each arm (odd)")
    p.add_argument(
        "--skip",
        action="store_true",
        help="the filter-on arm also skips prompts it keeps dropping "
        "(algorithm.filter_groups.skip_uninformative)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted config override for both arms (repeatable), e.g. "
        "staleness.controller=adaptive",
    )


def ensure_demo() -> None:
    """The demo's model and data, built as ``make demo-artifacts`` does if missing."""
    prepare = str(Path(sys.executable).parent / "asyncrl-prepare")
    if not (Path(MODEL) / "config.json").is_file():
        subprocess.run(
            [prepare, "model", "--name", "tiny", "--flatten", "--out", MODEL], check=True
        )
    if not (Path(DATA) / "val.parquet").is_file():
        cmd = [prepare, "data", "--task", "arithmetic", "--out", DATA, "--tokenizer", MODEL]
        subprocess.run(cmd, check=True)


def figures(run: Path) -> dict[str, Any]:
    """One run's figures from its metrics."""
    records = read_metrics(run)
    steps = [r for r in records if "loss/pg" in r]
    vals = validation_rounds(records)  # by the weights measured, not the step recorded at
    per_step = steps[0]["batch/sequences"] if steps else 0.0
    stats = run_stats(run)
    last = records[-1]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steps)  # noqa: E731
    steady = steps[WARMUP_STEPS:]
    return {
        "samples_per_s": stats["samples_per_s"],
        "learner_wait_frac": stats["learner_wait_frac"],
        # Steady steps only, as the rates (run_stats): step 1 waits for the engines.
        "wait_batch_s_mean": statistics.fmean(r["timing/wait_batch_s"] for r in steady),
        # Over the same steps as the wait, so that the two add up to a steady step.
        "update_s_mean": statistics.fmean(r["timing/update_s"] for r in steady),
        "zero_variance_groups_per_step": mean("batch/zero_variance_groups"),
        "filtered_frac_mean": mean("filter/filtered_frac"),
        "prompts_per_trained_group_mean": mean("filter/prompts_per_trained_group"),
        "groups_filtered": steps[-1].get("filter/groups_filtered", 0.0),
        "prompts_skipped": steps[-1].get("filter/prompts_skipped", 0.0),
        # the trained groups that carried a signal (zero-variance ones train nothing)
        "signal_samples_per_s": stats["samples_per_s"]
        * (1 - mean("batch/zero_variance_groups") / steps[0]["batch/groups"]),
        "dropped_filtered": last.get("accounting/train/dropped/filtered", 0.0),
        "unaccounted": last.get("accounting/train/unaccounted", 0.0),
        "val_curve": [
            [val_step(r), val_step(r) * per_step, r["time"] - vals[0]["time"], r["val/score"]]
            for r in vals
        ],
        "val_final": vals[-1]["val/score"] if vals else None,
    }


def _plot(runs: dict[str, list[dict]]):
    def draw(fig) -> None:
        axes = fig.subplots(1, 2)
        for ax, axis, label in ((axes[0], 1, "trained samples"), (axes[1], 2, "seconds")):
            for (name, reps), color in zip(runs.items(), ("C0", "C1"), strict=False):
                for i, res in enumerate(reps):
                    curve = res["val_curve"]
                    xs, ys = [c[axis] for c in curve], [c[3] for c in curve]
                    ax.plot(xs, ys, marker=".", color=color, label=name if i == 0 else None)
            ax.set_xlabel(label)
            ax.set_ylabel("validation score")
        axes[0].legend()
        axes[0].set_title("demo: filter_groups off / on (every repetition)")

    return draw


def paired(on: list[dict[str, Any]], off: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """On/off ratios of one figure, repetition ``i`` of one arm against repetition ``i``
    of the other (run back to back), with their median, min and max."""
    ratios = [a[key] / b[key] for a, b in zip(on, off, strict=True)]
    return {"ratios": ratios, **spread(ratios)}


def summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max over one arm's repetitions of each scalar figure."""
    return {
        key: spread([r[key] for r in reps])
        for key, value in reps[0].items()
        if isinstance(value, (int, float))
    }


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(NAME, (__doc__ or "").split("\n")[0], argv, _extra)
    steps = args.steps or (15 if args.quick else 120)
    reps = check_reps(args.reps)
    ensure_demo()
    common = [f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", *args.set]
    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=4"]
    if args.skip:
        on.append("algorithm.filter_groups.skip_uninformative=true")
    runs: dict[str, list[dict]] = {"filter_on": [], "filter_off": []}  # "off": YAML's false

    def arm(name: str, extra: list[str]) -> float:
        run = launch_run(CONFIG, [*common, *extra], args.out / "runs", f"{name}_{len(runs[name])}")
        res = figures(run)
        runs[name].append(res)
        log.info("%s: %s", name, {k: v for k, v in res.items() if k != "val_curve"})
        return res["samples_per_s"]

    stats = interleaved_ratio(lambda: arm("filter_on", on), lambda: arm("filter_off", []), reps)
    # the learner's batch wait and update, paired by repetition as the throughput ratio is
    waits = paired(runs["filter_on"], runs["filter_off"], "wait_batch_s_mean")
    updates = paired(runs["filter_on"], runs["filter_off"], "update_s_mean")
    json_path, png = write_results(
        NAME,
        args.out,
        figures={
            "samples_per_s_ratio": stats.to_json(),
            "wait_batch_ratio": waits,
            "update_ratio": updates,
            **{name: summary(r) for name, r in runs.items()},
            "runs": runs,
        },
        plot=_plot(runs),
        config={"config": CONFIG, "steps": steps, "on": on, "both": args.set, "reps": reps},
    )
    print(f"results: {json_path}, {png}")
    for name, r in runs.items():
        for label, key in (("batch wait", "wait_batch_s_mean"), ("update", "update_s_mean")):
            w = summary(r)[key]
            print(
                f"{name}: {label} per step {w['median']:.3f} s "
                f"(min {w['min']:.3f}, max {w['max']:.3f})"
            )
    for label, got in (("batch wait", waits), ("update", updates)):
        print(
            f"filter_groups on/off {label} per step: "
            + ", ".join(f"{w:.2f}" for w in got["ratios"])
        )
    headline("filter_groups on/off trained samples per s", stats)


if __name__ == "__main__":
    main()
