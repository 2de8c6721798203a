"""Weight sync throughput: the real sync path against a raw broadcast, same run.

The sender (this process, rank 0) pushes the tensors of the ``small`` model's shapes
(~24M float32 parameters, random values; no model build needed) to receiver processes over
a gloo group on 127.0.0.1, through :func:`asyncrl.weight_sync.send_weights` (pack into
dtype-grouped buckets, one broadcast per bucket) for each bucket size of a sweep. The
baseline is one broadcast of one pre-allocated flat buffer of the same total size, with no
packing. Both end with a barrier, so each time covers delivery to every receiver.
Receivers iterate over the received tensors without copying them (loading them into a
model is the engine's cost, not the transport's).

Last line: real/raw throughput at the default bucket size (``sync.bucket_mb``).
Goal: at least 0.8.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import headline, parse_args, write_results  # noqa: E402

NAME = "bench_weight_sync"
TIMEOUT_S = 120.0


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

    from asyncrl.weight_sync import form_group, open_store, receive_weights

    store = open_store("127.0.0.1", port, is_host=False, timeout_s=TIMEOUT_S)
    pg = form_group(store, "bench", rank, world, timeout_s=TIMEOUT_S)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        kind, arg = cmd
        if kind == "plan":
            for _name, _tensor in receive_weights(pg, arg, timeout_s=TIMEOUT_S):
                pass
        else:
            flat = torch.empty(arg, dtype=torch.float32)
            pg.broadcast(flat, 0, timedelta(seconds=TIMEOUT_S)).wait()
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


def run(bucket_mbs: list[float], reps: int, receivers: int, default_mb: float) -> dict:
    import torch

    from asyncrl.weight_sync import (
        form_group,
        open_store,
        plan_buckets,
        send_weights,
        specs_of,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
    tensors = {n: torch.randn(shape) for n, shape in small_model_shapes().items()}
    total = sum(t.numel() for t in tensors.values())
    nbytes = total * 4
    flat = torch.randn(total)

    def raw_once() -> float:
        return _timed(
            pg,
            conns,
            ("raw", total),
            lambda: pg.broadcast(flat, 0, timedelta(seconds=TIMEOUT_S)).wait(),
        )

    rows = []
    for mb in bucket_mbs:
        plan = plan_buckets(specs_of(tensors), int(mb * 2**20))
        real, raw = [], []
        for _ in range(reps):  # interleave, so machine noise hits both alike
            raw.append(raw_once())
            real.append(
                _timed(
                    pg,
                    conns,
                    ("plan", plan),
                    lambda plan=plan: send_weights(pg, tensors, plan, timeout_s=TIMEOUT_S),
                )
            )
        real_s, raw_s = statistics.median(real), statistics.median(raw)
        rows.append(
            {
                "bucket_mb": mb,
                "buckets": len(plan.buckets),
                "real_s": real_s,
                "raw_s": raw_s,
                "real_gb_s": nbytes / real_s / 1e9,
                "raw_gb_s": nbytes / raw_s / 1e9,
                "ratio": raw_s / real_s,
            }
        )
        print(
            f"bucket {mb:>6g} MB ({len(plan.buckets):>3} buckets): real {rows[-1]['real_gb_s']:.2f} "
            f"GB/s, raw {rows[-1]['raw_gb_s']:.2f} GB/s, ratio {rows[-1]['ratio']:.2f}",
            flush=True,
        )
    for c in conns:
        c.send(None)
    for p in procs:
        p.join(10)
    return {
        "bytes": nbytes,
        "tensors": len(tensors),
        "receivers": receivers,
        "rows": rows,
        "default_bucket_mb": default_mb,
    }


def main(argv: list[str] | None = None) -> None:
    from asyncrl.config import Config

    def extra(p):
        p.add_argument("--receivers", type=int, default=2, help="receiver processes")

    args = parse_args(NAME, __doc__.split("\n\n")[0], argv, extra)
    default_mb = Config().sync.bucket_mb
    sweep = [4, default_mb, 256] if args.quick else [1, 4, 16, default_mb, 64, 256]
    reps = 3 if args.quick else 7
    figures = run(sorted(set(sweep)), reps, args.receivers, default_mb)

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        xs = [r["bucket_mb"] for r in figures["rows"]]
        ax.plot(xs, [r["real_gb_s"] for r in figures["rows"]], "o-", label="sync path")
        ax.plot(xs, [r["raw_gb_s"] for r in figures["rows"]], "s--", label="raw broadcast")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket size (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title(
            f"weight sync, {figures['bytes'] / 1e6:.0f} MB to "
            f"{figures['receivers']} receivers (gloo, loopback)"
        )
        ax.legend()

    json_path, png_path = write_results(
        NAME,
        args.out,
        figures=figures,
        plot=plot,
        config={"sweep_mb": sweep, "reps": reps, "receivers": args.receivers},
    )
    print(f"wrote {json_path} and {png_path}")
    default = next(r for r in figures["rows"] if r["bucket_mb"] == default_mb)
    headline(
        f"weight sync real/raw GB/s at bucket {default_mb:g} MB (goal >= 0.8)", default["ratio"]
    )


if __name__ == "__main__":
    main()
