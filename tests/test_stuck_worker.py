"""A worker stuck in a weight receive is told from a slow push by its progress
(:mod:`rollout_servers.sync_progress`), not by a bound on the whole call.

The whole call used to be bounded by ``sync.timeout_s * (4 + buckets)``: 4.9 hours for a
7B model in 142 buckets at 120 s a wait, long after the learner had dropped the server,
which stayed paused; and a push slower than a wait per bucket (loading is not in the
waits) was declared stuck. The engine here wraps a stand-in for vLLM whose workers record
their buckets as the real ones do (:class:`~rollout_servers.sync_progress.WorkerProgress`);
the last test runs the real worker extension's receive over a gloo group.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.sync.groups import form_group, open_store
from asyncrl.sync.plan import TensorSpec, plan_buckets, specs_of
from asyncrl.sync.weights import send_weights
from rollout_servers.engine import RolloutEngine, SyncJoin
from rollout_servers.sync_progress import ProgressWatch, WorkerProgress, unless_stuck
from rollout_servers.worker_ext import WeightSyncExtension
from tests.helpers import free_port

TIMEOUT_S = 0.2  # sync.timeout_s: a stall is declared after two of them


def plan_of(buckets: int):
    """A plan of ``buckets`` buckets of one small tensor each."""
    specs = [TensorSpec(f"w{i}", (256,), "float32") for i in range(buckets)]
    return plan_buckets(specs, bucket_bytes=1024)


class PacedWorkers:
    """The ``AsyncLLM`` calls a full-weight sync makes, with workers (tensor-parallel
    ranks) that receive one bucket every ``gap_s`` and record it; a worker whose rank is in
    ``stops`` stops moving after that many buckets, and ``join_hangs`` makes the join never
    end."""

    def __init__(self, gap_s: float, stops: dict[int, int] | None = None, ranks: int = 2):
        self.gap_s, self.stops, self.ranks = gap_s, stops or {}, ranks
        self.join_hangs = False
        self.folder = ""
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[dict]:
        if method == "wsync_record_progress":
            self.folder = args[0]
            return [{}] * self.ranks
        if method == "wsync_join":
            if self.join_hangs:
                await asyncio.Event().wait()
            return [{}] * self.ranks
        plan = args[0]
        return list(await asyncio.gather(*(self._receive(r, plan) for r in range(self.ranks))))

    async def _receive(self, rank: int, plan: Any) -> dict:
        progress = WorkerProgress(self.folder, rank)
        progress(0)
        for i in range(len(plan.buckets)):
            if self.stops.get(rank) == i:
                await asyncio.Event().wait()  # stuck: never ends, never moves
            await asyncio.sleep(self.gap_s)
            progress(i + 1)
        return {"tensors": float(len(plan.buckets))}

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append("pause")

    async def reset_prefix_cache(self) -> None:
        pass

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"label {version}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    def shutdown(self) -> None:
        pass


@contextlib.asynccontextmanager
async def watched(llm: PacedWorkers) -> AsyncIterator[RolloutEngine]:
    """An engine over ``llm`` whose workers record their progress; shut down after."""
    engine = RolloutEngine(llm)
    try:
        await engine.watch_workers()
        yield engine
    finally:
        engine.shutdown()


def test_a_slow_push_that_keeps_moving_is_not_declared_stuck():
    """12 buckets at 1.5 waits each (a wait, then loading): 3.6 s, past the old whole-call
    bound of 0.2 * (4 + 12) = 3.2 s and past two waits, yet every bucket moves."""

    async def run() -> None:
        llm = PacedWorkers(gap_s=1.5 * TIMEOUT_S)
        async with watched(llm) as engine:
            loop = asyncio.get_running_loop()
            start = loop.time()
            stats = await engine.sync_weights(1, plan_of(12), timeout_s=TIMEOUT_S)
            assert loop.time() - start > TIMEOUT_S * (4 + 12)
            assert not engine.errored and engine.version == 1 and stats["tensors"] == 12
            assert llm.calls == ["pause", "label 1", "resume"]

    asyncio.run(run())


def test_a_worker_that_stops_moving_is_declared_stuck_whatever_the_bucket_count():
    """Of two workers receiving 50 buckets, one stops after its third: the other moves on
    to the end (1 s), and the worker is declared stuck about two waits after that (the old
    bound: 0.2 * (4 + 50) = 10.8 s). Any worker's record moving counts as movement: the
    slowest's count can drop (a worker's first record after another's higher one)."""

    async def run() -> None:
        llm = PacedWorkers(gap_s=0.02, stops={1: 3})
        async with watched(llm) as engine:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(RuntimeError, match="wsync_receive received no bucket .* stuck"):
                await engine.sync_weights(1, plan_of(50), timeout_s=TIMEOUT_S)
            took = loop.time() - start
            assert 2 * TIMEOUT_S < took < 50 * llm.gap_s + 3 * TIMEOUT_S + 0.5, took
            assert engine.errored and engine.version == 0 and "resume" not in llm.calls

    asyncio.run(run())


def test_a_join_that_never_ends_is_declared_stuck_whatever_the_bucket_count():
    """A join is three waits however many buckets follow: stuck after four."""

    async def run() -> None:
        llm = PacedWorkers(gap_s=0.02)
        llm.join_hangs = True
        async with watched(llm) as engine:
            join = SyncJoin("127.0.0.1", 1, "g1", 1, 2, "gloo")
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(RuntimeError, match="wsync_join did not end .* stuck"):
                await engine.sync_weights(1, plan_of(50), join=join, timeout_s=TIMEOUT_S)
            # Fifty buckets' waits would be 10 s: the bound leaves a loaded machine 2 s of slack.
            assert 4 * TIMEOUT_S < loop.time() - start < 4 * TIMEOUT_S + 2.0
            assert engine.errored

    asyncio.run(run())


class CpuWorker(WeightSyncExtension):
    """The worker extension as vLLM mixes it in, on the CPU, without a model."""

    rank = 0
    device = "cpu"


def test_the_worker_extension_records_each_bucket_it_receives(tmp_path: Path) -> None:
    """The real receive (``wsync_receive_adapter``: no model needed) over a gloo group
    records 0 as it begins and then every bucket, in the folder the engine told it."""
    import torch

    tensors = {
        f"model.layers.{i}.self_attn.q_proj.lora_A.weight": torch.full((8, 64), float(i))
        for i in range(5)
    }
    plan = plan_buckets(specs_of(tensors), bucket_bytes=8 * 64 * 4)
    assert len(plan.buckets) == 5
    port = free_port()
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=10.0)
    worker = CpuWorker()
    worker.wsync_record_progress(str(tmp_path))
    recorded: list[int] = []
    record = worker._wsync_progress
    worker._wsync_progress = lambda n: (recorded.append(n), record(n))  # type: ignore[assignment]
    done: dict[str, Any] = {}

    def receive() -> None:
        worker.wsync_join("127.0.0.1", port, "g1", 1, 2, "gloo", 10.0)
        done["stats"] = worker.wsync_receive_adapter(plan, 10.0, str(tmp_path / "a"), 8, 16.0)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    group = form_group(store, "g1", 0, 2, timeout_s=10.0)
    send_weights(group, tensors, plan, timeout_s=10.0)
    thread.join(20)
    worker.wsync_leave()
    assert done["stats"]["tensors"] == 5
    assert recorded == [0, 1, 2, 3, 4, 5]
    assert (tmp_path / "0").read_text() == "5"


def test_a_receive_whose_slowest_count_drops_is_not_declared_stuck():
    """Rank 0's records are read first (up to 3), then rank 1 starts at 0 and both move a
    bucket every 1.5 waits: the slowest's count dropped from 3 to 0, and a watch that
    waited for it to pass 3 again declared the moving receive stuck."""

    async def call(folder: str) -> str:
        first, second = WorkerProgress(folder, 0), WorkerProgress(folder, 1)
        for i in range(4):
            first(i)
            await asyncio.sleep(0.15)
        for i in range(8):
            first(i)
            second(i)
            await asyncio.sleep(1.5 * TIMEOUT_S)
        return "done"

    async def run() -> None:
        watch = ProgressWatch()
        try:
            assert await unless_stuck(call(watch.folder), TIMEOUT_S, 100.0, watch) == "done"
        finally:
            watch.close()

    asyncio.run(run())


def test_a_progress_folder_removed_meanwhile_is_made_again():
    """A cleaner of temporary files removed the folder: the next receive makes it again
    and is watched as before (every sync after failed with FileNotFoundError)."""

    async def run() -> None:
        llm = PacedWorkers(gap_s=0.02)
        async with watched(llm) as engine:
            assert engine.progress is not None
            shutil.rmtree(engine.progress.folder)
            stats = await engine.sync_weights(1, plan_of(3), timeout_s=TIMEOUT_S)
            assert stats["tensors"] == 3 and not engine.errored
            assert sorted(os.listdir(engine.progress.folder)) == ["0", "1"]

    asyncio.run(run())


def test_a_dead_servers_progress_folder_is_removed_by_the_next_server(tmp_path, monkeypatch):
    """A server killed with SIGKILL leaves its folder behind: the next server's watch
    removes it. A folder whose server is alive, and anything else there, are kept."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = tmp_path / f"asyncrl-wsync-progress-{int(gone.stdout)}-abc"
    alive = tmp_path / f"asyncrl-wsync-progress-{os.getppid()}-def"
    other = tmp_path / "asyncrl-wsync-progress-xyz"  # not one of ours: no pid
    # Names anyone may make in /tmp that are no pid: every server start failed on them
    odd = [tmp_path / f"asyncrl-wsync-progress-{n}-x" for n in ("9" * 20, "\u00b2", "12a")]
    for folder in (dead, alive, other, *odd):
        folder.mkdir()
        (folder / "0").write_text("3")
    watch = ProgressWatch()
    try:
        left = sorted(p.name for p in tmp_path.iterdir())
        assert dead.name not in left and {alive.name, other.name} <= set(left)
        assert {p.name for p in odd} <= set(left)
        assert Path(watch.folder).parent == tmp_path
        assert Path(watch.folder).name.startswith(f"asyncrl-wsync-progress-{os.getpid()}-")
    finally:
        watch.close()


def test_a_folder_that_could_not_be_removed_is_not_said_removed(tmp_path, monkeypatch):
    """Another user's folder in a shared /tmp cannot be removed: it is left, and not
    logged as removed at every server start."""
    from rollout_servers import sync_progress

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / f"asyncrl-wsync-progress-{int(gone.stdout)}-abc").mkdir()
    monkeypatch.setattr(sync_progress.shutil, "rmtree", lambda *a, **k: None)  # not ours
    assert sync_progress.remove_orphans(str(tmp_path)) == []
    monkeypatch.undo()
    assert len(sync_progress.remove_orphans(str(tmp_path))) == 1
