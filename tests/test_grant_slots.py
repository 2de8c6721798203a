"""A grant fits the server's free response slots, whatever a group's size.

A rollout server asks for as many tasks as groups of ``rollout.n`` fit in its free slots
(``rollout.max_inflight``). Validation groups are ``rollout.val_kwargs.n`` responses, and
veRL users set that above ``rollout.n`` (avg@k on a benchmark): before, four such groups
came in one grant and the server ran ``4 * val_kwargs.n`` responses where it had room for
``4 * rollout.n``. Now the request says its free slots (``max_samples``) and a grant takes
tasks while their responses fit, and always its first one (a group larger than every slot
is run alone). A real Coordinator and a real CoordinatorClient on 127.0.0.1, and a rollout
server with stand-in parts for what its request says.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.control import coordinator_from_config
from asyncrl.control.client import CoordinatorClient
from asyncrl.tasks import make_row
from tests.standins.learner import loopback_config
from tests.standins.server_parts import N, StandInClient, StandInEngine, stand_in_server

VAL_N = 8


def _rows(split: str, count: int) -> list[dict]:
    return [
        make_row("arithmetic", f"{i}+1=", str(i + 1), split=split, index=i) for i in range(count)
    ]


@pytest.mark.timeout(60)
def test_a_grant_of_validation_groups_fits_the_servers_free_slots(tmp_path) -> None:
    cfg, _ = loopback_config(
        tmp_path,
        [
            "control.heartbeat_s=0.2",
            "rollout.n=2",
            f"rollout.val_kwargs.n={VAL_N}",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "trainer.val_before_train=false",
        ],
    )
    val_rows = _rows("test", 10)
    with coordinator_from_config(
        cfg, train_rows=_rows("train", 8), val_rows=val_rows, buffer=False
    ) as coord:
        coord.start_validation(0)  # a round of 10 groups, dealt before training
        client = CoordinatorClient.from_config(cfg, "rollout-0", engine_world_size=0)
        try:
            client.register()
            # Room for 8 responses, asked as four groups of rollout.n=2: one group of 8.
            first = client.request_tasks(4, wait_s=0.0, max_samples=8).tasks
            assert [(t.validation, t.n) for t in first] == [(True, VAL_N)]
            # Room for 4: a group of 8 is still dealt, alone (it could never fit).
            alone = client.request_tasks(4, wait_s=0.0, max_samples=4).tasks
            assert [t.n for t in alone] == [VAL_N]
            # Room for 16: two groups.
            two = client.request_tasks(4, wait_s=0.0, max_samples=16).tasks
            assert [t.n for t in two] == [VAL_N, VAL_N]
            # A request that does not say its room (0) gets what it asks for, as before.
            rest = client.request_tasks(4, wait_s=0.0).tasks
            assert [t.n for t in rest] == [VAL_N] * 4
        finally:
            client.close()


def test_the_server_asks_with_its_free_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request carries the free slots (``rollout.max_inflight`` less the responses in
    flight), not the tasks it wants times ``rollout.n``."""
    from rollout_servers import task_groups

    # Sampling parameters are the engine's business; importing vLLM for them takes seconds.
    monkeypatch.setattr(task_groups, "sampling_params", lambda settings, task, index: None)

    async def scenario() -> list[int]:
        client = StandInClient(tasks=1)
        client.register()
        engine = StandInEngine()  # its gate stays shut: the task stays in flight
        srv = stand_in_server(client, engine, None)
        run = asyncio.create_task(srv._task_loop())
        for _ in range(100):
            if len(client.max_samples) >= 2:
                break
            await asyncio.sleep(0.02)
        srv.stop()
        await run
        for t in list(srv.tasks):
            t.cancel()
        srv.lanes.close()
        return client.max_samples

    said = asyncio.run(scenario())
    assert said[:2] == [4 * N, 3 * N], said
