"""Conventions every benchmark follows (DESIGN.md section 8).

- ``--quick`` runs in under a minute (where no model engine must start); the default is the
  full measurement.
- Results go to ``results/<bench name>/`` (``results/<bench name>_quick/`` with ``--quick``;
  gitignored; ``--out`` overrides): ``<name>.json``
  with the figures, the benchmark's config, the hardware and package versions, and
  ``<name>.png``, a plot drawn with matplotlib's Agg backend.
- The last line printed is the headline ratio, measured in the same run against its
  baseline: ``<what>: <ratio>`` (e.g. ``transport buffer/raw trajectories per s: 0.83``).
- Benchmarks never fail on an absolute time; goals are reported next to the measurement.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_ROOT = Path("results")
PACKAGES = ("asyncrl", "numpy", "pyzmq", "msgspec", "msgpack", "pyarrow", "matplotlib")


def parse_args(
    name: str, description: str, argv: Sequence[str] | None = None, extra: Callable | None = None
) -> argparse.Namespace:
    """``--quick`` and ``--out`` for every benchmark; ``extra(parser)`` adds its own."""
    parser = argparse.ArgumentParser(prog=f"benchmarks/{name}.py", description=description)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
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
    """CPU model and core counts, memory, OS and Python: enough to compare runs."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
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
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    fig = plt.figure(figsize=(8, 4.5))
    plot(fig)
    fig.tight_layout()
    png_path = out_dir / f"{name}.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path


def headline(what: str, ratio: float) -> None:
    """Print the headline ratio; call it last."""
    print(f"{what}: {ratio:.3f}", flush=True)
