"""Scheduler simulation: async (policy lag 1, 2, 4) against sync (lag 0), same GPUs, virtual time.

A discrete-event model of the coordinator's admission rule, continuous-batching rollout
servers, the buffer's lag filter, the learner and weight syncs (:mod:`benchmarks.sim_model`)
runs a long-tailed reasoning workload on clusters of 8 to 1024 GPUs split between rollout
servers and the learner. Costs are derived from published hardware, model and workload
figures (``benchmarks/sim_params.yaml`` cites each one); nothing is measured on this machine.

For each configuration: trained samples/s, generated and trained tokens/s, the learner's and
the servers' wait fractions, mean lag, the ratio to synchronous on the same GPUs and the
ratio to the ideal pipeline bound ``min(generation capacity, training capacity)`` (trained
tokens/s; see :mod:`benchmarks.sim_model`). "Balanced" marks splits whose two capacities are
within 10% (the split that balances them best is always added). Goal: balanced configs reach
at least 0.95 of the ideal bound. The full run adds a what-if at 256 and 1024 GPUs with the
batch grown in proportion to the GPUs (the published 512-prompt batch cannot fill them).

Last line: the async (lag 2) / sync speedup of the balanced 64-GPU configuration.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import headline, parse_args, write_results  # noqa: E402
from benchmarks.sim_model import compare_lags  # noqa: E402
from benchmarks.sim_types import (  # noqa: E402
    ResponseLengths,
    SimParams,
    SimResult,
    generation_capacity,
    training_capacity,
    with_split,
)

NAME = "simulate"
log = logging.getLogger(NAME)
DEFAULT_PARAMS = Path(__file__).resolve().parent / "sim_params.yaml"


def load_spec(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def response_lengths(w: dict[str, Any]) -> ResponseLengths:
    """The lognormal whose tail past ``max_response_length`` holds ``truncation_rate``."""
    z = statistics.NormalDist().inv_cdf(1.0 - float(w["truncation_rate"]))
    sigma = math.log(w["max_response_length"] / w["response_median"]) / z
    return ResponseLengths(
        median=float(w["response_median"]),
        sigma=sigma,
        max_length=int(w["max_response_length"]),
        prompt_share=float(w["length_prompt_share"]),
    )


def derive(spec: dict[str, Any]) -> tuple[SimParams, dict[str, float]]:
    """Base parameters (one rollout GPU, one learner GPU) and the derivation shown in the
    report. Decode is memory-bound at these batch sizes (roofline): a step reads the weights
    once and each sequence's KV cache; the mean context a step reads is token-weighted."""
    m, gpu, w = spec["model"], spec["gpu"], spec["workload"]
    ro, le, sy = spec["rollout"], spec["learner"], spec["sync"]
    lengths = response_lengths(w)
    st = lengths.stats(int(w["prompt_length"]), seed=int(spec["run"]["seed"]))
    weight_bytes = m["params"] * m["bytes_per_param"]
    kv_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["bytes_per_param"]
    bandwidth = gpu["hbm_bytes_per_s"] * ro["memory_bw_efficiency"]
    # What vLLM leaves for the KV cache (activations and CUDA graphs neglected): the batch is
    # as many sequences as fit at the mean context, capped by vLLM's max_num_seqs.
    kv_tokens = gpu["memory_bytes"] * ro["gpu_memory_utilization"] - weight_bytes
    kv_tokens /= kv_per_token
    max_num_seqs = min(int(ro["max_num_seqs_default"]), int(kv_tokens / st["decode_context"]))
    # Attention FLOPs per trained token: 4 * layers * hidden * position for a forward (QK^T
    # and AV), times 4 for the proximal forward, the forward and the backward (2 forwards).
    attention = 4 * 4 * m["layers"] * m["hidden"] * st["train_position"]
    train_flops = le["flops_per_param"] * m["params"] + attention
    params = SimParams(
        num_servers=1,
        max_num_seqs=max_num_seqs,
        n=int(w["n"]),
        train_batch_size=int(w["train_batch_size"]),
        sync_every=int(w["sync_every"]),
        tasks_per_request=int(w["tasks_per_request"]),
        decode_fixed_s=weight_bytes / bandwidth,
        decode_per_seq_s=kv_per_token * st["decode_context"] / bandwidth,
        prefill_s_per_token=2 * m["params"] / (gpu["bf16_flops"] * ro["prefill_mfu"]),
        prompt_length=int(w["prompt_length"]),
        lengths=lengths,
        train_s_per_token=train_flops / (gpu["bf16_flops"] * le["mfu"]),
        train_fixed_s=float(le["fixed_s"]),
        learner_gpus=1,
        learner_efficiency=float(le["scaling_efficiency"]),
        weight_bytes=weight_bytes,
        sync_bandwidth=float(sy["bandwidth_bytes_per_s"]),
        sync_fixed_s=float(sy["fixed_s"]),
    )
    full = params.t_step(max_num_seqs)
    derived = {
        **st,
        "response_sigma": lengths.sigma,
        "kv_bytes_per_token": kv_per_token,
        "kv_capacity_tokens": kv_tokens,
        "max_num_seqs": max_num_seqs,
        "decode_fixed_s": params.decode_fixed_s,
        "decode_per_seq_s": params.decode_per_seq_s,
        "decode_tokens_per_s_per_gpu": max_num_seqs / full,
        "train_s_per_token": params.train_s_per_token,
        "train_tokens_per_s_per_gpu": 1 / params.train_s_per_token,
        "sync_s": params.sync_s,
    }
    return params, derived


def splits(
    base: SimParams, total: int, fractions: list[float], tol: float, stats: dict[str, float]
) -> list[dict[str, Any]]:
    """Rollout:learner splits of ``total`` GPUs: the given learner fractions plus the split
    whose capacities are closest; each marked balanced when within ``tol``."""

    def gap(learner: int) -> float:
        p = with_split(base, total - learner, learner)
        g = generation_capacity(p, stats["mean_response"])
        t = training_capacity(p, stats["mean_sample_tokens"])
        return abs(g - t) / max(g, t)

    learners = {min(total - 1, max(1, round(total * f))) for f in fractions}
    best = min(range(1, total), key=gap)
    out = []
    for learner in sorted(learners | {best}):
        out.append(
            {
                "gpus": total,
                "rollout": total - learner,
                "learner": learner,
                "capacity_gap": gap(learner),
                "balanced": gap(learner) <= tol,
                "best_balance": learner == best,
            }
        )
    return out


def configurations(spec: dict[str, Any], base: SimParams, stats: dict[str, float], quick: bool):
    """``(batch scaling, split, params)`` for every configuration of the sweep: each size
    with the published batch, then (full run only) larger sizes with the batch grown in
    proportion to the GPUs ("weak"), on their best-balanced split."""
    cl, run = spec["cluster"], spec["run"]
    gpus, fractions = cl["gpus"], cl["learner_fractions"]
    if quick:
        gpus, fractions = run["quick"]["gpus"], run["quick"]["learner_fractions"]
    tol = cl["balanced_tolerance"]
    for total in gpus:
        for cfg in splits(base, total, fractions, tol, stats):
            yield "fixed", cfg, with_split(base, cfg["rollout"], cfg["learner"])
    weak = cl.get("weak_scaling") or {}
    for total in [] if quick else weak.get("gpus", []):
        batch = round(base.train_batch_size * total / weak["reference_gpus"])
        scaled = replace(base, train_batch_size=batch)
        for cfg in splits(scaled, total, [], tol, stats):
            yield "weak", cfg, with_split(scaled, cfg["rollout"], cfg["learner"])


def run_sweep(spec: dict[str, Any], quick: bool) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every configuration and lag; rows of figures for the table and the JSON."""
    base, derived = derive(spec)
    steps = spec["run"]["quick"]["steps"] if quick else spec["run"]["steps"]
    rows = []
    for scaling, cfg, params in configurations(spec, base, derived, quick):
        t0 = time.perf_counter()
        results = compare_lags(
            params, spec["cluster"]["lags"], steps=steps, seed=spec["run"]["seed"]
        )
        wall = time.perf_counter() - t0
        log.info(
            "%s %d GPUs %d:%d done in %.1f s",
            scaling,
            cfg["gpus"],
            cfg["rollout"],
            cfg["learner"],
            wall,
        )
        for r in results:
            rows.append(
                {
                    **cfg,
                    "batch": scaling,
                    "prompts_per_step": params.train_batch_size,
                    **_figures(r),
                    "budget_fill": _budget_fill(params, r.max_policy_lag + 1),
                    "sim_wall_s": wall,
                }
            )
    return rows, derived


def _budget_fill(p: SimParams, versions: int) -> float:
    """Sequences the budget lets run at once over the servers' slots."""
    return versions * p.train_batch_size * p.sync_every * p.n / (p.num_servers * p.max_num_seqs)


def _figures(r: SimResult) -> dict[str, Any]:
    d = asdict(r)
    d.pop("step_times")
    d["lag_hist"] = {str(k): v for k, v in r.lag_hist.items()}
    return {"lag": d.pop("max_policy_lag"), **d}


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'gpus':>5} {'roll:learn':>10} {'bal':>3} {'prompts':>7} {'lag':>3} {'samples/s':>9} "
        f"{'gen tok/s':>9} {'train tok/s':>11} {'L wait':>6} {'R wait':>6} {'R util':>6} "
        f"{'fill':>5} {'lag avg':>7} {'drop%':>5} {'vs sync':>7} {'vs ideal':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        split = f"{r['rollout']}:{r['learner']}"
        bal = "*" if r["best_balance"] else ("yes" if r["balanced"] else "")
        print(
            f"{r['gpus']:>5} {split:>10} {bal:>3} {r['prompts_per_step']:>7} {r['lag']:>3} "
            f"{r['samples_per_s']:>9.2f} {r['generated_tokens_per_s']:>9.0f} "
            f"{r['trained_tokens_per_s']:>11.0f} {r['learner_wait_frac']:>6.2f} "
            f"{r['rollout_wait_frac']:>6.2f} {r['rollout_util']:>6.2f} {r['budget_fill']:>5.2f} "
            f"{r['mean_lag']:>7.2f} {100 * r['drop_frac']:>5.1f} {r['ratio_to_sync']:>7.2f} "
            f"{r['ratio_to_ideal']:>8.3f}"
        )


def summarise(rows: list[dict[str, Any]], lags: list[int]) -> dict[str, Any]:
    """Per batch scaling and lag, over the best-balanced split of each size: speedup over
    sync, ratio to the ideal bound, and how many reach 0.95 of it."""
    out: dict[str, Any] = {}
    for scaling in ("fixed", "weak"):
        for lag in lags:
            sel = [
                r
                for r in rows
                if r["batch"] == scaling and r["best_balance"] and r["balanced"] and r["lag"] == lag
            ]
            if sel:
                out.setdefault(scaling, {})[str(lag)] = {
                    "speedup_vs_sync": {r["gpus"]: round(r["ratio_to_sync"], 3) for r in sel},
                    "ratio_to_ideal": {r["gpus"]: round(r["ratio_to_ideal"], 3) for r in sel},
                    "drop_frac": {r["gpus"]: round(r["drop_frac"], 3) for r in sel},
                    "median_speedup": statistics.median(r["ratio_to_sync"] for r in sel),
                    "reach_0.95": sum(r["ratio_to_ideal"] >= 0.95 for r in sel),
                    "configs": len(sel),
                }
    return out


def print_summary(summary: dict[str, Any], derived: dict[str, float]) -> None:
    print(
        "\nbal: * best-balanced split (always simulated), yes: capacities within tolerance. "
        "fill: sequences the budget lets run at once / server slots. drop%: groups dropped "
        "for lag per group generated."
    )
    print(
        f"derived: {derived['decode_tokens_per_s_per_gpu']:.0f} decode tok/s/GPU at "
        f"{derived['max_num_seqs']} seqs, {derived['train_tokens_per_s_per_gpu']:.0f} train "
        f"tok/s/GPU, sync {derived['sync_s']:.2f} s, mean response "
        f"{derived['mean_response']:.0f} tokens ({derived['truncated_frac']:.1%} truncated)"
    )
    titles = {"fixed": "published batch", "weak": "batch grown with the GPUs"}
    for scaling, per_lag in summary.items():
        print(f"best-balanced splits, {titles[scaling]}: speedup over sync / ratio to ideal")
        for lag, s in per_lag.items():
            pairs = ", ".join(
                f"{g}: {s['speedup_vs_sync'][g]:.2f}x / {s['ratio_to_ideal'][g]:.2f}"
                for g in s["speedup_vs_sync"]
            )
            print(f"  lag {lag}: {pairs}  (>= 0.95 of ideal: {s['reach_0.95']}/{s['configs']})")


def plot(fig, rows: list[dict[str, Any]], lags: list[int]) -> None:
    """Speedup over sync and ratio to ideal of the best-balanced splits, per lag; dotted:
    the batch grown with the GPUs."""
    ax1, ax2 = fig.subplots(1, 2)
    for i, lag in enumerate(lags):
        for scaling, style in (("fixed", "-"), ("weak", ":")):
            sel = [r for r in rows if r["best_balance"] and r["lag"] == lag]
            sel = [r for r in sel if r["batch"] == scaling]
            label = f"lag {lag}" if scaling == "fixed" else None
            for ax, key in ((ax1, "ratio_to_sync"), (ax2, "ratio_to_ideal")):
                xs, ys = [r["gpus"] for r in sel], [r[key] for r in sel]
                ax.plot(xs, ys, style, color=f"C{i}", marker="o", label=label)
    ax1.plot([], [], "k:", label="batch grown with GPUs")
    ax2.axhline(0.95, color="grey", linestyle="--", linewidth=1)
    for ax, title in (
        (ax1, "speedup over sync (lag 0)"),
        (ax2, "trained tokens/s / ideal (goal 0.95)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (best-balanced split)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    def extra(p):
        p.add_argument("--params", type=Path, default=DEFAULT_PARAMS, help="parameters YAML")

    args = parse_args(NAME, __doc__.split("\n\n")[0], argv, extra)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress on stderr
    spec = load_spec(args.params)
    t0 = time.perf_counter()
    rows, derived = run_sweep(spec, args.quick)
    lags = sorted(set(spec["cluster"]["lags"]) | {0})
    print_table(rows)
    summary = summarise(rows, lags)
    print_summary(summary, derived)
    write_results(
        NAME,
        args.out,
        figures={"rows": rows, "summary": summary, "derived": derived},
        config={
            "params_file": str(args.params),
            "spec": spec,
            "quick": args.quick,
            "wall_s": time.perf_counter() - t0,
        },
        plot=lambda fig: plot(fig, rows, lags),
    )
    gpus, lag = spec["cluster"]["headline_gpus"], spec["cluster"]["headline_lag"]
    pick = [
        r
        for r in rows
        if r["batch"] == "fixed" and r["gpus"] == gpus and r["best_balance"] and r["lag"] == lag
    ]
    headline(
        f"simulate async(lag {lag})/sync speedup, balanced {gpus} GPUs", pick[0]["ratio_to_sync"]
    )


if __name__ == "__main__":
    main()
