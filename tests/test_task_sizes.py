"""Large tasks on the control plane: a real Coordinator and real CoordinatorClients on
127.0.0.1 sockets, both built from one config's ``control.max_message_mb``.

Code datasets carry their tests in ``reward_model.ground_truth`` (or ``extra_info``), often
over 1 MB a row. A grant of four such tasks was over the fixed 4 MiB every reply was read
under, whatever the config said: the client raised, the tasks stayed dealt at a server that
never saw them, and the rollout server's task loop ended (restarted, it got the same).
Here grants stay within the configured bound (fewer tasks, the rest in the next grant), a
row no grant can carry is dropped and accounted, and a server that still cannot read a
grant stops with one line that names the fix.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import Config, load_config
from asyncrl.control import Coordinator, coordinator_from_config
from asyncrl.control import messages as m
from asyncrl.control.client import CoordinatorClient
from asyncrl.launch.progress import accounting_line
from asyncrl.launch.restart_policy import CONFIG_ERROR
from asyncrl.tasks import make_row
from rollout_servers.server import RolloutServer
from tests.standins.chat import CharTokenizer
from tests.standins.learner import loopback_config
from tests.standins.server_parts import StandInEngine, StandInPusher, StandInScorer

MB = 1_000_000  # a row's size as a dataset states it (the limit is in MiB)
BASE = [
    "control.heartbeat_s=0.2",
    "control.dead_after_s=30",
    "control.tasks_per_request=4",
    "data.train_batch_size=4",
    "data.shuffle=false",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=2",
    "staleness.max_policy_lag=4",  # a window of 20 groups: the budget never holds a grant
    "trainer.total_epochs=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
]


def _row(i: int, test_bytes: int) -> dict[str, Any]:
    """A code row whose unit tests (its ground truth) take ``test_bytes``."""
    tests = f"# tests of row {i}\n" + "assert f(1) == 1\n" * (test_bytes // 17)
    return make_row("code", f"row {i}", tests, split="train", index=i, ability="code")


def _row_of(task: m.Task) -> str:
    return task.prompt[-1]["content"]


@contextmanager
def _served(
    tmp_path: Path,
    rows: list[dict[str, Any]],
    mb: float,
    client_mb: float | None = None,
    register: bool = True,
) -> Iterator[tuple[Coordinator, CoordinatorClient, Config]]:
    """A coordinator over ``rows`` and one client (registered unless told not to), from a
    config with ``control.max_message_mb=mb`` (the client's own config says ``client_mb``
    when given); the coordinator's config comes third."""
    cfg, _ = loopback_config(tmp_path, [*BASE, f"control.max_message_mb={mb}"])
    client_cfg = cfg.model_copy(deep=True)
    client_cfg.control.max_message_mb = mb if client_mb is None else client_mb
    with coordinator_from_config(cfg, train_rows=rows, val_rows=[], buffer=False) as coord:
        client = CoordinatorClient.from_config(client_cfg, "rollout-0", engine_world_size=0)
        try:
            if register:
                client.register()
            yield coord, client, cfg
        finally:
            client.close()


def _take_all(client: CoordinatorClient) -> list[m.TaskGrant]:
    """Ask, and acknowledge what comes, until the dataset is spent; the grants in order."""
    grants: list[m.TaskGrant] = []
    for _ in range(50):  # a few grants are expected: many more would be a loop
        grant = client.request_tasks(4, wait_s=0.0)
        if not grant.tasks:
            assert grant.reason == "exhausted", grant.reason
            return grants
        grants.append(grant)
        client.ack([t.task_id for t in grant.tasks])
    pytest.fail(f"the dataset was never spent: {[len(g.tasks) for g in grants]} tasks per grant")


def _identity_holds(acct: dict[str, float]) -> None:
    """``dealt = in flight + in buffer + trained + dropped/* + given up``, nothing lost."""
    p = "accounting/train/"
    drops = sum(v for k, v in acct.items() if k.startswith(p + "dropped/"))
    parts = acct[p + "in_flight"] + acct[p + "in_buffer"] + acct[p + "trained"] + drops
    assert acct[p + "dealt"] == parts + acct[p + "given_up"], acct
    assert acct[p + "unaccounted"] == 0, acct


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mb", "per_grant"), [(4, 3), (64, 4)])
def test_rows_over_a_megabyte_arrive_in_grants_the_client_can_read(tmp_path, mb, per_grant):
    """Eight 1.2 MB rows: three fit under the 4 MiB default, four (as asked) under 64 MiB;
    every row arrives once, and a grant cut short by size says so."""
    rows = [_row(i, int(1.2 * MB)) for i in range(8)]
    with _served(tmp_path, rows, mb) as (coord, client, _):
        grants = _take_all(client)
        acct = coord.accounting()
    got = [_row_of(t) for g in grants for t in g.tasks]
    assert sorted(got) == sorted(f"row {i}" for i in range(8))
    sizes = [len(g.tasks) for g in grants]
    assert sizes == [per_grant] * (8 // per_grant) + ([8 % per_grant] if 8 % per_grant else [])
    if per_grant < 4:
        assert grants[0].reason == "size"
    assert acct["accounting/train/in_buffer"] == 8
    assert acct["accounting/train/dropped/oversize"] == 0
    _identity_holds(acct)


@pytest.mark.timeout(60)
def test_a_row_no_grant_can_carry_is_dropped_and_the_others_still_arrive(tmp_path, caplog):
    """Under 4 MiB: a 5 MB row is dropped before it is dealt (one line naming the key,
    counted as ``dropped/oversize``), two 3 MB rows go in grants of their own, the small
    ones with them; the dataset is spent and the accounting adds up."""
    sizes = {3: 5 * MB, 5: 3 * MB, 6: 3 * MB}
    rows = [_row(i, sizes.get(i, 1000)) for i in range(8)]
    caplog.set_level(logging.ERROR, logger="asyncrl.control.grant_size")
    with _served(tmp_path, rows, 4) as (coord, client, _):
        grants = _take_all(client)
        acct = coord.accounting()
    got = [_row_of(t) for g in grants for t in g.tasks]
    assert sorted(got) == sorted(f"row {i}" for i in range(8) if i != 3)
    by_row = {_row_of(t): k for k, g in enumerate(grants) for t in g.tasks}
    assert by_row["row 5"] != by_row["row 6"], [[_row_of(t) for t in g.tasks] for g in grants]
    assert grants[by_row["row 5"]].reason == "size"
    lines = [r.getMessage() for r in caplog.records if "dropped/oversize" in r.getMessage()]
    assert len(lines) == 1 and "control.max_message_mb=4" in lines[0], lines
    assert "\n" not in lines[0]
    p = "accounting/train/"
    assert acct[p + "dealt"] == 8 and acct[p + "dropped/oversize"] == 1, acct
    assert acct[p + "in_flight"] == 0 and acct[p + "in_buffer"] == 7, acct
    _identity_holds(acct)
    line = accounting_line(acct)
    assert line is not None and "dropped 1 (oversize 1)" in line, line


def _server(client: CoordinatorClient) -> RolloutServer:
    """A rollout server around the real client, the rest stand-ins (no task gets that far)."""
    cfg = load_config(None, ["rollout.n=2", "rollout.max_inflight=8"])
    return RolloutServer(
        cfg, "rollout-0", StandInEngine(), CharTokenizer(), StandInScorer(), StandInPusher(), client
    )


@pytest.mark.timeout(60)
def test_a_server_that_cannot_read_a_grant_stops_once_saying_why(tmp_path, caplog):
    """A server whose control.max_message_mb is below the learner's (a config of its own)
    gets a grant it cannot read: it exits 2 (not restarted, no crash loop) with one line
    that names the key, and its grant's tasks go to the next server once it leaves."""
    rows = [_row(i, int(1.2 * MB)) for i in range(8)]
    caplog.set_level(logging.ERROR, logger="rollout_servers.server")
    with _served(tmp_path, rows, 64, client_mb=4, register=False) as (_, client, cfg):
        server = _server(client)
        code = asyncio.run(asyncio.wait_for(server.run(), 30))
        assert client.leave("stopped")
        other = CoordinatorClient.from_config(cfg, "rollout-1", engine_world_size=0)
        try:
            other.register()
            grants = _take_all(other)
        finally:
            other.close()
    assert code == CONFIG_ERROR
    lines = [r.getMessage() for r in caplog.records if "control.max_message_mb" in r.getMessage()]
    assert len(lines) == 1 and "start it with the learner's config" in lines[0], lines
    assert sorted(_row_of(t) for g in grants for t in g.tasks) == [f"row {i}" for i in range(8)]


def test_a_validation_row_no_grant_can_carry_is_refused_at_start(caplog):
    """A validation row dropped as too large when dealt left each round one group short:
    no val/ score ever, and the final round waited launch.start_timeout_s. The learner's
    coordinator refuses such data in one line instead (exit 2, never restarted), and
    training rows too large are dropped and named, the first few only."""
    from asyncrl.config import ConfigError
    from asyncrl.control import grant_size
    from asyncrl.control.grant_size import GrantRoom
    from asyncrl.control.setup import task_source_from_config

    validating = [
        *(o for o in BASE if not o.startswith("trainer.test_freq")),
        "trainer.test_freq=2",
    ]
    cfg = load_config(None, [*validating, "control.max_message_mb=4"])
    val = [_row(i, MB // 10) for i in range(3)] + [_row(3, 5 * MB)]
    train = [_row(i, MB // 10) for i in range(8)]
    with pytest.raises(ConfigError) as e:
        task_source_from_config(cfg, train, val)
    assert e.value.problems == [
        "data.val_files: 1 row(s) (first: row 3) are larger than a task grant may carry "
        "under control.max_message_mb=4: raise it (in the config every role reads) or leave "
        "those rows out"
    ]
    bigger = load_config(None, [*validating, "control.max_message_mb=8"])
    assert task_source_from_config(bigger, train, val).oversize_val_rows(lambda t: True) == []
    source = task_source_from_config(cfg, [_row(i, 5 * MB) for i in range(9)], val[:3])
    room = GrantRoom(4 << 20)
    grant_size._logged = 0  # this process's count: the test names its own
    with caplog.at_level(logging.ERROR, logger="asyncrl.control.grant_size"):
        for _ in range(9):
            task = source.next_train()
            assert task is not None and room.admit(task) == "too_large"
        room.log_dropped()
    lines = [r.getMessage() for r in caplog.records if r.name == grant_size.__name__]
    assert len(lines) == grant_size.LOGGED_MAX + 1 and "counted, not named" in lines[-1]
