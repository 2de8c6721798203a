"""What staleness costs in learning: the same task trained at lags 0 (synchronous), 1, 2,
4 and 8, with the importance correction on (``tis``) and off (``none``), over seeds.

``python benchmarks/staleness_study.py [--quick] [--seeds 3] [--lags 0,1,2,4,8]``

The task (``configs/cpu_staleness_study.yaml``): the tiny model, warm-started on sums of
two operands 0..19 and flattened so that it samples right answers about a sixth of the time
on 200 held-out sums; every validation round samples each held-out sum 16 times, so a
round's score has a binomial standard error under 0.009. Every run trains the same number
of samples (``--steps`` learner steps of 16 prompts x 8 answers) with one weight version
per step, so a lag of k is k learner steps.

Per cell (mean and 95% t-interval over seeds): the final held-out score and its difference
from lag 0 paired by seed, samples and seconds to ``--threshold``, trained samples/s, lag
drops, mean importance-weight ESS and mismatch KL, and the mean admission lag. The cell
``adaptive_tis`` runs ``staleness.controller=adaptive`` between lag 0 and the largest lag.
``--quick``: one seed, lags 0 and 4 with the correction on, 20 steps (``make bench-check``
runs it). Results in ``results/staleness_study/``: JSON, a plot (score against samples and
against seconds, one line per cell) and ``table.md`` (the README's table); each run's
directory under ``runs/bench/``. The last line is lag 4 (tis) against lag 0 in final score.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import headline, json_text, launch_run, parse_args, write_results  # noqa: E402
from benchmarks.staleness_stats import (  # noqa: E402
    cell_summary,
    late_score,
    markdown_table,
    mean_curve,
    paired_difference,
    peak_drop,
    run_figures,
)

NAME = "staleness_study"
CONFIG = "configs/cpu_staleness_study.yaml"
SAMPLES_PER_STEP = 16 * 8  # data.train_batch_size x rollout.n of the config
log = logging.getLogger("benchmarks.staleness_study")

# The task: asyncrl-prepare's arguments for the model and the data (see the config).
TASK = ["--max-operand", "19", "--n-val", "200"]
MODEL_ARGS = ["--name", "tiny", "--flatten", "--sft-steps", "1500", *TASK]


def _extra(p) -> None:
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3)")
    p.add_argument("--lags", default=None, help="lags to run (default 0,1,2,4,8)")
    p.add_argument("--modes", default=None, help="corrections to run (default tis,none)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (120)")
    p.add_argument("--no-adaptive", action="store_true", help="skip the adaptive cell")
    p.add_argument("--threshold", type=float, default=0.4, help="score whose crossing is timed")
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="model/data root")
    p.add_argument(
        "--resume", action="store_true", help="keep the runs already finished under --out"
    )


def ensure_task(root: Path) -> list[str]:
    """Build the study's model and data under ``root`` if missing; the config overrides
    that point a run at them."""
    model, data = root / "models" / "tiny-study", root / "data" / "arithmetic19"
    prepare = str(Path(sys.executable).parent / "asyncrl-prepare")
    if not (model / "config.json").is_file():
        log.info("building the study's model in %s (about 2 minutes)", model)
        subprocess.run([prepare, "model", *MODEL_ARGS, "--out", str(model)], check=True)
    if not (data / "val.parquet").is_file():
        cmd = [prepare, "data", "--task", "arithmetic", *TASK, "--out", str(data)]
        subprocess.run([*cmd, "--tokenizer", str(model)], check=True)
    return [
        f"model.path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
    ]


def cells(lags: list[int], modes: list[str], adaptive: bool) -> dict[str, list[str]]:
    """Cell name -> its config overrides."""
    out = {
        f"lag{lag}_{mode}": [f"staleness.max_policy_lag={lag}", f"algorithm.importance.mode={mode}"]
        for lag in lags
        for mode in modes
    }
    if adaptive:
        out["adaptive_tis"] = [
            "staleness.controller=adaptive",
            "staleness.min_policy_lag=0",
            f"staleness.max_policy_lag={max(lags)}",
            "algorithm.importance.mode=tis",
        ]
    return out


def run_all(args, plan: dict[str, list[str]], task: list[str], seeds: list[int]) -> dict:
    """Every (seed, cell) run, seed by seed so that a cut-short study stays balanced;
    each run's figures are kept in ``<out>/figures/`` (``--resume`` reuses them)."""
    keep = args.out / "figures"
    keep.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in plan}
    for seed in seeds:
        for name, overrides in plan.items():
            run_name = f"{name}_seed{seed}"
            saved = keep / f"{run_name}.json"
            if args.resume and saved.is_file():
                figures = json.loads(saved.read_text())
                # kept by an older version of this study: the figure it did not have yet
                figures.setdefault("late", late_score(figures["curve"]))
                figures.setdefault("peak_drop", peak_drop(figures["curve"]))
            else:
                extra = [f"data.seed={seed}", f"trainer.seed={seed}"]
                extra.append(f"trainer.total_training_steps={args.steps}")
                run = launch_run(CONFIG, [*task, *overrides, *extra], args.out / "runs", run_name)
                figures = run_figures(
                    run, samples_per_step=SAMPLES_PER_STEP, threshold=args.threshold
                )
                figures["seed"] = seed
                saved.write_text(json_text(figures, indent=1))
            log.info("%s: final %.3f (start %.3f)", run_name, figures["final"], figures["start"])
            runs[name].append(figures)
    return runs


def _plot(runs: dict[str, list[dict]], threshold: float):
    lags = sorted({n.split("_", 1)[0] for n in runs if not n.startswith("adaptive")})

    def draw(fig) -> None:
        axes = fig.subplots(1, 2)
        for ax, axis, label in ((axes[0], 1, "trained samples"), (axes[1], 2, "seconds")):
            for name, cell in runs.items():
                if cell:
                    xs, ys = mean_curve(cell, axis)
                    style = {"linestyle": "--" if name.endswith("none") else "-"}
                    # one colour per lag, tis solid and none dashed; adaptive in black (a
                    # colour by position mixed lags up when the modes per lag were not 2)
                    lag = name.split("_", 1)[0]
                    style["color"] = (
                        "black" if name.startswith("adaptive") else f"C{lags.index(lag)}"
                    )
                    ax.plot(xs, ys, marker=".", label=name, **style)
            ax.axhline(threshold, color="grey", linewidth=0.5)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out score (mean over seeds)")
        axes[0].legend(fontsize="x-small", ncol=2)
        axes[0].set_title("score by samples")
        axes[1].set_title("score by wall time")

    return draw


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(NAME, (__doc__ or "").split("\n")[0], argv, _extra)
    lags = [int(x) for x in (args.lags or ("0,4" if args.quick else "0,1,2,4,8")).split(",")]
    modes: list[str] = str(args.modes or ("tis" if args.quick else "tis,none")).split(",")
    seeds = list(range(1, 1 + (args.seeds or (1 if args.quick else 3))))
    args.steps = args.steps or (20 if args.quick else 120)
    plan = cells(lags, modes, adaptive=not (args.quick or args.no_adaptive))
    runs = run_all(args, plan, ensure_task(args.artifacts), seeds)
    summary = {name: cell_summary(cell) for name, cell in runs.items()}
    base = runs.get("lag0_tis") or runs.get(f"lag{lags[0]}_{modes[0]}", [])
    diffs, late = {}, {}
    for name, cell in runs.items():
        if len(cell) > 1:
            diffs[name] = paired_difference(cell, base)
            late[name] = paired_difference(cell, base, "late")
    table = markdown_table(summary, diffs, late)
    print(table, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    config = {"config": CONFIG, "lags": lags, "modes": modes, "seeds": seeds}
    config.update(steps=args.steps, threshold=args.threshold, samples_per_step=SAMPLES_PER_STEP)
    json_path, png = write_results(
        NAME,
        args.out,
        figures={
            "cells": summary,
            "paired_vs_lag0": diffs,
            "late_paired_vs_lag0": late,
            "runs": runs,
        },
        plot=_plot(runs, args.threshold),
        config=config,
    )
    print(f"results: {json_path}, {png}")
    lag4, sync = summary.get("lag4_tis"), summary.get("lag0_tis")
    if lag4 and sync and sync["final"]["mean"]:
        headline(
            "staleness lag4_tis/lag0 final score", lag4["final"]["mean"] / sync["final"]["mean"]
        )


if __name__ == "__main__":
    main()
