"""What a failed weight sync leaves behind: a round the learner's meeting gave up on while
the coordinator lost a member (the learner's real sender and coordinator, a server over the
real control socket and real gloo groups on 127.0.0.1), and the files of a pushed adapter
vLLM refused (the real engine and adapter versions over a stand-in vLLM)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from asyncrl.control.client import CoordinatorClient
from asyncrl.sync.adapter import save_peft_adapter
from asyncrl.sync.plan import WeightPlan
from tests.helpers import wait_until
from tests.standins.learner import StandInLearner, loopback_config
from tests.test_sync_lost_members import Member, _rows

SYNC_TIMEOUT_S = 2.0  # how long the learner's meeting waits for a server that never joins


@pytest.mark.timeout(60)
def test_a_member_lost_as_the_learners_meeting_gives_up_begins_no_round_nobody_sends(
    tmp_path, monkeypatch
) -> None:
    """Server c registered and never joined push 1's group: the learner's meeting gave up
    after ``sync.timeout_s``, and c left just then, before the learner closed the round.
    The loss began push 1 again as sync 2, which the learner never sent: its close of
    sync 1 closed sync 2 after waiting ``sync.timeout_s`` more for a's report, and a waited
    as long in sync 2's meeting for a learner that never came."""
    cfg, _ = loopback_config(
        tmp_path,
        [
            f"sync.timeout_s={SYNC_TIMEOUT_S:g}",
            "control.heartbeat_s=0.2",
            "control.dead_after_s=30",
        ],
    )
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    coord = learner.coordinator
    a = None
    c = CoordinatorClient.from_config(cfg, "c", engine_world_size=1, timeout_s=5.0)
    close = coord.finish_sync

    def c_leaves_first(*args: Any, **kwargs: Any) -> Any:
        if "c" in coord.servers():  # the coordinator's thread loses c before the close
            c.leave("gone")
            wait_until(lambda: "c" not in coord.servers(), "c's leave at the coordinator")
        return close(*args, **kwargs)

    try:
        a = Member(cfg, "a").start()
        c.register()  # never joins a sync group
        monkeypatch.setattr(coord, "finish_sync", c_leaves_first)
        rnd = learner.pusher.begin(learner.tensors)
        assert rnd.members == ["a", "c"]
        start = time.monotonic()
        result = learner.pusher.complete(rnd, learner.tensors)
        took = time.monotonic() - start
        assert result.sync_id == rnd.sync_id, f"closed sync {result.sync_id} after {took:.1f}s"
        assert result.ok == [] and set(result.failed) == {"a", "c"}
        assert coord.metrics().get("coordinator/syncs_restarted", 0) == 0
        assert took < 2 * SYNC_TIMEOUT_S
        monkeypatch.undo()
        again = learner.push()  # a new group without c, formed at once
        assert (again.version, again.ok, again.failed) == (2, ["a"], {})
    finally:
        c.close()
        if a is not None:
            a.close()
        learner.close()


class RefusingLoRA:
    """A stand-in vLLM whose worker writes each pushed adapter's folder, as rank 0's
    ``wsync_receive_adapter`` does, and whose ``add_lora`` fails while ``refuse`` (vLLM
    refuses an adapter: a rank above ``max_lora_rank``, a module it cannot wrap)."""

    def __init__(self) -> None:
        import torch

        self.refuse = True
        self.tensors = {
            "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
            "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8),
        }

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        if method == "wsync_receive_adapter":
            out_dir, rank, alpha = args[2:]
            save_peft_adapter(out_dir, self.tensors, rank=rank, alpha=alpha)
            return [{"tensors": float(len(self.tensors)), "seconds": 0.0}]
        return [None]

    async def add_lora(self, request: Any) -> bool:
        if self.refuse:
            raise ValueError(f"cannot load the adapter at {request.lora_path}")
        return True

    async def remove_lora(self, key: int) -> bool:
        return True

    async def update_weight_version(self, version: str) -> None:
        return None


def test_the_files_of_an_adapter_vllm_refuses_are_deleted(tmp_path: Path) -> None:
    """A pushed adapter vLLM refused was never loaded, so never pruned: every failed push
    of a new version left its folder (the adapter's size) until the server exited."""
    from rollout_servers.adapters import AdapterVersions
    from rollout_servers.engine import RolloutEngine

    adapters = AdapterVersions(tmp_path, keep=2, rank=8, alpha=16)
    llm = RefusingLoRA()
    engine = RolloutEngine(llm, adapters=adapters)

    async def pushes(versions: range) -> None:
        for version in versions:
            try:
                await engine.sync_weights(version, WeightPlan(), timeout_s=5.0)
            except ValueError:
                assert llm.refuse
            else:
                assert not llm.refuse

    asyncio.run(pushes(range(1, 6)))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    llm.refuse = False
    asyncio.run(pushes(range(6, 10)))
    assert adapters.versions == [8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v8-3", "v9-4"]


class FailingAbort(RefusingLoRA):
    """Loads every adapter; its abort fails (the engine busy or going down)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = False
        self.aborts = 0

    async def abort(self, request_ids: Any) -> None:
        self.aborts += 1
        raise RuntimeError("engine core busy")


def test_a_failed_move_off_a_stale_adapter_fails_no_push(tmp_path: Path) -> None:
    """The new adapter is loaded and current when the requests on one past the kept ones
    are aborted to move: an abort that raises is tried again at the next adapter, and the
    push that brought the new one counts as done (it failed the sync, and the server was
    sent its weights again). A request it did end reads as moved, as vLLM ends them before
    the step that raises."""
    from rollout_servers.adapters import AdapterVersions

    adapters = AdapterVersions(tmp_path, keep=1, rank=8, alpha=16)
    llm = FailingAbort()

    async def activations() -> None:
        for version in (1, 2, 3):
            adapters.path_for(version).mkdir()
            await adapters.activate(llm, version)
            if version == 1:
                assert adapters.acquire("r1") is not None

    asyncio.run(activations())
    assert adapters.version == 3
    assert llm.aborts == 2  # at version 2, and again at version 3
    assert adapters.moved("r1")  # ended "abort" by the call, it goes on on the current one
    assert not adapters.moved("r1")  # asked once
