"""Fuzzing the running services at scale: the buffer's trajectory and batch sockets and the
coordinator's task and control sockets, each fed N generated frames (100,000 by default;
2,000 with ``--quick``) that mix valid messages with hostile ones.

Hostile families: random bytes, valid messages cut short, declared lengths far beyond the
frame (a msgpack string "of 2 GB"), deep nesting (10,000 nested arrays), wrong field types
and unknown fields, raw arrays whose lengths disagree with the header, version spans that
do not cover the response, lists past their bounds. Each hostile frame is checked to fail
decoding before it is sent (a mutation that happens to stay valid is cut short).

Checked, and reported per socket kind: every frame was processed (a valid message: stored,
or answered) or rejected and counted by the service, by reason; every request got exactly
one reply; the services are alive at the end and serve a valid request; the process's
resident memory (services and fuzzer share it) sampled along the way, with its peak. The
run fails (exit 1) on any uncounted frame, missing reply or dead service.
"""

from __future__ import annotations

import functools
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl import wire  # noqa: E402
from asyncrl.control import messages as m  # noqa: E402
from benchmarks.common import parse_args, write_results  # noqa: E402

NAME = "fuzz_services"
LIMITS = wire.Limits(max_message_bytes=1 << 20, max_prompt_len=64, max_response_len=64)
HUGE_STRING = b"\x81\xa4kind\xdb\x7f\xff\xff\xff" + b"ab"  # a map whose value claims 2 GB
DEEP = b"\x91" * 10_000 + b"\xc0"  # 10,000 nested one-element arrays


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ----------------------------------------------------------------------- generators
def _traj_frames(task_id: str, rng: random.Random, **meta: Any) -> list[bytes]:
    n = rng.randint(1, 8)
    t = wire.Trajectory.build(
        task_id=task_id,
        prompt_ids=[rng.randrange(1000) for _ in range(rng.randint(1, 8))],
        response_ids=[rng.randrange(1000) for _ in range(n)],
        logprobs=[-rng.random() for _ in range(n)],
        reward=1.0,
        group_index=0,
        group_size=1,
        **meta,
    )
    return [bytes(f) for f in wire.encode_trajectories([t])]


def _decodes_traj(frames: list[bytes]) -> bool:
    try:
        wire.decode_packed(frames, LIMITS)
    except wire.WireError:
        return False
    return True


def _pack(obj: Any) -> bytes:
    out = msgpack.packb(obj)
    assert out is not None  # packb returns the bytes when no stream is given
    return out


def _repack(frame: bytes, **change: Any) -> bytes:
    header = msgpack.unpackb(frame)
    for key, value in change.items():
        if key.startswith("meta."):
            header["trajectories"][0][key[5:]] = value
        else:
            header[key] = value
    return _pack(header)


def trajectory_message(i: int, rng: random.Random) -> tuple[str, list[bytes]]:
    """(family, frames) for the trajectory socket; "valid" frames decode, the rest do not."""
    family = rng.choice(
        ["valid", "random", "truncated", "huge_length", "deep", "types", "arrays", "spans"]
    )
    base = _traj_frames(f"val/fuzz/{i}", rng, validation=True)
    frames = list(base)
    if family == "valid":
        return family, frames
    if family == "random":
        frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 5))]
    elif family == "truncated":
        k = rng.randrange(len(base))
        frames[k] = base[k][: rng.randrange(len(base[k]))] if base[k] else b"\x00"
    elif family == "huge_length":
        frames[0] = HUGE_STRING
    elif family == "deep":
        frames[0] = DEEP
    elif family == "types":
        change = rng.choice(
            [
                {"meta.task_id": 5},
                {"meta.reward": "1"},
                {"meta.group_size": 0},
                {"meta.response_len": 2**40},
                {"trajectories": "none"},
                {"schema": "x"},
                {"surprise": [1, 2]},
            ]
        )
        frames[0] = _repack(base[0], **change)
    elif family == "arrays":
        k = rng.choice([1, 2, 3])
        frames[k] = base[k] + b"\x00" * rng.randint(1, 16)
    else:  # spans that do not cover the response, or go back
        lie = rng.choice([[[0, 999]], [[-1, 2]], [[3, 1], [1, 1]], []])
        frames[0] = _repack(base[0], **{"meta.version_spans": lie})
    while _decodes_traj(frames):  # a harmless change: cut the header short
        frames[0] = frames[0][:-1]
    return family, frames


def _hostile_body(valid: bytes, rng: random.Random, decodes: Any) -> tuple[str, bytes]:
    family = rng.choice(["random", "truncated", "huge_length", "deep", "types"])
    if family == "random":
        body = rng.randbytes(rng.randint(1, 64))
    elif family == "truncated":
        body = valid[: rng.randrange(len(valid))]
    elif family == "huge_length":
        body = HUGE_STRING
    elif family == "deep":
        body = DEEP
    else:
        fields = msgpack.unpackb(valid)
        key = rng.choice(list(fields))
        fields[key] = rng.choice([None, -1, "x" * 5000, [1] * 3, {"a": 1}, 2**64 - 1])
        body = _pack(fields)
    while decodes(body):
        body = body[:-1]
    return family, body


def _decodes(decoder: Any, body: bytes) -> bool:
    try:
        decoder(body)
    except (wire.WireError, ValueError):
        return False
    return True


def batch_request(i: int, rng: random.Random) -> tuple[str, bytes]:
    valid = wire.encode_request(wire.BatchRequest(schema=1, consumer_id="fuzz", policy_version=0))
    if rng.random() < 0.2:
        return "valid", valid
    return _hostile_body(valid, rng, lambda b: _decodes(lambda x: wire.decode_request([x]), b))


def control_request(i: int, rng: random.Random, socket: str) -> tuple[str, bytes]:
    """(family, body) for the coordinator's ``tasks`` or ``control`` socket; a valid one is
    that socket's own kind of request (from a server it does not know: answered all the
    same)."""
    if rng.random() < 0.2:
        if socket == "tasks":
            msg: m.Message = m.TaskRequest(server_id=f"s{i}", max_tasks=1)
        else:
            msg = m.Heartbeat(
                server_id=f"s{i}", session="x", policy_version=0, seen_version=0, seen_sync=0
            )
        return "valid", msgspec.msgpack.encode(msg)
    if rng.random() < 0.1:  # a list past its bound
        many = m.TaskAck(server_id="s", task_ids=["t"] * 70_000)
        return "too_many", msgspec.msgpack.encode(many)
    valid = msgspec.msgpack.encode(m.TaskAck(server_id="s", task_ids=["train/0/1"]))
    return _hostile_body(valid, rng, lambda b: _decodes(m.decode_request, b))


# ----------------------------------------------------------------------- driving
def _counted(make: Any, rng: random.Random, families: Counter[str]) -> Iterator[bytes]:
    """Bodies from ``make(i, rng)``, counting their families as they are drawn."""
    i = 0
    while True:
        family, body = make(i, rng)
        families[family] += 1
        i += 1
        yield body


def ask_all(
    addr: str, bodies: Iterator[bytes], n: int, chunk: int = 500, timeout_s: float = 120.0
) -> list:
    """Send ``n`` bodies (generated as they go) as REQ-style requests (empty delimiter) from
    one DEALER, draining replies as they come; returns the replies (one per request, or
    fewer on a failure)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(addr)
    replies: list[list[bytes]] = []
    try:
        for start in range(0, n, chunk):
            for _ in range(min(chunk, n - start)):
                dealer.send_multipart([b"", next(bodies)])
            deadline = time.monotonic() + timeout_s
            while len(replies) < min(start + chunk, n) and time.monotonic() < deadline:
                if dealer.poll(100):
                    replies.append(dealer.recv_multipart())
    finally:
        dealer.close(0)
        ctx.term()
    return replies


def _answered(n: int, families: Counter[str], replies: list[Any]) -> dict[str, Any]:
    """What ``n`` requests of these families got: replies, processed, rejected by reason."""
    errors = Counter(r.error for r in replies if isinstance(r, wire.ErrorReply))
    return {
        "sent": n,
        "sent_by_family": dict(families),
        "replies": len(replies),
        "processed": len(replies) - sum(errors.values()),
        "rejected": sum(errors.values()),
        "rejected_by_reason": dict(errors),
        "hostile": n - families["valid"],
    }


def fuzz_buffer(n: int, rng: random.Random, rss: list[float]) -> dict[str, Any]:
    from asyncrl.net.buffer_client import BufferClient
    from buffer.core import ReplayBuffer
    from buffer.service import BufferService

    core = ReplayBuffer(batch_size=4, capacity_groups=1000, max_policy_lag=10)
    out: dict[str, Any] = {}
    with BufferService(core, limits=LIMITS) as svc:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(svc.trajectories_endpoint)
        sent: Counter[str] = Counter()
        for i in range(n):
            family, frames = trajectory_message(i, rng)
            push.send_multipart(frames)
            sent[family] += 1
            if i % max(1, n // 10) == 0:
                rss.append(_rss_mb())
        push.close(30_000)  # every frame leaves before the context ends (0 would drop the rest)
        ctx.term()
        with BufferClient(svc.batches_endpoint, "fuzz-check", timeout_s=30) as client:
            hostile = n - sent["valid"]
            # Until every frame is seen, or nothing new was seen for 30 s.
            last, last_change = -1.0, time.monotonic()
            while True:
                stats = client.stats()
                rejects = {
                    k.split("/")[-1]: int(v)
                    for k, v in stats.items()
                    if k.startswith("buffer/rejects/trajectories/")
                }
                seen = sum(rejects.values()) + stats.get("buffer/trajectories_in", 0)
                if seen != last:
                    last, last_change = seen, time.monotonic()
                if seen >= n or time.monotonic() - last_change > 30:
                    break
                time.sleep(0.2)
            out["trajectories"] = {
                "sent": n,
                "sent_by_family": dict(sent),
                "processed": int(stats.get("buffer/trajectories_in", 0)),
                "rejected": sum(rejects.values()),
                "rejected_by_reason": rejects,
                "hostile": hostile,
            }
            fams: Counter[str] = Counter()
            replies = ask_all(svc.batches_endpoint, _counted(batch_request, rng, fams), n)
            rss.append(_rss_mb())
            decoded = [wire.decode_reply(r[-1:]) for r in replies]
            out["batches"] = _answered(n, fams, decoded)
            out["buffer_alive"] = svc._thread is not None and svc._thread.is_alive()
            out["buffer_serves_after"] = isinstance(client.stats(), dict)
    return out


def fuzz_coordinator(n: int, rng: random.Random, rss: list[float]) -> dict[str, Any]:
    from asyncrl.config import load_config
    from asyncrl.control.coordinator import Coordinator
    from asyncrl.control.setup import state_from_config
    from asyncrl.tasks import make_row

    rows = [
        make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(64)
    ]
    state = state_from_config(load_config("configs/cpu_demo.yaml"), rows, [])
    coord = Coordinator(
        state,
        tasks_addr="tcp://127.0.0.1:*",
        control_addr="tcp://127.0.0.1:*",
        max_message_bytes=LIMITS.max_request_bytes,  # as control.max_message_mb sets it
    )
    coord.start()
    out: dict[str, Any] = {}
    try:
        for sock_name, addr in (("tasks", coord.tasks_addr), ("control", coord.control_addr)):
            fams: Counter[str] = Counter()
            before = coord.metrics().get("coordinator/rejects", 0)
            make = functools.partial(control_request, socket=sock_name)
            replies = ask_all(addr, _counted(make, rng, fams), n)
            rss.append(_rss_mb())
            decoded = [m.decode_reply(r[-1]) for r in replies]
            out[f"coordinator_{sock_name}"] = _answered(n, fams, decoded) | {
                "counted_by_service": int(coord.metrics().get("coordinator/rejects", 0) - before)
            }
        out["coordinator_alive"] = coord.running
    finally:
        coord.stop()
    return out


def check(results: dict[str, Any]) -> list[str]:
    """Every frame processed or rejected and counted, a reply per request, services up."""
    problems = []
    for kind in ("trajectories", "batches", "coordinator_tasks", "coordinator_control"):
        r = results[kind]
        if r["processed"] + r["rejected"] != r["sent"]:
            problems.append(f"{kind}: {r['processed']} + {r['rejected']} != {r['sent']} sent")
        if r["rejected"] != r["hostile"]:
            problems.append(f"{kind}: {r['rejected']} rejected, {r['hostile']} hostile")
        if "replies" in r and r["replies"] != r["sent"]:
            problems.append(f"{kind}: {r['replies']} replies to {r['sent']} requests")
        if "counted_by_service" in r and r["counted_by_service"] != r["rejected"]:
            problems.append(f"{kind}: service counted {r['counted_by_service']} rejects")
    for alive in ("buffer_alive", "buffer_serves_after", "coordinator_alive"):
        if not results[alive]:
            problems.append(f"{alive} is false")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, (__doc__ or "").split("\n", 1)[0], argv)
    logging.basicConfig(level=logging.ERROR)  # one warning per rejected message otherwise
    n = 2_000 if args.quick else 100_000
    rng = random.Random(0)
    rss = [_rss_mb()]
    start = time.monotonic()
    results = fuzz_buffer(n, rng, rss) | fuzz_coordinator(n, rng, rss)
    results["seconds"] = time.monotonic() - start
    results["rss_mb"] = {"start": rss[0], "peak": max(rss), "end": rss[-1], "samples": rss}
    problems = check(results)
    results["crashes"] = 0 if not any("alive" in p or "serves" in p for p in problems) else 1
    results["problems"] = problems

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        ax.plot(rss, marker="o")
        ax.set_xlabel("sample (along the run)")
        ax.set_ylabel("resident memory, MB")
        ax.set_title(f"fuzzing {n:,} frames per socket kind")

    json_path, _ = write_results(
        NAME,
        args.out,
        figures=results,
        config={"frames_per_kind": n, "quick": args.quick},
        plot=plot,
    )
    for kind in ("trajectories", "batches", "coordinator_tasks", "coordinator_control"):
        r = results[kind]
        print(
            f"{kind:20s} sent {r['sent']:>7,}  processed {r['processed']:>7,}  "
            f"rejected {r['rejected']:>7,}  by reason {r['rejected_by_reason']}"
        )
    print(
        f"memory: start {rss[0]:.0f} MB, peak {max(rss):.0f} MB, end {rss[-1]:.0f} MB; "
        f"crashes: {results['crashes']}; {results['seconds']:.0f} s; wrote {json_path}"
    )
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
