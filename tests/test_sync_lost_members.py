"""Sync rounds whose members are lost, or hold partly loaded weights: the learner's real
sender and coordinator (the stand-in learner), servers over the real control socket and real
gloo groups on 127.0.0.1, each server a thread of this process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import Store  # pyright: ignore[reportPrivateImportUsage]

from asyncrl.control import messages as m
from asyncrl.control.client import CoordinatorClient
from asyncrl.sync import groups
from asyncrl.sync.groups import form_group, given_up, open_store, release_group, store_prefix
from asyncrl.sync.weights import BroadcastAbandoned, receive_weights
from asyncrl.tasks import make_row
from tests.helpers import wait_until
from tests.standins.learner import StandInLearner, loopback_config

SYNC_TIMEOUT_S = 8.0  # what a round waited for a member lost before its group formed
DEAD_AFTER_S = 1.0
CONFIG = [
    f"sync.timeout_s={SYNC_TIMEOUT_S:g}",
    "control.heartbeat_s=0.2",
    f"control.dead_after_s={DEAD_AFTER_S:g}",
]


def _rows(n: int) -> list[dict]:
    return [make_row("arithmetic", f"{i}+2=", str(i + 2), split="train", index=i) for i in range(n)]


class Member:
    """A server's side of the syncs it is told to join: it forms each new group and
    receives the weights; ``log`` has ``(outcome, sync id, version)`` per sync."""

    def __init__(self, cfg, server_id: str) -> None:
        self.client = CoordinatorClient.from_config(
            cfg, server_id, engine_world_size=1, timeout_s=5.0
        )
        self.log: list[tuple[str, int, int]] = []
        self.errors: list[str] = []
        self.starts: list[int] = []  # the sync ids it was told to join, in order
        self.received: list[int] = []  # the sync ids whose weights it received
        self.hold: threading.Event | None = None  # set: it may report (a slow member)
        self._stop = threading.Event()
        self._generation = ""
        self._group = None
        self._given_up = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Member:
        self.client.register()
        self.client.start_watching()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            start = self.client.next_sync(0.1)
            if start is None:
                continue
            self.starts.append(start.sync_id)
            try:
                reg = self.client.registered
                assert reg is not None
                if start.generation != self._generation:
                    store = open_store(
                        reg.sync_store_host, reg.sync_store_port, is_host=False, timeout_s=5
                    )
                    prefix = store_prefix(reg.sync_secret, start.generation)
                    self._group = form_group(
                        store, prefix, start.rank, start.world_size, timeout_s=start.timeout_s
                    )
                    self._generation, self._given_up = start.generation, given_up(store, prefix)
                received = receive_weights(
                    self._group, start.plan, timeout_s=start.timeout_s, abandon=self._given_up
                )
                for _ in received:
                    pass
            except Exception as e:
                if self._stop.is_set():
                    return  # crashed meanwhile: gone without a word
                self._generation = ""
                if isinstance(e, BroadcastAbandoned):  # as a server's worker does
                    release_group(self._group, busy_s=start.timeout_s)
                    self._group = None
                self.log.append(("failed", start.sync_id, start.version))
                self.errors.append(str(e))
                self.client.sync_done(start, ok=False, error=str(e))
            else:
                self.received.append(start.sync_id)
                while self.hold is not None and not self.hold.wait(0.05):
                    if self._stop.is_set():
                        return  # crashed before it reported
                self.log.append(("ok", start.sync_id, start.version))
                self.client.sync_done(start, ok=True)

    def crash(self) -> None:
        """Gone without a word: no heartbeat, no report, no Leave."""
        self._stop.set()
        self.client.close()

    close = crash


@pytest.mark.timeout(60)
def test_a_member_lost_before_the_group_forms_does_not_hold_the_others(tmp_path) -> None:
    """Server c crashed before joining the push's group: the coordinator declares it dead
    after ``dead_after_s``, and the round is begun again at once without it (same version).
    The meeting waited for c for the whole ``sync.timeout_s``, then failed for a too (a
    catch-up more; a real server's engine is paused all that time)."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    a = c = None
    try:
        a = Member(cfg, "a").start()
        c = Member(cfg, "c").start()
        c.crash()
        start = time.monotonic()
        result = learner.push()
        took = time.monotonic() - start
        assert took < DEAD_AFTER_S + 2.5, f"the push took {took:.1f}s"
        assert (result.version, result.ok, result.failed) == (1, ["a"], {})
        coord = learner.coordinator
        assert "c" not in coord.servers() and coord.pending_catchups() == []
        assert coord.metrics()["coordinator/syncs_restarted"] == 1
        # a gave the first round up with the learner, then loaded version 1 in the second
        assert [(outcome, version) for outcome, _, version in a.log] == [
            ("failed", 1),
            ("ok", 1),
        ]
        assert "c was lost" in a.errors[0]
        wait_until(lambda: coord.servers()["a"]["policy_version"] == 1, "a at version 1")
        assert learner.push().ok == ["a"]  # the group formed without c is kept
    finally:
        for member in (a, c):
            if member is not None:
                member.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_member_lost_between_the_meeting_and_the_connect_does_not_hold_the_others(
    tmp_path, monkeypatch
) -> None:
    """Server c met the others, then died before gloo connected the group (its address
    never reaches the store). Gloo's constructor waited for it ``sync.timeout_s`` on the
    learner and on a (600 s in a chaos run): the coordinator's loss of c now gives the
    group up there too, for every member, and the round is begun again without c."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    build, released = groups._build, threading.Event()
    a = c = None

    def c_dies_connecting(store, rank, world_size, backend, timeout_s):
        if (rank, world_size) != (2, 3):  # c is rank 2 of the first round's 3
            return build(store, rank, world_size, backend, timeout_s)
        assert c is not None
        c.crash()
        released.wait(30)
        raise RuntimeError("c died")

    monkeypatch.setattr(groups, "_build", c_dies_connecting)
    try:
        a = Member(cfg, "a").start()
        c = Member(cfg, "c").start()
        start = time.monotonic()
        result = learner.push()
        took = time.monotonic() - start
        assert took < DEAD_AFTER_S + 2.5, f"the push took {took:.1f}s"
        assert (result.version, result.ok, result.failed) == (1, ["a"], {})
        assert learner.coordinator.metrics()["coordinator/syncs_restarted"] == 1
        assert [(outcome, version) for outcome, _, version in a.log] == [
            ("failed", 1),
            ("ok", 1),
        ]
        assert "given up while its members connected" in a.errors[0], a.errors
        assert "c was lost" in a.errors[0], a.errors
    finally:
        released.set()
        for member in (a, c):
            if member is not None:
                member.close()
        learner.close()


class _PostsThenStalls(Store):
    """The store a member's gloo constructor is given: its address goes in, then the member
    dies in its first wait for the others' (``die``), before connecting to anyone."""

    def __init__(self, inner: Store, die) -> None:
        super().__init__()
        self._inner, self._die = inner, die

    def set(self, key, value) -> None:
        self._inner.set(key, value)

    def get(self, key):
        self._die()
        raise RuntimeError("the member died")

    def wait(self, keys, timeout=None) -> None:
        self.get(keys[0])


@pytest.mark.timeout(60)
def test_a_member_lost_after_posting_its_address_does_not_hold_the_others(
    tmp_path, monkeypatch
) -> None:
    """Server c met the others and posted its gloo address, then died before connecting:
    the others' constructors then wait in gloo's pairwise connect, which asks no store and
    outlasts its timeout (25 s for 5 s on torch 2.13; a learner push held some 600 s in a
    chaos run where a server was killed there). The constructor is now waited for apart:
    the coordinator's loss of c gives the group up at once, and the round is begun again
    without c."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    build, released = groups._build, threading.Event()
    a = c = None

    def die() -> None:
        assert c is not None
        c.crash()
        released.wait(30)

    def c_posts_then_dies(store, rank, world_size, backend, timeout_s):
        if (rank, world_size) == (2, 3):  # c is rank 2 of the first round's 3
            store = _PostsThenStalls(store, die)
        return build(store, rank, world_size, backend, timeout_s)

    monkeypatch.setattr(groups, "_build", c_posts_then_dies)
    try:
        a = Member(cfg, "a").start()
        c = Member(cfg, "c").start()
        start = time.monotonic()
        result = learner.push()
        took = time.monotonic() - start
        assert took < DEAD_AFTER_S + 2.5, f"the push took {took:.1f}s"
        # Which of two members listens for the other's connect goes by their ports: the
        # learner either waited for c's connect (given up before the group formed: the
        # round begun again, a served) or got through and broadcast (given up on c: the
        # round failed). Either way at once, and a was told why.
        restarted = learner.coordinator.metrics().get("coordinator/syncs_restarted", 0)
        assert (result.version, result.ok) == (1, ["a"] if restarted else []), result
        assert "c" in result.failed or restarted == 1, result
        assert "the learner gave the sync up" in a.errors[0], a.errors
        assert "c was lost" in a.errors[0], a.errors
    finally:
        released.set()
        for member in (a, c):
            if member is not None:
                member.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_catch_up_of_a_server_lost_before_it_joins_ends_with_it(tmp_path) -> None:
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    learner.push()  # version 1, to nobody: a server that registers now holds version 0
    client = CoordinatorClient.from_config(cfg, "c", engine_world_size=1, timeout_s=5.0)
    try:
        client.register()
        client.start_watching()
        client.close()  # crashed before it joined its catch-up
        start = time.monotonic()
        (result,) = learner.serve_catchups()
        assert time.monotonic() - start < DEAD_AFTER_S + 2.5
        assert list(result.failed) == ["c"] and "silent" in result.failed["c"]
    finally:
        client.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_server_registering_with_partly_loaded_weights_is_caught_up_first(tmp_path) -> None:
    """A sync that broke off mid-load leaves the engine holding generation on weights part
    new, part old. Registering again (a learner restart) with the version it last loaded
    whole, it was trusted: no catch-up, and tasks its held engine never ran."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    learner.coordinator.set_replay(0)  # restored at version 0: a server there is trusted
    client = CoordinatorClient.from_config(cfg, "a", engine_world_size=1, timeout_s=5.0)
    start = m.SyncStart(
        sync_id=1,
        version=1,
        generation="main/1",
        rank=1,
        world_size=2,
        plan=learner.pusher.plan_for(learner.tensors),
    )
    try:
        # The server's report of the sync that broke off (to the learner before it died)
        client.sync_done(start, False, f"{m.WEIGHTS_PARTIAL} (RuntimeError: broke off)")
        assert client.weights_partial and client.policy_version == 0
        reg = client.register()
        assert reg.catchup and learner.coordinator.pending_catchups() == ["a"]
        assert client.request_tasks().reason == "catchup"
        client.sync_done(start, True)  # a sync that loaded them: whole again
        assert not client.weights_partial and client.policy_version == 1
    finally:
        client.close()
        learner.close()


@pytest.mark.timeout(90)
def test_a_member_restarted_during_a_formed_round_is_not_sent_into_its_group(tmp_path) -> None:
    """Server a received push 2's weights and crashed before reporting; its restart
    registered under the same id while b had not reported yet. The coordinator counts a
    lost from that round, yet its new registration (it has seen no sync) was told to join
    it: it waited to connect to a group formed without it (gloo tries for 30 s), missed
    push 3's meeting, and push 3 failed for b too."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    members: list[Member] = []
    try:
        a, b = Member(cfg, "a").start(), Member(cfg, "b").start()
        members += [a, b]
        assert learner.push().ok == ["a", "b"]
        a.hold, b.hold = threading.Event(), threading.Event()
        pushed = {}
        push = threading.Thread(target=lambda: pushed.setdefault("r", learner.push()))
        push.start()
        wait_until(lambda: 2 in a.received and 2 in b.received, "both received sync 2")
        a.crash()
        restarted = Member(cfg, "a").start()
        members.append(restarted)
        time.sleep(1.0)  # five heartbeats: each would have been told of sync 2
        assert restarted.starts == []
        b.hold.set()
        push.join(SYNC_TIMEOUT_S + 5)
        result = pushed["r"]
        assert (result.ok, result.failed) == (["b"], {"a": "re-registered (restarted)"})
        start = time.monotonic()
        result = learner.push()
        took = time.monotonic() - start
        assert (result.ok, result.failed) == (["b", "a"], {}), f"after {took:.1f}s"
        assert restarted.starts == [3] and restarted.log == [("ok", 3, 3)]
    finally:
        for member in members:
            member.close()
        learner.close()


@pytest.mark.timeout(60)
def test_main_members_caught_up_join_a_new_main_group(tmp_path) -> None:
    """A registration during a resume's replay raised the version past the main group's
    weights: its members got catch-ups, each a group of its own (a server holds one group
    at a time). The coordinator kept the main group as formed, and the next push reused it:
    it failed for every member (a missing peer, after sync.timeout_s)."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    coord = learner.coordinator
    coord.set_replay(3)  # a resumed learner whose replay reaches version 3
    members: list[Member] = []
    client = CoordinatorClient.from_config(cfg, "c", engine_world_size=1, timeout_s=5.0)
    try:
        members += [Member(cfg, "a").start(), Member(cfg, "b").start()]
        first = learner.push()
        assert learner.push().generation == first.generation  # the main group is kept
        client.policy_version = 7  # it outlived the learner, with weights above the replay
        client.register()
        client.leave("gone again")
        wait_until(lambda: "c" not in coord.servers(), "c left")
        assert [r.ok for r in learner.serve_catchups()] == [["a"], ["b"]]
        start = time.monotonic()
        result = learner.push()
        took = time.monotonic() - start
        assert (result.version, result.ok, result.failed) == (8, ["a", "b"], {}), took
        assert result.generation not in (first.generation, "")
    finally:
        client.close()
        for member in members:
            member.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_push_the_learners_own_error_ends_is_closed_at_once(tmp_path) -> None:
    """Tensors off the plan fail in the learner's packing, neither a member's failure nor
    a collective's: the round stayed open (every later push: "still in progress") and the
    members waited in the kept group's receive until sync.timeout_s. It is closed, its
    group let go (the member fails at once), the error raised; the next push forms anew."""
    import torch

    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    a = None
    try:
        a = Member(cfg, "a").start()
        first = learner.push()
        assert first.ok == ["a"]
        bad = dict(learner.tensors, **{"head.bias": torch.zeros(8)})  # planned: 7
        start = time.monotonic()
        with pytest.raises(ValueError, match="head.bias: shape"):
            learner.pusher.push(bad)
        assert time.monotonic() - start < SYNC_TIMEOUT_S / 2
        assert a.log[-1][:2] == ("failed", 2)
        result = learner.push()
        assert (result.ok, result.failed) == (["a"], {})
        assert result.generation != first.generation
    finally:
        if a is not None:
            a.close()
        learner.close()


@contextlib.contextmanager
def _learner_and_client(
    tmp_path: Path, **client_kw: Any
) -> Iterator[tuple[StandInLearner, CoordinatorClient]]:
    """A stand-in learner and server ``a``'s client (one engine rank), closed after."""
    cfg, _ = loopback_config(tmp_path, CONFIG)
    learner = StandInLearner(cfg, train_rows=_rows(40), val_rows=[]).start()
    client = CoordinatorClient.from_config(
        cfg, "a", engine_world_size=1, timeout_s=5.0, **client_kw
    )
    try:
        yield learner, client
    finally:
        client.close()
        learner.close()


@pytest.mark.timeout(60)
def test_a_catch_up_to_an_older_version_is_the_version_the_server_holds(tmp_path) -> None:
    """Found by a review: a server that held version 12 and was caught up to a restarted
    learner's version 10 kept saying 12 (in registrations and heartbeats), the higher of
    the two, though its engine now holds 10."""
    with _learner_and_client(tmp_path, policy_version=12) as (learner, client):
        start = m.SyncStart(
            sync_id=1,
            version=10,
            generation="catchup/1",
            rank=1,
            world_size=2,
            plan=learner.pusher.plan_for(learner.tensors),
        )
        client.sync_done(start, True)
        assert client.policy_version == 10


@pytest.mark.timeout(60)
def test_every_registration_is_told_to_the_server(tmp_path) -> None:
    """A server marks each registration where its launcher looks, a registration again
    (a restarted coordinator's) too: the launcher tells a learner hung since a server
    registered with it from one restarted since (supervise.py)."""
    with _learner_and_client(tmp_path) as (_, client):
        told: list[str] = []
        client.on_registered = lambda reply: told.append(reply.session)
        client.register()
        client.register()  # as after the coordinator forgot it
        assert len(told) == 2 and told[0] == told[1] == client.session
