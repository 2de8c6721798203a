"""Fault simulation of the control plane: N seeded schedules, violations by invariant.

Each schedule (:mod:`benchmarks.fault_model`) drives the real coordinator state and replay
buffer through kills, restarts, message loss, duplication, delay and reordering, in virtual
time, and checks the invariants of :mod:`benchmarks.fault_checks` after every event. One
seed is one schedule: a failure replays exactly.

    .venv/bin/python benchmarks/fault_sim.py                      # 100000 schedules
    .venv/bin/python benchmarks/fault_sim.py --quick              # 2000
    .venv/bin/python benchmarks/fault_sim.py --seed 86 --replay   # one, shrunk if it fails
    .venv/bin/python benchmarks/fault_sim.py --seed 86 --replay --keep 3,17,42

A failing schedule is shrunk (events dropped while it still fails the same invariant) and
printed with the command that replays the shrunk schedule. Results go to
``results/fault_sim/fault_sim.json`` (with the hardware it ran on) and a PNG of the
violations by invariant. The last line is the headline: violations in N schedules.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import hardware, parse_args, write_results  # noqa: E402
from benchmarks.fault_api import features  # noqa: E402
from benchmarks.fault_checks import INVARIANTS  # noqa: E402
from benchmarks.fault_model import run, schedule_for, shrink  # noqa: E402
from benchmarks.fault_world import config_for  # noqa: E402

NAME = "fault_sim"
EXAMPLES = 3  # failing seeds kept per invariant
SHRUNK = 4  # failing schedules shrunk and printed


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedules", type=int, default=100_000, help="how many seeds to run")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--seed", type=int, default=None, help="the seed to replay")
    p.add_argument("--replay", action="store_true", help="replay --seed and explain it")
    p.add_argument("--keep", default="", help="replay only these event positions (a,b,...)")


def _chunk(bounds: tuple[int, int]) -> dict[str, Any]:
    """Run seeds ``[a, b)`` in a worker; their totals and failing seeds."""
    logging.disable(logging.CRITICAL)  # the classes under test log every fault they see
    a, b = bounds
    events, by_inv, seeds, skipping = 0, Counter(), {}, 0
    for seed in range(a, b):
        out = run(seed)
        events += out.events
        skipping += out.skipped > 0
        for inv in out.invariants():
            by_inv[inv] += 1
            seeds.setdefault(inv, [])
            if len(seeds[inv]) < EXAMPLES:
                seeds[inv].append(seed)
    return {
        "events": events,
        "by_invariant": dict(by_inv),
        "seeds": seeds,
        "n": b - a,
        "skipping": skipping,
    }


def run_many(start: int, count: int, workers: int) -> dict[str, Any]:
    """Seeds ``start .. start+count-1`` over ``workers`` processes; totals."""
    step = 250
    chunks = [(a, min(a + step, start + count)) for a in range(start, start + count, step)]
    t0 = time.perf_counter()
    parts: list[dict[str, Any]] = []
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for part in pool.imap_unordered(_chunk, chunks):
            parts.append(part)
            if len(parts) % 40 == 0:  # every 10000 schedules: how far, what so far
                failed = Counter()
                for p in parts:
                    failed.update(p["by_invariant"])
                done = sum(p["n"] for p in parts)
                print(f"  {done} schedules, {time.perf_counter() - t0:.0f} s: {dict(failed)}")
                sys.stdout.flush()
    total: dict[str, Any] = {
        "schedules": count,
        "events": 0,
        "by_invariant": Counter(),
        "schedules_skipping_prompts": 0,
    }
    seeds: dict[str, list[int]] = {}
    for p in parts:
        total["events"] += p["events"]
        total["schedules_skipping_prompts"] += p["skipping"]
        total["by_invariant"].update(p["by_invariant"])
        for inv, s in p["seeds"].items():
            seeds.setdefault(inv, []).extend(s)
    total["seconds"] = round(time.perf_counter() - t0, 1)
    total["by_invariant"] = {k: total["by_invariant"].get(k, 0) for k in INVARIANTS}
    total["failing_seeds"] = {k: sorted(v)[:EXAMPLES] for k, v in seeds.items()}
    return total


def replay(seed: int, keep: list[int] | None, explain: bool = True) -> list[int] | None:
    """Replay ``seed`` (its ``keep`` events); print what failed; shrink a failure."""
    out = run(seed, keep)
    cfg = config_for(seed)
    print(f"seed {seed}: {cfg}")
    print(f"  {out.events} events, {out.virtual_s:.1f} virtual s, learner step {out.steps}")
    for v in out.violations:
        where = "drain/end" if v.event < 0 else f"event {v.event}"
        print(f"  VIOLATION {v.invariant} at {where}: {v.detail}")
    if not out.failed or not explain:
        return None
    invariant = out.violations[0].invariant
    kept = shrink(seed, invariant) if keep is None else keep
    events = schedule_for(seed)
    print(f"  shrunk to {len(kept)} of {len(events)} events still violating {invariant}:")
    for i in kept:
        print(f"    {i}: {events[i]}")
    print(
        "  replay: .venv/bin/python benchmarks/fault_sim.py "
        f"--seed {seed} --replay --keep {','.join(map(str, kept))}"
    )
    return kept


def _plot(result: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        names = list(result["by_invariant"])
        ax.barh(names, [result["by_invariant"][n] for n in names])
        ax.set_xlabel(f"schedules violating it (of {result['schedules']})")
        ax.set_title("fault simulation: violations by invariant")

    return draw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, (__doc__ or NAME).splitlines()[0], argv, extra=_options)
    if args.seed is not None and args.replay:
        logging.disable(logging.CRITICAL)
        keep = [int(x) for x in args.keep.split(",") if x] if args.keep else None
        return 1 if replay(args.seed, keep) is not None else 0  # still failing: say so
    count = 2000 if args.quick and args.schedules == 100_000 else args.schedules
    hw = hardware()
    print(f"hardware: {hw.get('cpu_model')}, {args.workers} worker processes; APIs: {features()}")
    result = run_many(args.start, count, args.workers)
    failing = {k: v for k, v in result["by_invariant"].items() if v}
    print(
        f"{result['schedules']} schedules, {result['events']} events, "
        f"{result['seconds']} s; violations by invariant: {failing or 'none'}"
    )
    print(f"schedules where prompts were skipped: {result['schedules_skipping_prompts']}")
    shown = 0
    for inv, seeds in result["failing_seeds"].items():
        if shown < SHRUNK:
            print(f"-- {inv}: failing seeds {seeds}")
            logging.disable(logging.CRITICAL)
            replay(seeds[0], None)
            shown += 1
    config = {"start": args.start, "workers": args.workers, "apis": features()}
    write_results(NAME, args.out, figures=result, config=config, plot=_plot(result))
    print(
        f"violations: {sum(failing.values())} (summed over invariants) in "
        f"{result['schedules']} schedules"
    )
    return 1 if failing else 0  # a run that found violations is not a success


if __name__ == "__main__":
    raise SystemExit(main())
