"""learner.broadcast.share_batch over a real 2-rank gloo group: rank 1 gets rank 0's batch,
arrays and metadata equal, in its wire encoding (msgpack and raw arrays). The learner's own
process group (``learner.fsdp.init_distributed`` under torchrun's environment) carries it and
the other CPU-side collectives the learner issues; on CUDA that group has a CPU backend."""

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl import wire
from learner.broadcast import share_batch, share_waiting
from learner.fsdp import init_distributed, process_group_backend
from learner.loop import _broadcast_int
from tests.helpers import free_port, leave_ranks, rank_env
from tests.standins.trajgen import make_group


def _batch() -> wire.Batch:
    groups = [
        wire.Group.from_trajectories(tid, make_group(tid, size, response_len=size + 1))
        for tid, size in (("train/0/0", 2), ("train/0/1/1", 3))
    ]
    return wire.Batch(
        batch_id=11,
        policy_version=4,
        groups=groups,
        lag_histogram={0: 1, 1: 1},
        metrics={"buffer/size": 5.0},
        redelivered=True,
    )


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
        ],
        "metas": [msgspec.to_builtins(g.metas) for g in batch.groups],
        "arrays": [
            [t.prompt_ids.tolist(), t.response_ids.tolist(), t.logprobs.tolist()]
            for t in batch.trajectories
        ],
    }


def _worker(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    got = share_batch(_batch() if rank == 0 else None, rank, 2)
    Path(out, f"rank{rank}.json").write_bytes(msgspec.json.encode(_summary(got)))
    leave_ranks()


def test_rank_one_receives_rank_zeros_batch(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    zero, one = (msgspec.json.decode((tmp_path / f"rank{r}.json").read_bytes()) for r in (0, 1))
    assert one == zero == msgspec.json.decode(msgspec.json.encode(_summary(_batch())))
    assert len(one["arrays"]) == 5 and np.asarray(one["arrays"][4][1]).size == 4


def _waiting_worker(rank: int, port: int, out: str) -> None:
    """Rank 0 waits three keep-alive rounds before its batch comes; rank 1 only asks."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 0:
        for _ in range(3):
            share_waiting(2)
    got = share_batch(_batch() if rank == 0 else None, rank, 2)
    end = share_batch(None, rank, 2)  # the end of training still reads as None
    Path(out, f"rank{rank}.json").write_bytes(msgspec.json.encode([_summary(got), end]))
    leave_ranks()


def test_ranks_wait_through_rank_zeros_keepalive_rounds(tmp_path):
    """While rank 0 waits for the buffer (as long as the servers take), it sends a round
    every minute: the other ranks wait again instead of timing out the group's broadcast
    (30 minutes for gloo) and ending the learner."""
    mp.start_processes(
        _waiting_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    zero, one = (msgspec.json.decode((tmp_path / f"rank{r}.json").read_bytes()) for r in (0, 1))
    assert one == zero
    assert one[0] == msgspec.json.decode(msgspec.json.encode(_summary(_batch())))
    assert one[1] is None


def _learner_rank(rank: int, port: int, out: str) -> None:
    """A learner rank as torchrun starts it: its group from the environment, then every
    collective on CPU tensors the learner issues besides FSDP's own."""
    rank_env(rank, 2, port)
    mesh = init_distributed("cpu")
    got = share_batch(_batch() if rank == 0 else None, rank, 2)  # each step's batch
    version = _broadcast_int(7 if rank == 0 else -1, SimpleNamespace(world_size=2))  # pushes
    parts: list = [None, None]
    dist.all_gather_object(parts, {rank: rank * 10})  # compute_logprobs
    dist.barrier()  # checkpoints
    result = {
        "summary": _summary(got),
        "version": version,
        "parts": parts,
        "mesh": mesh.size(),
        "default": dist.get_backend_config(),
    }
    Path(out, f"rank{rank}.json").write_bytes(msgspec.json.encode(result))
    leave_ranks()


def test_the_learners_own_group_carries_its_cpu_collectives(tmp_path):
    """Reproduces defect 2 of the dependable-runs issue on the production init path (the
    group a multi-GPU learner crashed on at its first batch had no CPU backend; here, on
    CPU, gloo is that backend)."""
    mp.start_processes(
        _learner_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    zero, one = (msgspec.json.decode((tmp_path / f"rank{r}.json").read_bytes()) for r in (0, 1))
    assert (
        one["summary"]
        == zero["summary"]
        == msgspec.json.decode(msgspec.json.encode(_summary(_batch())))
    )
    assert zero["version"] == one["version"] == 7
    assert zero["parts"] == one["parts"] == [{"0": 0}, {"1": 10}]
    assert zero["mesh"] == one["mesh"] == 2
    assert "cpu:gloo" in zero["default"]


def test_the_cuda_group_has_a_cpu_backend_beside_nccl():
    """The learner shares batches and versions as CPU tensors: a plain "nccl" group cannot
    carry them ("No backend type associated with device type cpu")."""
    for device, expected in (("cuda", {"cpu": "gloo", "cuda": "nccl"}), ("cpu", {"cpu": "gloo"})):
        backend = dist.Backend(process_group_backend(device))
        devices = dist.BackendConfig(backend).get_device_backend_map()
        assert {d: devices[d] for d in expected} == expected, (device, devices)


def _ending_worker(rank: int, port: int, out: str) -> None:
    """Rank 0 ends the run alone for a while (keep-alive rounds between); rank 1's part of
    the ending does nothing. Each writes when its ending returned."""
    import time

    from learner.control_peer import NoControl
    from learner.loop import LearnerLoop

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    # Short: without the wait, rank 0's keep-alive meets rank 1's exit barrier, a mismatch
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=10)
    )

    class Ending:
        def finish(self, step, keepalive, **how):
            for _ in range(3):  # the final validation's wait, with its keep-alive rounds
                time.sleep(0.5)
                keepalive()
            Path(out, "rank0_ended").write_text(repr(time.monotonic()))

    loop = object.__new__(LearnerLoop)
    loop.trainer = SimpleNamespace(rank=rank, world_size=2, step=3)  # type: ignore[assignment]
    loop.control = Ending() if rank == 0 else NoControl()  # type: ignore[assignment]
    loop._finish(validate=True, complete=True)
    Path(out, f"rank{rank}_returned").write_text(repr(time.monotonic()))
    leave_ranks()


@pytest.mark.timeout(120)
def test_the_other_ranks_wait_for_rank_zeros_ending(tmp_path):
    """Found by a review: the other ranks returned as soon as their own (empty) part of the
    ending was done, while rank 0 still wrote the export and waited for the final round.
    Exiting first, they cut it short: torchrun stops every rank when one exits with a
    failure (a health stop's 5), and a launcher restarts a learner node ended early."""
    mp.start_processes(
        _ending_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ended = float((tmp_path / "rank0_ended").read_text())
    assert float((tmp_path / "rank1_returned").read_text()) >= ended
