"""Throughput of the real pipeline: synchronous against asynchronous, in one run.

``python benchmarks/throughput.py CONFIG [--quick] [--models tiny,small] [--lags 0,1,2,4]
[--reps 3]``

For each model it

1. measures each phase alone (``benchmarks/phases.py``, one pinned process each):
   generation tokens/s on 1 core and on 2, training tokens/s on 1 core and on 2, and one
   weight push, so the reader sees what overlapping them could gain on this machine;
2. runs the whole pipeline (``asyncrl-launch``) for a fixed number of learner steps at each
   ``staleness.max_policy_lag`` of the sweep (0 = synchronous), with learner and buffer on
   core 0 and both rollout servers on core 1 (``split``, the layout the scheduler model
   knows). The synchronous baseline also runs with every role on both cores (``shared``: its phases
   alternate, so each can use both), and the better of the two is its figure; the largest
   lag gets the shared layout too. The modes run round-robin, ``--reps`` times (default 3),
   in the listed order on even repetitions and reversed on odd ones (A, B, B, A), so that
   drift in the machine's load falls on every mode alike;
3. predicts each mode with the scheduler model (``benchmarks/sim_model.py``), calibrated
   only on the phases measured alone, and reports the prediction's error.

Per mode, the median over repetitions of: samples/s, generated and trained tokens/s,
learner wait fraction, rollout wait fraction, sync seconds per version, time to a target
validation score (``tiny``: the demo's warm-started model); and the ratio to the
synchronous mode, taken per repetition against that repetition's better synchronous run
(``lag0`` or ``lag0-shared``), as median with min and max. Results in
``results/throughput/`` (JSON with every repetition, PNG, each run's directory); the last
line is the ratio of the best asynchronous mode (by median) to the synchronous one on the
first model. ``--quick`` runs one repetition unless ``--reps`` says otherwise: it takes
about 7 minutes so, mostly two launches with their engine start-ups and validation rounds,
and three repetitions would take about 15 (``benchmarks/common.py`` lists the exceptions);
its headline says it is not a measurement.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RatioStats,
    check_reps,
    format_ratio,
    headline,
    json_text,
    paired_ratio,
    parse_args,
    quick_note,
    write_results,
)
from benchmarks.pipeline_stats import calibrate, predict, run_stats  # noqa: E402

NAME = "throughput"
log = logging.getLogger("benchmarks.throughput")

MODELS = {  # name -> (model dir, prepare command arguments)
    "tiny": ("artifacts/models/tiny-demo", ["--name", "tiny", "--flatten"]),
    "small": ("artifacts/models/small", ["--name", "small"]),
}
DATA = "artifacts/data/arithmetic"  # configs/cpu_demo.yaml's data.train_files and val_files
SHARED = "launch.cpus={learner: [0, 1], rollout: [[0, 1], [0, 1]], buffer: [0, 1]}"
# Both servers on core 1: the layout the scheduler model knows (the demo config now gives
# each server a core).
SPLIT = "launch.cpus={learner: [0], rollout: [[1], [1]], buffer: [0]}"
TARGET = 0.5  # validation score whose first crossing is timed (tiny only)


def _extra(p) -> None:
    p.add_argument("config", nargs="?", default="configs/cpu_demo.yaml")
    p.add_argument("--models", default=None, help="comma-separated: tiny,small")
    p.add_argument("--lags", default=None, help="max_policy_lag sweep (default 0,1,2,4)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run")
    p.add_argument(
        "--reps", type=int, default=None, help="round-robin repetitions (odd; 3, quick 1)"
    )


def _ensure_model(name: str) -> str:
    """The model ``name`` and the demo config's data (``artifacts/data/arithmetic``, which
    a fresh checkout lacks), built if missing, as ``make demo`` builds them."""
    path, args = MODELS[name]
    prepare = str(Path(sys.executable).parent / "asyncrl-prepare")
    if not (Path(path) / "config.json").is_file():
        log.info("building the %s model in %s", name, path)
        subprocess.run([prepare, "model", *args, "--out", path], check=True)
    if not (Path(DATA) / "val.parquet").is_file():
        cmd = [prepare, "data", "--task", "arithmetic", "--out", DATA, "--tokenizer", path]
        subprocess.run(cmd, check=True)
    return path


def _phase(phase: str, config: str, overrides: list[str], cores: str, *extra: str) -> dict:
    cmd = [
        sys.executable,
        "benchmarks/phases.py",
        phase,
        config,
        *overrides,
        "--cores",
        cores,
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{phase} on cores {cores} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_phases(config: str, overrides: list[str], quick: bool) -> dict:
    """Each phase alone: generation on core 1 and cores 0,1; training on core 0 and cores
    0,1; one sync into the run's engines on core 1. ``quick``: the one-core figures only
    (all the model needs)."""
    secs = "8" if quick else "20"
    out = {}
    for cores in ("1",) if quick else ("1", "0,1"):
        out[f"generate@{cores}"] = _phase("generate", config, overrides, cores, "--seconds", secs)
        log.info("generation alone on cores %s: %s", cores, out[f"generate@{cores}"]["concurrency"])
    mean_len = _mean(out["generate@1"]["response_lengths"])
    for cores in ("0",) if quick else ("0", "0,1"):
        out[f"train@{cores}"] = _phase(
            "train",
            config,
            overrides,
            cores,
            "--steps",
            "3" if quick else "6",
            "--response-len",
            str(mean_len),
        )
        log.info("training alone on cores %s: %s", cores, out[f"train@{cores}"])
    out["sync@1"] = _phase("sync", config, overrides, "1")
    log.info("one sync alone into the run's engines: %s", out["sync@1"])
    return out


def _mean(xs) -> float:
    return sum(xs) / max(1, len(xs))


def run_pipeline(config: str, overrides: list[str], out_dir: Path) -> dict:
    """One launch; its figures from the run's metrics."""
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch",
        config,
        *overrides,
        f"trainer.default_local_dir={out_dir}",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - start
    run = out_dir / "throughput" / "run"  # trainer.project_name / experiment_name below
    if proc.returncode != 0:
        raise RuntimeError(f"run {overrides} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    stats = run_stats(run, target=TARGET)
    stats["launch_wall_s"] = wall
    return stats


def round_robin(names: list[str], rep: int) -> list[str]:
    """The order of repetition ``rep``: as listed on even repetitions, reversed on odd ones
    (A, B, B, A, ...), so that each mode runs as often early as late in the sweep."""
    return list(names) if rep % 2 == 0 else list(reversed(names))


def _median(values: list[float]) -> float:
    """The median of the finite values; NaN if none (a run that never reached the target)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def summarise(per_rep: list[dict[str, dict]]) -> dict[str, dict]:
    """Each mode over repetitions: the median of each figure, every repetition (``reps``),
    and its samples/s ratio to the synchronous mode taken per repetition, against that
    repetition's better synchronous run (``lag0*``): ``ratio_to_sync`` (the median) and
    ``ratio_to_sync_stats`` (:meth:`RatioStats.to_json`)."""
    names = list(per_rep[0])
    sync_names = [n for n in names if n.startswith("lag0")]
    if not sync_names:
        raise ValueError(f"no synchronous (lag0) mode among {names}")
    best_sync = [max(rep[n]["samples_per_s"] for n in sync_names) for rep in per_rep]
    modes: dict[str, dict] = {}
    for name in names:
        reps = [rep[name] for rep in per_rep]
        figures: dict[str, Any] = {
            key: _median([float(r[key]) for r in reps])
            for key, value in reps[0].items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        # The median above is over the runs that reached the target: how many did.
        reached = [r for r in reps if math.isfinite(float(r.get("time_to_target_s", math.nan)))]
        figures["time_to_target_reached"] = len(reached)
        stats = paired_ratio([r["samples_per_s"] for r in reps], best_sync)
        figures["ratio_to_sync"] = stats.median
        figures["ratio_to_sync_stats"] = stats.to_json()
        figures["reps"] = reps
        modes[name] = figures
    return modes


def ratio_stats(mode: dict) -> RatioStats:
    """The :class:`RatioStats` of a mode that :func:`summarise` returned."""
    got = mode["ratio_to_sync_stats"]
    return paired_ratio(got["real"], got["baseline"])


def sweep(
    config: str, model: str, lags: list[int], steps: int, quick: bool, out: Path, reps: int
) -> dict:
    """Phases alone, then the pipeline at every lag (lag 0 also with shared cores),
    round-robin over ``reps`` repetitions, then the model's predictions; one dict per mode."""
    from asyncrl.config import load_config

    path = _ensure_model(model)
    base = [
        f"model.path={path}",
        f"trainer.total_training_steps={steps}",
        "trainer.project_name=throughput",
        "trainer.experiment_name=run",
        # One version per step: with the demo's push every second step, lag 0 still
        # generated a step's groups while the step before trained, and was not synchronous.
        "staleness.sync_every=1",
    ]
    if model == "tiny":  # time to a validation score: a round every 10 steps
        base += ["trainer.test_freq=10", "trainer.val_before_train=true", "rollout.val_kwargs.n=4"]
    else:
        base += ["trainer.test_freq=-1", "trainer.val_before_train=false"]
    cfg = load_config(config, base)
    phases = measure_phases(config, base, quick)
    params = calibrate(cfg, phases, servers_per_core=cfg.rollout.num_servers)
    # Shared cores suit the synchronous baseline (its phases alternate); the best async lag
    # gets them too, so that neither side is handicapped by the pinning.
    shared = [] if quick else [(0, "shared"), (max(lags), "shared")]
    layouts = {
        f"lag{lag}" + ("-shared" if layout == "shared" else ""): (lag, layout)
        for lag, layout in [(lag, "split") for lag in lags] + shared
    }
    per_rep: list[dict[str, dict]] = []
    for rep in range(reps):
        got: dict[str, dict] = {}
        for name in round_robin(list(layouts), rep):
            lag, layout = layouts[name]
            extra = [f"staleness.max_policy_lag={lag}"]
            extra.append(SHARED if layout == "shared" else SPLIT)
            log.info("%s: pipeline run %s, repetition %d", model, name, rep)
            got[name] = run_pipeline(config, base + extra, out / "runs" / model / name / f"{rep}")
            log.info("%s %s rep %d: %s", model, name, rep, got[name])
        per_rep.append({name: got[name] for name in layouts})  # listed order, not run order
    modes = summarise(per_rep)
    for name, (lag, layout) in layouts.items():
        if layout == "split":  # the model knows the split layout only
            stats = modes[name]
            stats["predicted"] = predict(params, lag, steps)
            real, sim = stats["samples_per_s"], stats["predicted"]["samples_per_s"]
            stats["prediction_error"] = (sim - real) / real
    sync_names = [n for n in modes if n.startswith("lag0")]
    return {
        "phases": phases,
        "modes": modes,
        "reps": reps,
        "best_sync": max(sync_names, key=lambda n: modes[n]["samples_per_s"]),
        "calibration": {k: v for k, v in vars(params).items() if k != "lengths"},
    }


COLUMNS = [  # (header, key, format)
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("gen tok/s", "generated_tokens_per_s", "{:.0f}"),
    ("train tok/s", "trained_tokens_per_s", "{:.0f}"),
    ("learner wait", "learner_wait_frac", "{:.0%}"),
    ("rollout wait", "rollout_wait_frac", "{:.0%}"),
    ("sync s", "sync_s_per_version", "{:.3f}"),
    ("lag", "mean_lag", "{:.2f}"),
    ("to val 0.5 s", "time_to_target_s", "{:.0f}"),
    ("vs sync", "ratio_to_sync", "{:.2f}"),
    ("sim error", "prediction_error", "{:+.0%}"),
]


def table(model: str, result: dict) -> str:
    """A plain-text table of one model's sweep (also the README's source)."""
    head = f"{model:<14}" + "".join(f"{h:>14}" for h, _, _ in COLUMNS)
    lines = [head]
    for name, stats in result["modes"].items():
        cells = []
        for _, key, fmt in COLUMNS:
            v = stats.get(key)
            cell = "-" if v is None or v != v else fmt.format(v)
            runs, reached = len(stats["reps"]), stats.get("time_to_target_reached")
            if key == "time_to_target_s" and reached is not None and reached < runs:
                cell += f" ({reached}/{runs})"  # the others never reached it
            cells.append(f"{cell:>14}")
        lines.append(f"{name:<14}" + "".join(cells))
    for name, stats in result["modes"].items():
        spread_of = format_ratio(ratio_stats(stats))
        lines.append(f"{name}/sync samples per s (per repetition): {spread_of}")
    ph = result["phases"]
    for label, gen_key, train_key in (
        ("1 core", "generate@1", "train@0"),
        ("2 cores", "generate@0,1", "train@0,1"),
    ):
        if gen_key not in ph:
            continue
        best = max(f["tokens_per_s"] for f in ph[gen_key]["concurrency"].values())
        train = ph[train_key]["tokens_per_s"]
        lines.append(f"alone on {label}: generation {best:.0f} tok/s, training {train:.0f} tok/s")
    lines.append(
        f"one sync alone: {ph['sync@1']['sync_s']:.3f} s ({ph['sync@1']['bytes'] / 1e6:.1f} MB)"
    )
    return "\n".join(lines)


def _plot(results: dict):
    def draw(fig) -> None:
        axes = fig.subplots(1, len(results), squeeze=False)[0]
        for ax, (model, res) in zip(axes, results.items(), strict=True):
            names = list(res["modes"])
            real = [res["modes"][n]["samples_per_s"] for n in names]
            sim = [
                res["modes"][n].get("predicted", {}).get("samples_per_s", float("nan"))
                for n in names
            ]
            xs = range(len(names))
            ax.bar(xs, real, color="tab:blue", label="measured")
            ax.plot(xs, sim, "o", color="tab:orange", label="model (calibrated alone)")
            ax.set_xticks(list(xs), names, rotation=30)
            ax.set_ylabel("trained samples/s")
            ax.set_title(f"{model}: samples/s by max_policy_lag")
            ax.set_ylim(0, 1.3 * max(max(real), *[x for x in sim if x == x]))
            ax.legend(loc="upper left", fontsize="small")

    return draw


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args(NAME, (__doc__ or "").split("\n")[0], argv, _extra)
    models = (args.models or ("tiny" if args.quick else "tiny,small")).split(",")
    lags = [int(x) for x in (args.lags or ("0,2" if args.quick else "0,1,2,4")).split(",")]
    # Quick: one repetition, the documented exception (module docstring).
    reps = check_reps(args.reps if args.reps is not None else (1 if args.quick else 3))
    results = {}
    for model in models:
        steps = args.steps or (12 if args.quick else (50 if model == "tiny" else 12))
        results[model] = sweep(args.config, model, lags, steps, args.quick, args.out, reps)
        args.out.mkdir(parents=True, exist_ok=True)  # kept if a later model fails
        (args.out / f"partial_{model}.json").write_text(json_text(results[model], indent=1))
        print(table(model, results[model]), flush=True)
    json_path, png = write_results(
        NAME,
        args.out,
        figures=results,
        plot=_plot(results),
        config={
            "config": args.config,
            "models": models,
            "lags": lags,
            "quick": args.quick,
            "reps": reps,
        },
    )
    print(f"results: {json_path}, {png}")
    first = results[models[0]]["modes"]
    best = max(
        (n for n in first if not n.startswith("lag0")), key=lambda n: first[n]["ratio_to_sync"]
    )
    headline(
        f"throughput {models[0]} {best}/sync samples per s",
        ratio_stats(first[best]),
        quick_note(args.quick, reps),
    )


if __name__ == "__main__":
    main()
