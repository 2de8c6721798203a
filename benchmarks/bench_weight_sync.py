"""Weight sync throughput: the real sync path against a raw broadcast, same run.

The sender (this process, rank 0) pushes the tensors of the ``small`` model's shapes
(~24M float32 parameters, random values; no model build needed) to receiver processes over
a gloo group on 127.0.0.1, through :func:`asyncrl.sync.weights.send_weights` (pack into
dtype-grouped buckets, one broadcast per bucket) for each bucket size of a sweep. The
baseline is one broadcast of one pre-allocated flat buffer of the same total size, with no
packing. Both end with a barrier, so each time covers delivery to every receiver.
Receivers iterate over the received tensors without copying them (loading them into a
model is the engine's cost, not the transport's). Both ends' waits ask whether to give the
push up, as a run's do (the sender its round's watch, a receiver the sync store).

Per bucket size, one untimed push of each side first (the sender's reused pack buffers are
allocated then, as in a run's first push), then the two sides interleaved for an odd number
of repetitions (:func:`benchmarks.common.interleaved_ratio`); a repetition's ratio is its
real GB/s over its raw GB/s. Last line: the median of those ratios at the default bucket
size (``sync.bucket_mb``) with their min and max. Goal: at least 0.8. The raw side is one
un-pipelined broadcast, so a pipelined sync of several buckets can beat it (ratio > 1).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RatioStats,
    format_ratio,
    headline,
    interleaved_ratio,
    parse_args,
    write_results,
)

NAME = "bench_weight_sync"
TIMEOUT_S = 120.0
GOAL = 0.8


def small_model_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the ``small`` model (Qwen2: hidden 512, 8 layers, vocab 259)."""
    from asyncrl.prepare.model import SIZES

    s = SIZES["small"]
    head = s.hidden // s.heads
    kv = s.kv_heads * head
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (259, s.hidden)}
    for i in range(s.layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "q_proj.weight": (s.hidden, s.hidden),
                p + "q_proj.bias": (s.hidden,),
                p + "k_proj.weight": (kv, s.hidden),
                p + "k_proj.bias": (kv,),
                p + "v_proj.weight": (kv, s.hidden),
                p + "v_proj.bias": (kv,),
                p + "o_proj.weight": (s.hidden, s.hidden),
                p + "gate_proj.weight": (s.intermediate, s.hidden),
                p + "up_proj.weight": (s.intermediate, s.hidden),
                p + "down_proj.weight": (s.hidden, s.intermediate),
                p + "input_layernorm.weight": (s.hidden,),
                p + "post_attention_layernorm.weight": (s.hidden,),
            }
        )
    shapes["norm.weight"] = (s.hidden,)
    return shapes


def _receiver(conn, port: int, rank: int, world: int) -> None:
    """Receiver process: consumes ``("plan", WeightPlan)`` / ``("raw", numel)`` commands,
    receives one broadcast each and answers ``"done"``; ``None`` ends it."""
    import torch

    from asyncrl.sync.groups import form_group, given_up, open_store
    from asyncrl.sync.weights import receive_weights

    store = open_store("127.0.0.1", port, is_host=False, timeout_s=TIMEOUT_S)
    pg = form_group(store, "bench", rank, world, timeout_s=TIMEOUT_S)
    asks = given_up(store, "bench")  # as a server's worker asks, every 50 ms of a wait
    conn.send("ready")
    # The baseline's buffer, kept between repetitions: a fresh one in each was allocated and
    # page-faulted inside the timed window (about 36 ms of ~97 MB on a busy machine), and
    # the ratio then credited the real path with the baseline's allocation.
    flats: dict[int, Any] = {}
    while (cmd := conn.recv()) is not None:
        kind, arg = cmd
        if kind == "plan":
            for _name, _tensor in receive_weights(pg, arg, timeout_s=TIMEOUT_S, abandon=asks):
                pass
        else:
            if arg not in flats:
                flats[arg] = torch.zeros(arg, dtype=torch.float32)  # zeros: touched now
            pg.broadcast(flats[arg], 0, timedelta(seconds=TIMEOUT_S)).wait()
        pg.barrier().wait()
        conn.send("done")


def _timed(pg, conns, command, send) -> float:
    for c in conns:
        c.send(command)
    start = time.perf_counter()
    send()
    pg.barrier().wait()
    elapsed = time.perf_counter() - start
    for c in conns:
        assert c.recv() == "done"
    return elapsed


def _start(receivers: int) -> tuple[Any, list[Any], list[Any]]:
    """Spawn the receivers and form the group with them: (group, pipes, processes)."""
    from asyncrl.net.ports import free_ports
    from asyncrl.sync.groups import form_group, open_store

    port = free_ports("127.0.0.1", 1)[0]  # a free port for the sync store
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(1, receivers + 1):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(child, port, rank, receivers + 1), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    pg = form_group(store, "bench", 0, receivers + 1, timeout_s=TIMEOUT_S)
    assert all(c.recv() == "ready" for c in conns)
    return pg, conns, procs


def run(
    bucket_mbs: list[float], reps: int, receivers: int, default_mb: float
) -> tuple[dict[str, Any], dict[float, RatioStats]]:
    """The sweep: JSON figures, and each bucket size's :class:`RatioStats`."""
    import torch

    from asyncrl.sync.plan import plan_buckets, specs_of
    from asyncrl.sync.weights import send_weights

    pg, conns, procs = _start(receivers)
    tensors = {n: torch.randn(shape) for n, shape in small_model_shapes().items()}
    total = sum(t.numel() for t in tensors.values())
    nbytes = total * 4
    flat = torch.randn(total)

    def raw_gb_s() -> float:
        def send() -> None:
            pg.broadcast(flat, 0, timedelta(seconds=TIMEOUT_S)).wait()

        return nbytes / _timed(pg, conns, ("raw", total), send) / 1e9

    rows, stats_by_mb = [], {}
    for mb in bucket_mbs:
        plan = plan_buckets(specs_of(tensors), int(mb * 2**20))

        def real_gb_s(plan=plan) -> float:
            def send() -> None:
                # as the learner's pusher asks (its round's watch: here never)
                send_weights(pg, tensors, plan, timeout_s=TIMEOUT_S, abandon=lambda: "")

            return nbytes / _timed(pg, conns, ("plan", plan), send) / 1e9

        real_gb_s(), raw_gb_s()  # warm-up, untimed
        stats = stats_by_mb[mb] = interleaved_ratio(real_gb_s, raw_gb_s, reps)
        rows.append(_row(mb, len(plan.buckets), stats))
    for c in conns:
        c.send(None)
    for p in procs:
        p.join(10)
    figures = {
        "bytes": nbytes,
        "tensors": len(tensors),
        "receivers": receivers,
        "rows": rows,
        "default_bucket_mb": default_mb,
        "goal": GOAL,
    }
    return figures, stats_by_mb


def _row(mb: float, buckets: int, stats: RatioStats) -> dict[str, Any]:
    """One bucket size's figures (medians, the ratio's spread, every repetition); printed."""
    row = {
        "bucket_mb": mb,
        "buckets": buckets,
        "real_gb_s": statistics.median(stats.real),
        "raw_gb_s": statistics.median(stats.baseline),
        "ratio": stats.median,
        "ratio_min": stats.min,
        "ratio_max": stats.max,
        "reps": stats.to_json(),
    }
    print(
        f"bucket {mb:>6g} MB ({buckets:>3} buckets): real {row['real_gb_s']:.2f} GB/s, "
        f"raw {row['raw_gb_s']:.2f} GB/s (medians), ratio {format_ratio(stats)}",
        flush=True,
    )
    return row


def plot(fig: Any, figures: dict[str, Any]) -> None:
    """GB/s of both sides and the real/raw ratio per bucket size: medians, min-max bars."""
    rows = figures["rows"]
    xs = [r["bucket_mb"] for r in rows]

    def spread(values: list[list[float]]) -> tuple[list[float], list[list[float]]]:
        mids = [statistics.median(v) for v in values]
        return mids, [
            [m - min(v) for m, v in zip(mids, values, strict=True)],
            [max(v) - m for m, v in zip(mids, values, strict=True)],
        ]

    ax = fig.add_subplot(1, 2, 1)
    for key, fmt, label in (("real", "o-", "sync path"), ("baseline", "s--", "raw broadcast")):
        mids, err = spread([r["reps"][key] for r in rows])
        ax.errorbar(xs, mids, yerr=err, fmt=fmt, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("GB/s (median, min-max)")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    mids, err = spread([r["reps"]["ratios"] for r in rows])
    ax.errorbar(xs, mids, yerr=err, fmt="o-", capsize=3, color="tab:blue")
    ax.axhline(GOAL, color="tab:gray", linestyle=":", label=f"goal {GOAL}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("real/raw (median of reps, min-max)")
    ax.legend(fontsize=8)
    fig.suptitle(
        f"weight sync, {figures['bytes'] / 1e6:.0f} MB to {figures['receivers']} receivers "
        f"(gloo, loopback), {rows[0]['reps']['reps']} interleaved reps"
    )


def main(argv: list[str] | None = None) -> None:
    from asyncrl.config import Config

    def extra(p):
        p.add_argument("--receivers", type=int, default=2, help="receiver processes")

    args = parse_args(NAME, __doc__.split("\n\n")[0], argv, extra)
    default_mb = Config().sync.bucket_mb
    sweep = [4, default_mb, 256] if args.quick else [1, 4, 16, default_mb, 64, 256]
    reps = 5 if args.quick else 9
    figures, stats_by_mb = run(sorted(set(sweep)), reps, args.receivers, default_mb)
    json_path, png_path = write_results(
        NAME,
        args.out,
        figures=figures,
        plot=lambda fig: plot(fig, figures),
        config={"sweep_mb": sweep, "reps": reps, "receivers": args.receivers},
    )
    print(f"wrote {json_path} and {png_path}")
    headline(
        f"weight sync real/raw GB/s at bucket {default_mb:g} MB (goal >= {GOAL})",
        stats_by_mb[default_mb],
    )


if __name__ == "__main__":
    main()
