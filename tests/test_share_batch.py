"""learner.broadcast.share_batch over a real 2-rank gloo group: rank 1 gets rank 0's batch,
arrays and metadata equal, in its wire encoding (msgpack and raw arrays)."""

import socket
from datetime import timedelta
from pathlib import Path

import msgspec
import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp
from standins.trajgen import make_group

from asyncrl import wire
from learner.broadcast import share_batch


def _batch() -> wire.Batch:
    groups = [
        wire.Group.from_trajectories(tid, make_group(tid, size, response_len=size + 1))
        for tid, size in (("train/0/0", 2), ("train/0/1/1", 3))
    ]
    return wire.Batch(batch_id=11, policy_version=4, groups=groups, lag_histogram={0: 1, 1: 1},
                      metrics={"buffer/size": 5.0}, redelivered=True)  # fmt: skip


def _summary(batch: wire.Batch) -> dict:
    """Everything a learner reads from a batch, as plain data."""
    return {
        "head": [
            batch.batch_id,
            batch.policy_version,
            batch.redelivered,
            batch.task_ids,
            sorted(batch.lag_histogram.items()),
            sorted(batch.metrics.items()),
        ],  # fmt: skip
        "metas": [msgspec.to_builtins(g.metas) for g in batch.groups],
        "arrays": [
            [t.prompt_ids.tolist(), t.response_ids.tolist(), t.logprobs.tolist()]
            for t in batch.trajectories
        ],  # fmt: skip
    }


def _worker(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    got = share_batch(_batch() if rank == 0 else None, rank, 2)
    Path(out, f"rank{rank}.json").write_bytes(msgspec.json.encode(_summary(got)))
    dist.destroy_process_group()


def test_rank_one_receives_rank_zeros_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    zero, one = (msgspec.json.decode((tmp_path / f"rank{r}.json").read_bytes()) for r in (0, 1))
    assert one == zero == msgspec.json.decode(msgspec.json.encode(_summary(_batch())))
    assert len(one["arrays"]) == 5 and np.asarray(one["arrays"][4][1]).size == 4
