"""Catch-ups against servers that come and go: the learner's real sender and coordinator
(the stand-in learner), servers registered over the real control socket, and the launcher's
real ``Leave`` sender, on 127.0.0.1."""

from __future__ import annotations

import os
import threading

import pytest

from asyncrl.control.client import CoordinatorClient
from asyncrl.launch.departures import Departures
from asyncrl.net.transport import config_endpoint
from asyncrl.tasks import make_row
from tests.helpers import wait_until
from tests.standins.learner import StandInLearner, loopback_config

SYNC_TIMEOUT_S = 2.0  # how long the first catch-up waits for a server that never joins


def _rows(n: int) -> list[dict]:
    return [make_row("arithmetic", f"{i}+2=", str(i + 2), split="train", index=i) for i in range(n)]


@pytest.mark.timeout(60)
def test_a_server_that_leaves_while_another_is_caught_up_is_skipped(tmp_path) -> None:
    """Two servers wait for a catch-up; the launcher reaps the second (its ``Leave``)
    while the first one's catch-up runs, which lasts up to ``sync.timeout_s``. The learner
    then skips the one that left. Before the mend it started a catch-up of a server no
    longer registered: a ``KeyError`` out of the learner's step, which crashed it (and,
    with ``save_freq: -1``, sent the run back to its first step)."""
    cfg, _ = loopback_config(
        tmp_path,
        [
            f"sync.timeout_s={SYNC_TIMEOUT_S:g}",
            "control.heartbeat_s=0.2",
            "control.dead_after_s=30",
        ],
    )
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    learner.push()  # version 1, to nobody: servers that register now hold version 0
    clients = {
        sid: CoordinatorClient.from_config(cfg, sid, engine_world_size=1, timeout_s=5.0)
        for sid in ("a", "b")
    }
    departures = Departures(config_endpoint(cfg.endpoints, "control"))
    try:
        for client in clients.values():
            client.register()  # neither joins a sync group: each catch-up times out
            client.start_watching()  # heartbeats: only the Leave takes b away
        coord = learner.coordinator
        assert coord.pending_catchups() == ["a", "b"]

        def reap_b_during_as_catchup() -> None:
            wait_until(lambda: "a" not in coord.pending_catchups(), "a's catch-up to start")
            clients["b"].close()  # killed: no more heartbeats, and no registering again
            departures.send("b", os.getpid(), "killed by SIGKILL")  # its registered pid
            wait_until(lambda: "b" not in coord.servers(), "b's Leave at the coordinator")

        reaper = threading.Thread(target=reap_b_during_as_catchup, daemon=True)
        reaper.start()
        results = learner.serve_catchups()  # raised KeyError: 'b' before the mend
        reaper.join(10)
        assert not reaper.is_alive()
        assert [sorted(r.failed) for r in results] == [["a"]]  # a's, failed; none for b
        assert "b" not in coord.servers() and "a" in coord.servers()
    finally:
        departures.close()
        for client in clients.values():
            client.close()
        learner.close()
