"""A member lost while the learner's broadcast runs: the learner's real sender and
coordinator (the stand-in learner), servers over the real control socket and real gloo
groups on 127.0.0.1, each server a thread of this process.

A member that joined the group and then stopped reading (a frozen process, or one whose
sockets outlive it) holds the learner's broadcast: gloo's root waits for every peer, and
neither ``abort()`` nor anything else ends that wait before the collective's timeout."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrl.control.client import CoordinatorClient
from asyncrl.sync.groups import form_group, open_store, store_prefix
from tests.helpers import wait_until
from tests.standins.learner import StandInLearner, loopback_config
from tests.test_sync_lost_members import Member, _rows

SYNC_TIMEOUT_S = 30.0  # what the learner's broadcast waited for the frozen member
DEAD_AFTER_S = 1.0
CONFIG = [
    f"sync.timeout_s={SYNC_TIMEOUT_S:g}",
    "control.heartbeat_s=0.2",
    f"control.dead_after_s={DEAD_AFTER_S:g}",
]


def _big_weights() -> dict:
    """One 16 MB tensor: more than loopback's socket buffers hold, so a broadcast to a
    member that does not read cannot complete (a bucket of its own: one bucket)."""
    import torch

    return {"embed.weight": torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))}


class FrozenMember:
    """Joins the next sync's group, then stops: it reads nothing and its heartbeats end
    (the coordinator declares it dead after ``control.dead_after_s``); the group stays
    open, as a frozen process's does, until :meth:`close`."""

    def __init__(self, cfg, server_id: str) -> None:
        self.client = CoordinatorClient.from_config(
            cfg, server_id, engine_world_size=1, timeout_s=5.0
        )
        self.joined = threading.Event()
        self._stop = threading.Event()
        self._group = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> FrozenMember:
        self.client.register()
        self.client.start_watching()
        self._thread.start()
        return self

    def _run(self) -> None:
        start = None
        while start is None and not self._stop.is_set():
            start = self.client.next_sync(0.1)
        if start is None:
            return
        reg = self.client.registered
        assert reg is not None
        store = open_store(reg.sync_store_host, reg.sync_store_port, is_host=False, timeout_s=5)
        prefix = store_prefix(reg.sync_secret, start.generation)
        self._group = form_group(
            store, prefix, start.rank, start.world_size, timeout_s=start.timeout_s
        )
        self.client.close()  # frozen: no heartbeat, no report
        self.joined.set()
        self._stop.wait()

    def close(self) -> None:
        self._stop.set()
        self.client.close()
        self._thread.join(5)
        self._group = None  # nothing posted on it: its connections close at once


@contextlib.contextmanager
def _pushed_with_f_frozen(
    cfg, tensors: dict, hold_a: threading.Event | None = None
) -> Iterator[tuple[StandInLearner, Member, Any, float]]:
    """The stand-in learner pushes ``tensors`` (version 1) to server a and to f, which
    freezes once in the group: yields the learner, a, the push's result and its seconds.
    ``hold_a``: a reports only once it is set (a slow member)."""
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[], tensors=tensors).start()
    a = f = None
    try:
        a = Member(cfg, "a").start()
        a.hold = hold_a
        f = FrozenMember(cfg, "f").start()
        start = time.monotonic()
        result = learner.push()
        took = time.monotonic() - start
        assert f.joined.is_set()
        yield learner, a, result, took
    finally:
        for member in (a, f):
            if member is not None:
                member.close()
        learner.close()


@pytest.mark.timeout(120)
def test_a_member_lost_mid_broadcast_does_not_hold_the_learner(tmp_path) -> None:
    """Server f joined push 1's group and froze before reading. The coordinator declared it
    dead after ``dead_after_s``, but the learner's broadcast waited for it until
    ``sync.timeout_s`` (30 s here, 120 s by default): the next push and every catch-up
    waited with it. Now the broadcast is given up when the member is lost; a, which had
    received every bucket, counts as loaded, and the next push forms a group without f."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    with _pushed_with_f_frozen(cfg, _big_weights()) as (learner, a, result, took):
        assert took < SYNC_TIMEOUT_S / 2, f"the push took {took:.1f}s"
        assert (result.version, result.ok, list(result.failed)) == (1, ["a"], ["f"])
        assert "silent" in result.failed["f"], result.failed
        assert [(outcome, version) for outcome, _, version in a.log] == [("ok", 1)]
        coord = learner.coordinator
        assert "f" not in coord.servers() and coord.pending_catchups() == []
        start = time.monotonic()
        again = learner.push()  # a new group, without f, formed at once
        assert (again.version, again.ok, again.failed) == (2, ["a"], {})
        assert again.generation != result.generation
        assert time.monotonic() - start < SYNC_TIMEOUT_S / 2


@pytest.mark.timeout(120)
def test_a_member_still_receiving_when_the_send_is_given_up_is_told_and_caught_up(
    tmp_path,
) -> None:
    """Two buckets: f froze in the first, so a received the first and waited for a second
    that would not come. With the send given up and its group held aside, a waited until
    its own ``sync.timeout_s``, paused (65 s of a real run's learner starved, in a review
    of real runs, against 15 s before the give-up). The learner now tells the group's
    members through the sync store: a stops at once, reports, and is caught up."""
    import torch

    timeout_s = 30.0
    cfg, _ = loopback_config(
        tmp_path, [f"sync.timeout_s={timeout_s:g}", *CONFIG[1:], "sync.bucket_mb=16"]
    )
    g = torch.Generator().manual_seed(1)
    tensors = {f"layers.{i}.weight": torch.randn(4096, 1024, generator=g) for i in range(2)}
    with _pushed_with_f_frozen(cfg, tensors) as (learner, a, result, took):
        began = time.monotonic() - took
        assert len(learner.pusher.plan_for(tensors).buckets) == 2
        assert took < timeout_s / 2, f"the push took {took:.1f}s"
        assert result.ok == [] and sorted(result.failed) == ["a", "f"]
        assert "given up" in result.failed["a"], result.failed
        wait_until(lambda: a.log == [("failed", 1, 1)], "a's receive given up", timeout_s)
        assert time.monotonic() - began < timeout_s / 2, "a waited out its timeout"
        assert "weight receive of bucket 1 given up" in a.errors[0], a.errors
        assert "the learner gave the sync up (f was lost" in a.errors[0], a.errors
        coord = learner.coordinator
        wait_until(lambda: coord.pending_catchups() == ["a"], "a is due a catch-up")
        (caught,) = learner.serve_catchups()
        assert (caught.version, caught.ok, caught.failed) == (1, ["a"], {})
        assert learner.push().ok == ["a"]  # and it is back in the main round


@pytest.mark.timeout(120)
def test_the_close_of_a_failed_send_waits_for_reports_a_short_while(tmp_path, monkeypatch) -> None:
    """After a given-up send the round's close waits for the members' reports at most
    :data:`~asyncrl.control.coordinator.AFTER_FAILED_SEND_S`, not ``sync.timeout_s``: a
    member that received everything but reports late (its probe) is counted failed, and
    its heartbeats then say it holds the version."""
    from asyncrl.control import coordinator

    monkeypatch.setattr(coordinator, "AFTER_FAILED_SEND_S", 2.0)
    cfg, _ = loopback_config(tmp_path, CONFIG)
    hold = threading.Event()
    with _pushed_with_f_frozen(cfg, _big_weights(), hold) as (learner, a, result, took):
        assert took < SYNC_TIMEOUT_S / 2, f"the push took {took:.1f}s"
        assert result.failed["a"].startswith("the learner's send failed"), result.failed
        hold.set()  # it loaded version 1: its heartbeats say so, and no catch-up is due
        coord = learner.coordinator
        wait_until(lambda: coord.servers()["a"]["policy_version"] == 1, "a holds version 1")
        assert coord.pending_catchups() == []
        assert learner.push().ok == ["a"]
