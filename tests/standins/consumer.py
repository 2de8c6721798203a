"""Stand-in learner: says hello, takes batches, acknowledges some, reports each on stdout.

``python -m tests.standins.consumer ENDPOINT [--consumer-id ID] [--version V] [--batches N]
[--ack K] [--acked-through B] [--delay-s S] [--idle-s S] [--hang]``

Prints ``{"welcome": {...}}``, then one line per batch (``batch_id``, ``task_ids``,
``redelivered``, ``lag_histogram``, ``validation``, ``sizes``, ``acked``, ``data_ok``: every
array matches what :func:`tests.standins.trajgen.make_traj` generated), then ``{"done": n}``.
Acknowledges the first K batches it gets (-1: all) right away. With ``--hang`` it then waits
to be killed, holding the rest unacknowledged.
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import numpy as np

from asyncrl import wire
from asyncrl.net.buffer_client import BufferClient
from tests.standins.trajgen import make_traj


def data_ok(batch: wire.Batch) -> bool:
    for t in batch.trajectories:
        m = t.meta
        want = make_traj(
            m.task_id,
            m.group_index,
            m.group_size,
            prompt_len=m.prompt_len,
            response_len=m.response_len,
        )
        if not (
            np.array_equal(t.prompt_ids, want.prompt_ids)
            and np.array_equal(t.response_ids, want.response_ids)
            and np.array_equal(t.logprobs, want.logprobs)
        ):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--consumer-id", default="learner")
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--ack", type=int, default=-1)
    parser.add_argument("--acked-through", type=int, default=None)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    client = BufferClient(args.endpoint, args.consumer_id, timeout_s=10)
    welcome = client.hello(acked_through=args.acked_through, wait_s=30)
    print(json.dumps({"welcome": msgspec.structs.asdict(welcome)}), flush=True)
    got = 0
    idle_since = time.monotonic()
    while got < args.batches and time.monotonic() - idle_since < args.idle_s:
        batch = client.request_batch(args.version, wait_s=1.0)
        if batch is None:
            continue
        idle_since = time.monotonic()
        ack = args.ack < 0 or got < args.ack
        if ack:
            client.ack([batch.batch_id])
        record = {
            "batch_id": batch.batch_id,
            "task_ids": batch.task_ids,
            "redelivered": batch.redelivered,
            "lag_histogram": {str(k): v for k, v in batch.lag_histogram.items()},
            "validation": [g.validation for g in batch.groups],
            "sizes": [len(g) for g in batch.groups],
            "acked": ack,
            "data_ok": data_ok(batch),
        }
        print(json.dumps(record), flush=True)
        got += 1
        if args.delay_s:
            time.sleep(args.delay_s)
    print(json.dumps({"done": got}), flush=True)
    if args.hang:
        while True:
            time.sleep(1)
    client.close()


if __name__ == "__main__":
    main()
