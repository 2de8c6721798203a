"""asyncrl against a single-process GRPO loop (TRL's ``GRPOTrainer``) on this machine.

Both sides train the same model on the same prompts with the same reward, batch (16
prompts x 8 samples), learning rate, warmup, clip range (0.2 / 0.28), token-mean loss and
steps, on the same two cores (the first two this process may use; on a larger machine
the others stay idle): TRL in one process pinned to them (torch threads = 2), asyncrl
with one rollout server per core and the learner beside server 0, where server 0 runs at
the lowest CPU priority for long responses (the learner is the bottleneck there), the
learner waits for each weight push there, and the servers' model is compiled there. Two
shapes:

- ``demo``: the demo (``configs/cpu_demo.yaml``): the warm-started tiny model, 4-token
  answers to sums, 180 steps;
- ``long``: an untrained tiny model writing 128-token answers, rewarded densely (the share
  of digits it writes, ``benchmarks/long_reward.py``), 30 steps.

Each repetition runs both sides of a shape back to back, alternating which goes first;
ratios are asyncrl / TRL within a repetition (this machine is shared and noisy), reported as
median with min-max. Timed span: from the end of step 1 to the end of the last step, on
both sides; start-up, from launch to the end of step 1, is reported beside it
(``to_step1_s``). That span leaves out asyncrl's start-up (engines, a compiled model) and
counts from a step 1 whose servers have already generated ahead, so an end-to-end figure
is reported too: from the benchmark launching each side's process to its last step
(``launch_to_end_s``, both clocks read by this script), as samples/s over every step
(``end_to_end_samples_per_s``), its asyncrl/TRL ratio per repetition printed before the
headline. ``--quick`` runs one repetition (its quick mode is a test; see
``benchmarks/common.py``), and its headline says it is not a measurement.
"Score" is the mean training reward over the last 20 steps (TRL has no validation rounds;
asyncrl's are off here); "late mean" is the mean over the second half of the steps, a
steadier reading of the same curve. Repetition ``i`` seeds both sides with ``i + 1`` (TRL's
``seed``, asyncrl's ``data.seed``), so the scores' spread includes TRL's own across seeds.
TRL is the ``bench`` extra (``make install`` adds it).

    python benchmarks/vs_trl.py [--quick] [--reps 3] [--shapes demo,long] [--out DIR]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RatioStats,
    check_reps,
    format_ratio,
    headline,
    launch_run,
    paired_ratio,
    parse_args,
    quick_note,
    write_results,
)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, N = 16, 8


@dataclass(frozen=True)
class Shape:
    name: str
    model: str
    steps: int
    max_new_tokens: int
    reward_file: str | None = None
    # The learner beside server 0 on core 0. For 128-token answers the learner is the
    # bottleneck, and server 0 runs at the lowest CPU priority (launch.nice): the learner's
    # update takes 0.86 s as on a core of its own, against 1.9 s sharing it evenly and 1.7 s
    # on both cores beside both servers (step 1 to end 46 s against 57 s and 50 s, one run
    # each; niceness 5, 10 and 19: 51.1, 49.5 and 47.0 s). On the demo's short answers
    # generation is the bottleneck: no priority there.
    rollout_nice: str = "[0, 0]"
    # sync.overlap_push. With server 0 at niceness 19, a push sent while the learner trains
    # the next step cannot pause server 0 until that step's update ends (0.8-1.8 s in some
    # pushes), and server 1, already paused, waits for it in the broadcast. Waiting for each
    # push instead (0.13 s a step): step 1 to end 54.5, 55.3 and 49.3 s against 57.2, 57.6
    # and 64.0 s with overlap (three interleaved pairs). Waiting ends at the send, not at
    # the servers' reports (0.05 s a push against 0.2 s).
    overlap_push: bool = True
    # rollout.enforce_eager. Compiling the servers' model fuses the per-operator calls that
    # are half of an engine step on this 2-layer model; it costs about 22 s of start-up,
    # outside the timed span but reported beside it (``to_step1_s``). Long shape, four
    # interleaved pairs of asyncrl runs: step 1 to end 40.2, 39.4, 42.5 and 46.7 s against
    # 41.8, 42.9, 52.6 and 49.2 s eager. The demo's short answers gained nothing (30.9 and
    # 33.9 s against 29.4 and 37.0 s): it stays eager.
    enforce_eager: bool = True
    # staleness.max_policy_lag, in pushes (a push every second step, as configs/cpu_demo.yaml).
    # The demo at lag 1 learned less: mean training reward over steps 90-180 0.81 (16 runs)
    # against 0.85 at lag 0 (6 runs) and TRL's 0.86 (5 seeds), and lag 0 was not slower
    # (three interleaved triples, step 1 to end: 25.2, 24.4, 24.7 s at lag 0; 29.4, 29.5,
    # 29.3 s at lag 0 pushing every step; 30.0, 30.3, 28.4 s at lag 1 pushing every step).
    # With a push every second step, lag 0 still overlaps: the second step's groups are
    # generated while the first trains, one step old at most. The long shape's learner is
    # its bottleneck, and its scores at lag 1 lie within TRL's: it keeps the config's lag.
    # None: the config's.
    max_policy_lag: int | None = None


def shapes(quick: bool) -> dict[str, Shape]:
    return {
        "demo": Shape(
            "demo", "artifacts/models/tiny-demo", 20 if quick else 180, 4, max_policy_lag=0
        ),
        "long": Shape(
            "long",
            "artifacts/models/tiny-untrained",
            4 if quick else 30,
            128,
            str(ROOT / "benchmarks" / "long_reward.py"),
            rollout_nice="[19, 0]",
            overlap_push=False,
            enforce_eager=False,
        ),
    }


def build_artifacts() -> None:
    """The models and prompts both sides use, built once as ``make demo`` builds them."""
    prep = [sys.executable, "-m", "asyncrl.prepare.main"]
    if not (ROOT / "artifacts/models/tiny-demo/config.json").is_file():
        out = "artifacts/models/tiny-demo"
        subprocess.run([*prep, "model", "--name", "tiny", "--flatten", "--out", out], check=True)
    if not (ROOT / "artifacts/models/tiny-untrained/config.json").is_file():
        out = "artifacts/models/tiny-untrained"
        cmd = [*prep, "model", "--name", "tiny", "--warm-start", "off", "--out", out]
        subprocess.run(cmd, check=True)
    if not (ROOT / "artifacts/data/arithmetic/val.parquet").is_file():
        cmd = [*prep, "data", "--task", "arithmetic", "--out", "artifacts/data/arithmetic"]
        subprocess.run([*cmd, "--tokenizer", "artifacts/models/tiny-demo"], check=True)


def _span(ends: list[float], steps: int, rewards: list[float]) -> dict[str, Any]:
    """Figures of one run from its step-end times (seconds) and per-step mean rewards."""
    span = ends[-1] - ends[0]
    return {
        "steps": float(len(ends)),
        "step1_to_end_s": span,
        "samples_per_s": (len(ends) - 1) * PROMPTS * N / span,
        "score": statistics.fmean(rewards[-20:]),
        "late_mean": statistics.fmean(rewards[len(rewards) // 2 :]),
        "first_reward": statistics.fmean(rewards[:5]),
        "rewards": rewards,  # per step: the learning curve
    }


def end_to_end(launched: float, last_end: float, steps: int) -> dict[str, float]:
    """Launch to the last step's end, on one clock, and samples/s over every step in it."""
    total = last_end - launched
    return {"launch_to_end_s": total, "end_to_end_samples_per_s": steps * PROMPTS * N / total}


def two_cores() -> list[int]:
    """The two cores both sides run on: asyncrl's layout is one rollout server per core, and
    TRL given more (every core of a larger machine) compared unequal hardware."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit(f"vs_trl needs two cores this process may use; it has {cores}")
    return cores


def run_trl(shape: Shape, out: Path, seed: int) -> dict[str, Any]:
    cores = two_cores()
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "trl_side.py"),
        "--model", shape.model, "--data", "artifacts/data/arithmetic/train.parquet",
        "--steps", str(shape.steps), "--max-new-tokens", str(shape.max_new_tokens),
        "--threads", str(len(cores)), "--seed", str(seed), "--out", str(out),
    ]  # fmt: skip
    if shape.reward_file:
        cmd += ["--reward-file", shape.reward_file]
    launched = time.monotonic()  # the same clock as the child's (CLOCK_MONOTONIC)
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=ROOT,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"TRL side failed:\n{proc.stderr[-3000:]}")
    got = json.loads(out.read_text())
    figures = _span(got["step_ends"], shape.steps, got["reward_mean"])
    figures["to_step1_s"] = got["start"] + got["step_ends"][0] - launched
    figures.update(end_to_end(launched, got["start"] + got["step_ends"][-1], len(got["step_ends"])))
    figures["response_tokens_per_s"] = sum(got["response_tokens"][1:]) / figures["step1_to_end_s"]
    return figures


def run_asyncrl(shape: Shape, root: Path, name: str, seed: int) -> dict[str, Any]:
    a, b = two_cores()
    overrides = [
        f"model.path={shape.model}",
        f"trainer.total_training_steps={shape.steps}",
        f"data.max_response_length={shape.max_new_tokens}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        # One server per core, the learner beside server 0 (the demo config's layout),
        # server 0's priority sized to the shape.
        f"launch.cpus={{learner: [{a}], rollout: [[{a}], [{b}]], buffer: [{a}]}}",
        f"launch.nice={{rollout: {shape.rollout_nice}}}",
        f"sync.overlap_push={str(shape.overlap_push).lower()}",
        f"rollout.enforce_eager={str(shape.enforce_eager).lower()}",
        # The next version's window opens at the send, not at the servers' reports: three
        # interleaved pairs each, step 1 to end, demo 30.6, 31.0, 29.5 s against 35.2,
        # 31.8, 31.3 s; long 42.2, 40.7, 39.3 s against 43.4, 44.0, 41.6 s (README).
        "staleness.deal_at_send=true",
        f"data.seed={seed}",
    ]
    if shape.max_policy_lag is not None:
        overrides.append(f"staleness.max_policy_lag={shape.max_policy_lag}")
    if shape.reward_file:
        overrides.append(f"reward.custom_reward_function.path={shape.reward_file}")
    # Read here, as the TRL side's clock is read before its process starts: both
    # end-to-end spans then include the interpreter's start-up. Wall clock, as the metrics'.
    launched_here = time.time()
    run = launch_run("configs/cpu_demo.yaml", overrides, root, name)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/step_s" in r]
    figures = _span([r["time"] for r in steps], shape.steps, [r["reward/mean"] for r in steps])
    events = [json.loads(line) for line in (run / "startup.jsonl").read_text().splitlines()]
    launched = next(e["t"] for e in events if e["event"] == "launch")
    figures["to_step1_s"] = steps[0]["time"] - launched  # both wall-clock seconds
    figures.update(end_to_end(launched_here, steps[-1]["time"], len(steps)))
    figures["lag_max"] = max(r["lag/max"] for r in steps)  # in pushes, of what was trained
    figures["response_tokens_per_s"] = (
        sum(r["batch/response_tokens"] for r in steps[1:]) / figures["step1_to_end_s"]
    )
    return figures


def ratio_stats(reps: list[dict[str, Any]], key: str) -> RatioStats:
    """asyncrl / TRL of ``key`` (a rate), paired by repetition."""
    return paired_ratio([r["asyncrl"][key] for r in reps], [r["trl"][key] for r in reps])


def summarise(shape: Shape, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One shape's figures from its repetitions (each ``{"seed", "trl", "asyncrl"}``)."""
    sides = ("trl", "asyncrl")
    return {
        "steps": shape.steps,
        "max_new_tokens": shape.max_new_tokens,
        "runs": runs,
        "samples_per_s_ratio": ratio_stats(runs, "samples_per_s").to_json(),
        # Launch to last step: start-up and the servers' head start counted on both sides.
        "end_to_end_samples_per_s_ratio": ratio_stats(runs, "end_to_end_samples_per_s").to_json(),
        "score": {side: statistics.fmean(r[side]["score"] for r in runs) for side in sides},
        "late_mean": {side: statistics.fmean(r[side]["late_mean"] for r in runs) for side in sides},
        "to_step1_s": {
            side: statistics.median(r[side]["to_step1_s"] for r in runs) for side in sides
        },
        "launch_to_end_s": {
            side: statistics.median(r[side]["launch_to_end_s"] for r in runs) for side in sides
        },
    }


def main() -> None:
    args = parse_args(
        "vs_trl",
        "asyncrl against a single-process GRPO loop (TRL's GRPOTrainer) on this machine",
        extra=lambda p: (
            p.add_argument("--reps", type=int, default=3),
            p.add_argument("--shapes", default="demo,long"),
        ),
    )
    reps = check_reps(1 if args.quick else args.reps)
    build_artifacts()
    chosen = [shapes(args.quick)[s] for s in args.shapes.split(",")]
    results: dict[str, Any] = {"shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in chosen:
            runs = []
            for rep in range(reps):
                sides = ["trl", "asyncrl"] if rep % 2 == 0 else ["asyncrl", "trl"]
                seed = rep + 1
                got: dict[str, Any] = {"seed": seed}  # both sides' seed, kept with the run
                for side in sides:
                    if side == "trl":
                        out = Path(tmp) / f"trl-{shape.name}-{rep}.json"
                        got["trl"] = run_trl(shape, out, seed=seed)
                    else:
                        name = f"{shape.name}-{rep}"
                        got["asyncrl"] = run_asyncrl(shape, Path(tmp), name, seed=seed)
                    shown = {k: v for k, v in got[side].items() if k != "rewards"}
                    print(shape.name, rep, side, json.dumps(shown), flush=True)
                runs.append(got)
            results["shapes"][shape.name] = summarise(shape, runs)
    config = {"reps": reps, "prompts": PROMPTS, "n": N, "cores": os.cpu_count()}
    config["cores_used"] = two_cores()  # by each side: asyncrl's layout, TRL's affinity
    write_results(
        "vs_trl", args.out, figures=results, config=config, plot=lambda fig: _plot(fig, results)
    )
    for name, shape in results["shapes"].items():
        r = shape["samples_per_s_ratio"]
        print(
            f"{name}: asyncrl/TRL samples/s {r['median']:.2f} (min {r['min']:.2f}, max "
            f"{r['max']:.2f}); score TRL {shape['score']['trl']:.3f}, asyncrl "
            f"{shape['score']['asyncrl']:.3f} (late mean TRL {shape['late_mean']['trl']:.3f}, "
            f"asyncrl {shape['late_mean']['asyncrl']:.3f}); launch to step 1 (median) TRL "
            f"{shape['to_step1_s']['trl']:.1f} s, asyncrl {shape['to_step1_s']['asyncrl']:.1f} s"
        )
    note = quick_note(args.quick, reps)
    for name, shape in results["shapes"].items():
        e2e = ratio_stats(shape["runs"], "end_to_end_samples_per_s")
        print(
            f"{name}: asyncrl / TRL samples/s end to end (launch to last step): "
            f"{format_ratio(e2e, note)}; launch to end (median) TRL "
            f"{shape['launch_to_end_s']['trl']:.1f} s, asyncrl "
            f"{shape['launch_to_end_s']['asyncrl']:.1f} s",
            flush=True,
        )
    worst = min(results["shapes"].values(), key=lambda s: s["samples_per_s_ratio"]["median"])
    headline(
        "asyncrl / TRL samples/s, worst shape (goal >= 1.0)",
        ratio_stats(worst["runs"], "samples_per_s"),
        note,
    )


def _plot(fig: Any, results: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    names = list(results["shapes"])
    for i, name in enumerate(names):
        runs = results["shapes"][name]["runs"]
        for side, dx in (("trl", -0.15), ("asyncrl", 0.15)):
            ys = [r[side]["samples_per_s"] for r in runs]
            ax.scatter([i + dx] * len(ys), ys, label=side if i == 0 else None)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("trained samples/s (step 1 to end)")
    ax.legend()


if __name__ == "__main__":
    main()
