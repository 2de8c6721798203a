"""Conventions every benchmark follows (docs/DESIGN.md section 8).

- ``--quick`` runs in under a minute (where no model engine must start); the default is the
  full measurement.
- Results go to ``results/<bench name>/`` (``results/<bench name>_quick/`` with ``--quick``;
  gitignored; ``--out`` overrides): ``<name>.json``
  with the figures, the benchmark's config, the hardware and package versions, and
  ``<name>.png``, a plot drawn with matplotlib's Agg backend.
- The last line printed is the headline ratio, measured in the same run against its
  baseline: ``<what>: <median> (min <min>, max <max>, <n> reps)`` (e.g. ``transport
  buffer/raw trajectories per s: 0.83 (min 0.71, max 0.90, 3 reps)``).
- A ratio is never one sample: on a shared machine a single pair measures the machine's
  noise (the same ratio printed 0.35, 1.16 and 0.49 in three runs). The two sides run
  interleaved (A, B, B, A, ...) an odd number of times, at least 3 with ``--quick``, through
  :func:`interleaved_ratio`; the headline is the median of the per-repetition ratios with
  their min and max, and the JSON keeps every repetition (:meth:`RatioStats.to_json`).
  Sides that are whole runs rather than callables (a launch each) pair their repetitions
  through :func:`paired_ratio`.
- Exceptions to three ``--quick`` repetitions, where a repetition is a set of whole
  launches that each start model engines: ``vs_trl.py`` (its quick mode is a
  test, ``tests/test_bench_vs_trl.py``, at about 2 minutes a repetition: three would
  triple it) and ``throughput.py`` (7 minutes with one repetition, about 15 with three).
  They run one repetition with ``--quick`` (``--reps`` raises it), and their quick headline
  says so:
  ``<median> (min <min>, max <max>, 1 rep (quick: not a measurement))``
  (:data:`QUICK_NOTE`).
- Benchmarks never fail on an absolute time; goals are reported next to the measurement.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_ROOT = Path("results")
PACKAGES = (
    "asyncrl",
    "numpy",
    "pyzmq",
    "msgspec",
    "msgpack",
    "pyarrow",
    "matplotlib",
    # The model stack: a learner or engine figure moves with these. One not installed is
    # recorded as null.
    "torch",
    "transformers",
    "vllm",
    "trl",
    "peft",
)
QUICK_NOTE = "quick: not a measurement"


def _affinity() -> list[int] | None:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


# The cores this process was given, taken when a benchmark imports this module: before it
# pins itself (bench_learner narrows its affinity per case), so that the record says what
# the machine offered as well as what the measurement used.
AFFINITY_AT_START = _affinity()


def parse_args(
    name: str, description: str, argv: Sequence[str] | None = None, extra: Callable | None = None
) -> argparse.Namespace:
    """``--quick`` and ``--out`` for every benchmark; ``extra(parser)`` adds its own."""
    parser = argparse.ArgumentParser(prog=f"benchmarks/{name}.py", description=description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run (seconds, or minutes where rollout engines start)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results folder (default {RESULTS_ROOT / name}, or {name}_quick with --quick)",
    )
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    if args.out is None:  # a quick check never overwrites a full run's results
        args.out = RESULTS_ROOT / (f"{name}_quick" if args.quick else name)
    return args


def hardware() -> dict[str, Any]:
    """CPU model and core counts, memory, OS and Python: enough to compare runs.

    ``cpus_usable`` is the cores the process could use when it started
    (:data:`AFFINITY_AT_START`), ``cpus_pinned`` those it is pinned to now, when the results
    are written (fewer where the benchmark pinned itself for its measurement)."""
    now = _affinity()
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(AFFINITY_AT_START) if AFFINITY_AT_START is not None else None,
        "cpus_pinned": len(now) if now is not None else None,
        "affinity_at_start": AFFINITY_AT_START,
        "affinity_pinned": now,
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        # Other work on the machine skews every figure: say how busy it was.
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if "model name" in ln]
        info["cpu_model"] = models[0] if models else platform.processor()
    except OSError:
        info["cpu_model"] = platform.processor()
    try:
        meminfo = Path("/proc/meminfo").read_text().split("\n", 1)[0]
        info["mem_total_gb"] = round(int(meminfo.split()[1]) / 1e6, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def versions(packages: Sequence[str] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity (a target never reached, a mean of nothing) as
    None: ``json.dumps`` writes them as bare ``NaN``, which strict JSON readers (jq,
    JavaScript) refuse."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_text(value: Any, indent: int | None = None) -> str:
    """``value`` as strict JSON (:func:`json_safe`)."""
    return json.dumps(json_safe(value), indent=indent, allow_nan=False)


def write_results(
    name: str,
    out_dir: Path,
    *,
    figures: dict[str, Any],
    config: dict[str, Any],
    plot: Callable[[Any], None],
) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.png`` (``plot(fig)`` draws on a new figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "figures": figures,
        "config": config,
        "hardware": hardware(),
        "versions": versions(),
    }
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json_text(record, indent=2) + "\n")
    fig = plt.figure(figsize=(8, 4.5))
    plot(fig)
    fig.tight_layout()
    png_path = out_dir / f"{name}.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path


@dataclass(frozen=True)
class RatioStats:
    """The repetitions of one real/baseline comparison and the summary of their ratios.

    ``real[i]`` and ``baseline[i]`` are repetition ``i``'s measurements, ``ratios[i]`` is
    ``real[i] / baseline[i]``; ``median``, ``min`` and ``max`` are over ``ratios``. Pairing
    by repetition (rather than dividing the two sides' medians) keeps the noise that hit
    both sides of one repetition out of its ratio.
    """

    real: list[float]
    baseline: list[float]
    ratios: list[float]
    median: float
    min: float
    max: float

    @property
    def reps(self) -> int:
        return len(self.ratios)

    def to_json(self) -> dict[str, Any]:
        """Every repetition and the summary, for a benchmark's JSON figures."""
        return {
            "reps": self.reps,
            "real": list(self.real),
            "baseline": list(self.baseline),
            "ratios": list(self.ratios),
            "median": self.median,
            "min": self.min,
            "max": self.max,
        }


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of one figure's repetitions."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def check_reps(reps: int) -> int:
    """``reps`` if it is a valid repetition count (odd, at least 1), else ValueError.

    Odd, so that the median is the ratio of one real repetition rather than the mean of two.
    """
    if reps < 1 or reps % 2 == 0:
        raise ValueError(
            f"reps must be an odd count of at least 1, got {reps}: use {max(1, reps + 1)}"
        )
    return reps


def interleaved_ratio(
    real: Callable[[], float], baseline: Callable[[], float], reps: int
) -> RatioStats:
    """Run ``real`` and ``baseline`` ``reps`` times, interleaved; summarise real/baseline.

    Each callable takes no argument and returns one measurement as a *rate* (higher is
    better: bytes/s, items/s), so a ratio above 1 means the real path is faster. A
    benchmark that measures times passes ``1 / seconds`` (or documents its own direction).
    Repetition ``i`` runs both sides back to back, real first on even ``i`` and baseline
    first on odd ``i``, so drift in the machine's load and order effects (a warm cache,
    the previous side's memory still being freed) fall on both sides alike. ``reps`` must
    be odd (see :func:`check_reps`). Raises ValueError on a measurement that is not a
    positive finite number.
    """
    check_reps(reps)
    sides = {"real": real, "baseline": baseline}
    got: dict[str, list[float]] = {"real": [], "baseline": []}
    for i in range(reps):
        for side in ("real", "baseline") if i % 2 == 0 else ("baseline", "real"):
            value = float(sides[side]())
            _check_rate(side, i, value)
            got[side].append(value)
    return paired_ratio(got["real"], got["baseline"])


def _check_rate(side: str, rep: int, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{side} measurement {value!r} of repetition {rep} is not a positive rate; "
            "return items per second (1 / seconds for a time)"
        )


def paired_ratio(real: Sequence[float], baseline: Sequence[float]) -> RatioStats:
    """The :class:`RatioStats` of measurements already taken, ``real[i]`` and
    ``baseline[i]`` in the same repetition (rates, as :func:`interleaved_ratio` takes):
    for sides run by the benchmark itself, such as whole launches in a round-robin.
    ValueError on unequal lengths, no repetition, or a value that is not a positive rate."""
    if len(real) != len(baseline) or not real:
        raise ValueError(f"need paired repetitions, got {len(real)} and {len(baseline)}")
    for side, values in (("real", real), ("baseline", baseline)):
        for i, value in enumerate(values):
            _check_rate(side, i, float(value))
    ratios = [r / b for r, b in zip(real, baseline, strict=True)]
    return RatioStats(
        real=[float(r) for r in real],
        baseline=[float(b) for b in baseline],
        ratios=ratios,
        median=statistics.median(ratios),
        min=min(ratios),
        max=max(ratios),
    )


def format_ratio(stats: RatioStats, note: str | None = None) -> str:
    """``"<median> (min <min>, max <max>, <n> reps)"``, two decimals each; ``note`` follows
    the count in parentheses (``1 rep (quick: not a measurement)``)."""
    reps = f"{stats.reps} rep{'' if stats.reps == 1 else 's'}"
    if note:
        reps += f" ({note})"
    return f"{stats.median:.2f} (min {stats.min:.2f}, max {stats.max:.2f}, {reps})"


def quick_note(quick: bool, reps: int) -> str | None:
    """:data:`QUICK_NOTE` for a quick run of fewer than three repetitions (the exceptions
    in the module docstring), else None."""
    return QUICK_NOTE if quick and reps < 3 else None


def headline(what: str, ratio: float | RatioStats, note: str | None = None) -> None:
    """Print the headline ratio; call it last.

    A :class:`RatioStats` prints as :func:`format_ratio` (median and spread, ``note`` after
    the count); a bare float (a single figure, such as a simulation's deterministic output)
    prints with three decimals.
    """
    text = format_ratio(ratio, note) if isinstance(ratio, RatioStats) else f"{ratio:.3f}"
    print(f"{what}: {text}", flush=True)


def launch_run(config: str, overrides: Sequence[str], root: Path, name: str) -> Path:
    """One run of ``asyncrl-launch config overrides`` under ``root`` (project ``bench``,
    experiment ``name``: no checkpoint resumed, metrics to jsonl only); its run directory.
    RuntimeError with the launcher's last output when it fails."""
    import subprocess
    import time

    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch",
        config,
        *overrides,
        f"trainer.default_local_dir={root}",
        "trainer.project_name=bench",
        f"trainer.experiment_name={name}",
        "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    print(f"run {name} finished in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return root / "bench" / name
