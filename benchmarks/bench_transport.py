"""Trajectories through the real buffer service vs raw ZeroMQ, same bytes, same hops.

Both paths move the same pre-encoded trajectory messages (one GRPO group per message: a
msgpack header plus raw token/logprob frames) from a producer process to a consumer over
two hops:

- buffer: producer (TrajectoryPusher) -> buffer service process (decode, validate, group,
  batch) -> consumer (BufferClient: request, decode, acknowledge each batch with the next
  request);
- raw: producer (PUSH) -> relay process (PULL, forward zero-copy, PUSH) -> consumer (PULL).

Each round's clock starts when the producer is released (after a warm-up, connections up)
and stops when the consumer holds every trajectory. The two paths run interleaved for an
odd number of repetitions (buffer, raw, raw, buffer, ...; ``interleaved_ratio`` of
``benchmarks/common.py``); a repetition's ratio is its buffer over its raw trajectories per
second. The headline is the median of those ratios with their min and max (goal: at least
0.7). Encoding is excluded from both: the producer sends pre-built frames.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from asyncrl import wire  # noqa: E402
from asyncrl.net.buffer_client import BufferClient  # noqa: E402
from asyncrl.net.transport import TrajectoryPusher  # noqa: E402
from benchmarks.common import (  # noqa: E402
    RatioStats,
    format_ratio,
    headline,
    interleaved_ratio,
    parse_args,
    write_results,
)

NAME = "bench_transport"
GOAL = 0.7


def messages(tag: str, n_groups: int, p: dict[str, int]) -> list[list[Any]]:
    """``n_groups`` messages of one group each; the array frames are shared (same bytes)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32000, p["prompt_len"], dtype=np.int32)
    response = rng.integers(0, 32000, p["response_len"], dtype=np.int32)
    logprobs = -rng.random(p["response_len"], dtype=np.float32)
    out = []
    for g in range(n_groups):
        trajs = [
            wire.Trajectory.build(
                task_id=f"{tag}-{g}",
                prompt_ids=prompt,
                response_ids=response,
                logprobs=logprobs,
                group_index=i,
                group_size=p["group_size"],
                reward=1.0,
                data_source="bench",
            )
            for i in range(p["group_size"])
        ]
        out.append(wire.encode_trajectories(trajs, check=False))
    return out


def producer(addr: str, raw: bool, tag: str, p: dict[str, int], go: Any, result: Any) -> None:
    """Send ``warmup`` groups, wait for ``go``, send ``groups``; report blocked and CPU time."""
    msgs = messages(tag, p["warmup"] + p["groups"], p)
    if raw:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, p["hwm"])
        sock.connect(addr)
        send = lambda frames: sock.send_multipart(frames, copy=False)  # noqa: E731
    else:
        pusher = TrajectoryPusher(addr, hwm=p["hwm"])
        send = pusher.send_frames
    for m in msgs[: p["warmup"]]:
        send(m)
    go.wait(60)
    cpu = time.process_time()
    for m in msgs[p["warmup"] :]:
        send(m)
    cpu = time.process_time() - cpu
    if raw:
        sock.close(linger=30_000)
        ctx.term()
        result.put({"producer_blocked_s": 0.0, "producer_cpu_s": cpu})
    else:
        pusher.close()
        result.put({"producer_blocked_s": pusher.total_wait_s, "producer_cpu_s": cpu})


def cpu_between(go: Any, done: Any, result: Any) -> None:
    """In a middle process: report its CPU seconds (all threads) between two events."""
    go.wait(120)
    cpu = time.process_time()
    done.wait(120)
    result.put({"middle_cpu_s": time.process_time() - cpu})


def buffer_process(p: dict[str, int], endpoints: Any, events: tuple[Any, Any, Any]) -> None:
    """The real service, in its own process (set up as ``buffer/main.py`` sets up its
    process), until the consumer asks it to shut down."""
    from buffer.core import ReplayBuffer
    from buffer.memory import collect_on_schedule, reuse_freed_memory
    from buffer.service import BufferService

    reuse_freed_memory()
    collect_every_s = collect_on_schedule()
    core = ReplayBuffer(
        batch_size=p["batch_groups"], capacity_groups=p["capacity"], max_policy_lag=10**6
    )
    service = BufferService(
        core, rcvhwm=p["hwm"], log_every_s=1e9, collect_every_s=collect_every_s
    ).start()
    endpoints.put((service.trajectories_endpoint, service.batches_endpoint))
    cpu_between(*events)
    service.wait()


def relay_process(p: dict[str, int], endpoints: Any, events: tuple[Any, Any, Any]) -> None:
    """PULL -> PUSH forwarding of whole multipart messages, zero-copy."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.setsockopt(zmq.RCVHWM, p["hwm"])
    push.setsockopt(zmq.SNDHWM, p["hwm"])
    pull.bind("tcp://127.0.0.1:*")
    push.bind("tcp://127.0.0.1:*")
    endpoints.put(tuple(s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (pull, push)))
    reporter = threading.Thread(target=cpu_between, args=events, daemon=True)
    reporter.start()
    stop = events[1]
    while not stop.is_set():
        if pull.poll(100):
            push.send_multipart(pull.recv_multipart(copy=False), copy=False)
    # The reporter wakes on the same event; without this join the process could end before
    # it has put its CPU figure, and the consumer would wait for a result never sent.
    reporter.join(60)
    pull.close(0)
    push.close(0)
    ctx.term()


def run_buffer(p: dict[str, int], tag: str, mpc: Any) -> dict[str, float]:
    endpoints, result, go, done = mpc.Queue(), mpc.Queue(), mpc.Event(), mpc.Event()
    service = mpc.Process(
        target=buffer_process, args=(p, endpoints, (go, done, result)), daemon=True
    )
    service.start()
    traj_ep, batch_ep = endpoints.get(timeout=60)
    prod = mpc.Process(target=producer, args=(traj_ep, False, tag, p, go, result), daemon=True)
    prod.start()
    client = BufferClient(batch_ep, "bench", timeout_s=30)
    client.hello()

    def take(groups: int) -> None:
        got, trained = 0, []
        while got < groups:
            # Each batch acknowledged with the next request, as the learner does without
            # intermediate checkpoints (save_freq <= 0).
            batch = client.request_batch(0, wait_s=5.0, ack=trained)
            if batch is None:
                raise RuntimeError(
                    f"buffer stalled after {got} of {groups} groups (producer exit code "
                    f"{prod.exitcode}): {client.stats()}"
                )
            got += len(batch.groups)
            assert all(len(g) == p["group_size"] for g in batch.groups)
            trained = [batch.batch_id]
        client.ack(trained)

    take(p["warmup"])
    out = timed(go, done, lambda: take(p["groups"]))
    out |= result.get(timeout=60) | result.get(timeout=60)
    stats = client.stats()
    client.shutdown()
    client.close()
    prod.join(30)
    service.join(30)
    assert stats["buffer/rejects/total"] == 0 and stats["buffer/drops/duplicate"] == 0
    return out


def run_raw(p: dict[str, int], tag: str, mpc: Any) -> dict[str, float]:
    endpoints, result, go, done = mpc.Queue(), mpc.Queue(), mpc.Event(), mpc.Event()
    relay = mpc.Process(target=relay_process, args=(p, endpoints, (go, done, result)), daemon=True)
    relay.start()
    in_ep, out_ep = endpoints.get(timeout=60)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, p["hwm"])
    pull.connect(out_ep)
    prod = mpc.Process(target=producer, args=(in_ep, True, tag, p, go, result), daemon=True)
    prod.start()

    def take(count: int) -> None:
        for _ in range(count):
            if not pull.poll(30_000):
                raise RuntimeError("raw path stalled")
            frames = pull.recv_multipart(copy=False)
            assert len(frames) == 4

    take(p["warmup"])
    out = timed(go, done, lambda: take(p["groups"]))
    out |= result.get(timeout=60) | result.get(timeout=60)
    prod.join(30)
    relay.join(30)
    pull.close(0)
    ctx.term()
    return out


def timed(go: Any, done: Any, consume: Any) -> dict[str, float]:
    """Release the producer, consume everything; wall and consumer CPU seconds."""
    start, cpu = time.perf_counter(), time.process_time()
    go.set()
    consume()
    out = {"seconds": time.perf_counter() - start, "consumer_cpu_s": time.process_time() - cpu}
    done.set()
    return out


ROLES = ("producer", "middle", "consumer")


def plot(fig: Any, figures: dict[str, Any], stats: RatioStats) -> None:
    paths = ("buffer", "raw")
    colors = ["tab:blue", "tab:gray"]
    ax = fig.add_subplot(1, 3, 1)
    ax.bar(paths, [figures[f"{path}_traj_per_s"] for path in paths], color=colors)
    for i, path in enumerate(paths):
        rounds = [r["traj_per_s"] for r in figures["rounds"] if r["path"] == path]
        ax.plot([i] * len(rounds), rounds, "k.")
    ax.set_title("trajectories/s\n(median, dots: rounds)", fontsize=9)
    ax = fig.add_subplot(1, 3, 2)
    med = stats.median
    ax.bar(
        ["buffer/raw"],
        [med],
        yerr=[[med - stats.min], [stats.max - med]],
        capsize=6,
        color="tab:blue",
    )
    ax.plot([0] * stats.reps, stats.ratios, "k.")
    ax.axhline(GOAL, color="tab:gray", linestyle=":", label=f"goal {GOAL}")
    ax.set_title("ratio per repetition\n(median, min-max, dots: reps)", fontsize=9)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 3, 3)
    width = 0.38
    for i, path in enumerate(paths):
        xs = [j + (i - 0.5) * width for j in range(len(ROLES))]
        ax.bar(
            xs,
            [figures[f"{path}_cpu_us_per_traj"][r] for r in ROLES],
            width,
            color=colors[i],
            label=path,
        )
    ax.set_xticks(range(len(ROLES)), ["producer", "buffer/relay", "consumer"], fontsize=8)
    ax.set_title("CPU us per trajectory\n(buffer service or relay in the middle)", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle(f"buffer service vs raw zmq, 2 hops: ratio {format_ratio(stats)} (goal {GOAL})")


def side(
    path: str, run: Callable[..., dict[str, float]], p: dict[str, int], mpc: Any, rounds: list
) -> Callable[[], float]:
    """One path as a rate for :func:`interleaved_ratio`: each call runs a round, appends its
    figures to ``rounds``, prints them and returns its trajectories per second."""
    traj_bytes = 4 * p["prompt_len"] + 8 * p["response_len"]  # payload frames only

    def measure() -> float:
        r = sum(1 for x in rounds if x["path"] == path)
        out = run(p, f"r{r}-{path}", mpc)
        tps = p["groups"] * p["group_size"] / out["seconds"]
        rounds.append(
            {"path": path, "round": r, **out, "traj_per_s": tps, "mb_per_s": tps * traj_bytes / 1e6}
        )
        cpu = " ".join(f"{k[:-6]}={v:.2f}" for k, v in out.items() if k.endswith("_cpu_s"))
        print(
            f"round {r} {path:6s}: {tps:8.0f} trajectories/s {tps * traj_bytes / 1e6:7.1f} "
            f"MB/s in {out['seconds']:.2f}s; CPU s: {cpu}",
            flush=True,
        )
        return tps

    return measure


def summary(rounds: list[dict[str, Any]], stats: RatioStats, n_traj: int) -> dict[str, Any]:
    """The JSON figures: every round, per-path medians, and the ratio's repetitions."""
    figures: dict[str, Any] = {"rounds": rounds}
    for path in ("buffer", "raw"):
        mine = [r for r in rounds if r["path"] == path]
        for key in ("traj_per_s", "mb_per_s"):
            figures[f"{path}_{key}"] = statistics.median(r[key] for r in mine)
        figures[f"{path}_cpu_us_per_traj"] = {
            role: statistics.median(r[f"{role}_cpu_s"] for r in mine) / n_traj * 1e6
            for role in ROLES
        }
    figures |= {"ratio": stats.median, "ratio_min": stats.min, "ratio_max": stats.max}
    figures["ratio_stats"] = stats.to_json()
    figures["goal"] = GOAL
    return figures


def main(argv: list[str] | None = None) -> None:
    args = parse_args(NAME, __doc__.split("\n", 1)[0], argv)
    p = {
        "group_size": 8,
        "prompt_len": 128,
        "response_len": 1024,
        "batch_groups": 16,
        "groups": 2048 if args.quick else 8192,
        "warmup": 64,
        "rounds": 5 if args.quick else 9,  # per path; odd: the median is one repetition's
        "hwm": 1000,
        "capacity": 4096,
    }
    mpc = mp.get_context("spawn")
    rounds: list[dict[str, Any]] = []
    stats = interleaved_ratio(
        side("buffer", run_buffer, p, mpc, rounds),
        side("raw", run_raw, p, mpc, rounds),
        p["rounds"],
    )
    figures = summary(rounds, stats, p["groups"] * p["group_size"])
    traj_bytes = 4 * p["prompt_len"] + 8 * p["response_len"]
    json_path, png_path = write_results(
        NAME,
        args.out,
        figures=figures,
        config={**p, "trajectory_payload_bytes": traj_bytes, "quick": args.quick},
        plot=lambda fig: plot(fig, figures, stats),
    )
    print(f"wrote {json_path} and {png_path}")
    headline("transport buffer/raw trajectories per s", stats)


if __name__ == "__main__":
    main()
