"""DAPO's dynamic sampling on the demo: the same run with ``algorithm.filter_groups`` off
and on, one after the other on this machine.

``python benchmarks/filter_groups.py [--quick] [--steps 120]``

Per run: trained samples/s, the learner's batch wait (mean ``timing/wait_batch_s`` and
the waiting share of the step), groups trained with zero variance (``batch/
zero_variance_groups``), the share of groups filtered and prompts dealt per trained group,
and the validation curve. Results in ``results/filter_groups/`` (JSON, a plot of the two
validation curves against trained samples and seconds); the last line is on/off in
trained samples/s. ``--quick``: 15 steps.
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.metrics import read_metrics  # noqa: E402
from benchmarks.common import headline, launch_run, parse_args, write_results  # noqa: E402
from benchmarks.pipeline_stats import run_stats  # noqa: E402

NAME = "filter_groups"
CONFIG = "configs/cpu_demo.yaml"
MODEL = "artifacts/models/tiny-demo"
DATA = "artifacts/data/arithmetic"
log = logging.getLogger("benchmarks.filter_groups")


def _extra(p) -> None:
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (120)")


def ensure_demo() -> None:
    """The demo's model and data, built as ``make demo-artifacts`` does if missing."""
    prepare = str(Path(sys.executable).parent / "asyncrl-prepare")
    if not (Path(MODEL) / "config.json").is_file():
        subprocess.run(
            [prepare, "model", "--name", "tiny", "--flatten", "--out", MODEL], check=True
        )
    if not (Path(DATA) / "train.parquet").is_file():
        cmd = [prepare, "data", "--task", "arithmetic", "--out", DATA, "--tokenizer", MODEL]
        subprocess.run(cmd, check=True)


def figures(run: Path) -> dict[str, Any]:
    """One run's figures from its metrics."""
    records = read_metrics(run)
    steps = [r for r in records if "loss/pg" in r]
    vals = [r for r in records if "val/score" in r]
    per_step = steps[0]["batch/sequences"] if steps else 0.0
    stats = run_stats(run)
    last = records[-1]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {
        "samples_per_s": stats["samples_per_s"],
        "learner_wait_frac": stats["learner_wait_frac"],
        "wait_batch_s_mean": mean("timing/wait_batch_s"),
        "zero_variance_groups_per_step": mean("batch/zero_variance_groups"),
        "filtered_frac_mean": mean("filter/filtered_frac"),
        "prompts_per_trained_group_mean": mean("filter/prompts_per_trained_group"),
        "groups_filtered": steps[-1].get("filter/groups_filtered", 0.0),
        # the trained groups that carried a signal (zero-variance ones train nothing)
        "signal_samples_per_s": stats["samples_per_s"]
        * (1 - mean("batch/zero_variance_groups") / steps[0]["batch/groups"]),
        "dropped_filtered": last.get("accounting/train/dropped/filtered", 0.0),
        "unaccounted": last.get("accounting/train/unaccounted", 0.0),
        "val_curve": [
            [int(r["step"]), int(r["step"]) * per_step, r["time"] - vals[0]["time"], r["val/score"]]
            for r in vals
        ],
        "val_final": vals[-1]["val/score"] if vals else None,
    }


def _plot(results: dict[str, dict]):
    def draw(fig) -> None:
        axes = fig.subplots(1, 2)
        for ax, axis, label in ((axes[0], 1, "trained samples"), (axes[1], 2, "seconds")):
            for name, res in results.items():
                curve = res["val_curve"]
                ax.plot([c[axis] for c in curve], [c[3] for c in curve], marker=".", label=name)
            ax.set_xlabel(label)
            ax.set_ylabel("validation score")
        axes[0].legend()
        axes[0].set_title("demo: filter_groups off / on")

    return draw


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(NAME, (__doc__ or "").split("\n")[0], argv, _extra)
    steps = args.steps or (15 if args.quick else 120)
    ensure_demo()
    common = [f"trainer.total_training_steps={steps}", "trainer.save_freq=-1"]
    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=4"]
    results = {}
    for name, extra in (("filter_off", []), ("filter_on", on)):  # not "off": YAML's false
        run = launch_run(CONFIG, [*common, *extra], args.out / "runs", name)
        results[name] = figures(run)
        log.info("%s: %s", name, {k: v for k, v in results[name].items() if k != "val_curve"})
    json_path, png = write_results(
        NAME,
        args.out,
        figures=results,
        plot=_plot(results),
        config={"config": CONFIG, "steps": steps, "on": on},
    )
    print(f"results: {json_path}, {png}")
    ratio = results["filter_on"]["samples_per_s"] / results["filter_off"]["samples_per_s"]
    headline("filter_groups on/off trained samples per s", ratio)


if __name__ == "__main__":
    main()
