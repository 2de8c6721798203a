"""Sharing a buffer batch from learner rank 0 with the other ranks.

The batch travels in its wire encoding (msgpack header and raw arrays, as it came from the
buffer; never Python objects), concatenated into one byte tensor and broadcast over the learner's
process group: its length first, then the bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def share_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Rank 0 passes its ``wire.Batch`` (or None: training ends); every rank returns an
    equal one (or None)."""
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
        n = torch.zeros(1, dtype=torch.long)
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
