"""Sharing a buffer batch from learner rank 0 with the other ranks.

The batch travels in its wire encoding (msgpack header and raw arrays, as it came from the
buffer; never Python objects), concatenated into one byte tensor and broadcast over the learner's
process group: its length first, then the bytes.

While rank 0 waits for a batch (as long as the rollout servers take), it tells the other
ranks so every :data:`KEEPALIVE_S` (:func:`share_waiting`): they wait in rounds that each
end well inside the process group's timeout (30 minutes by default for gloo), instead of
one broadcast that would time out and end the learner during a long wait.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: How often rank 0 tells waiting ranks that it still waits for a batch, seconds.
KEEPALIVE_S = 60.0
_WAITING = -1  # the length broadcast that means "no batch yet, wait again"


def share_waiting(world_size: int) -> None:
    """Rank 0, while it waits for a batch: the other ranks wait one more round."""
    if world_size == 1:
        return
    import torch
    import torch.distributed as dist

    dist.broadcast(torch.tensor([_WAITING], dtype=torch.long), 0)


def hold_ranks(rank: int, world_size: int) -> None:
    """The run's end. Rank 0 ends it alone (its export's write, the final validation, the
    peers told), then calls this; the other ranks wait here until it does, taking its
    :func:`share_waiting` rounds. Returned at once, they would exit first: torchrun stops
    every rank when one exits with a failure (a health stop's 5), and a launcher restarts a
    learner node whose ranks ended early, either of which cut rank 0's ending short."""
    share_batch(None, rank, world_size)


def share_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Rank 0 passes its ``wire.Batch`` (or None: training ends); every rank returns an
    equal one (or None). The other ranks also take rank 0's :func:`share_waiting` rounds."""
    if world_size == 1:
        return batch
    import torch
    import torch.distributed as dist

    from asyncrl import wire

    if rank == 0 and batch is None:
        n = torch.zeros(1, dtype=torch.long)  # no frames: the end of training
    elif rank == 0:
        frames = [bytes(memoryview(f)) for f in wire.encode_batch(batch)]
        sizes = torch.tensor([len(frames), *map(len, frames)], dtype=torch.long)
        n = torch.tensor([sizes.numel()], dtype=torch.long)
    else:
        n = torch.full((1,), _WAITING, dtype=torch.long)
    dist.broadcast(n, 0)
    rounds = 0
    while rank != 0 and int(n.item()) == _WAITING:  # rank 0 still waits for the buffer
        rounds += 1
        log.debug("rank %d: rank 0 still waits for a batch (round %d)", rank, rounds)
        dist.broadcast(n, 0)
    if int(n.item()) == 0:
        return None
    if rank != 0:
        sizes = torch.zeros(int(n.item()), dtype=torch.long)
    dist.broadcast(sizes, 0)
    total = int(sizes[1:].sum())
    if rank == 0:
        data = torch.from_numpy(np.frombuffer(b"".join(frames), dtype=np.uint8).copy())
    else:
        data = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(data, 0)
    if rank == 0:
        return batch
    raw = data.numpy().tobytes()
    offsets = np.cumsum([0, *sizes[1:].tolist()])
    parts = [raw[offsets[i] : offsets[i + 1]] for i in range(int(sizes[0]))]
    return wire.decode_reply(parts)
