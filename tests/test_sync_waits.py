"""The waits of a weight sync against its backends' rules: a process that exits while a
thread waits in gloo's connect, and a backend whose timed wait ends the collective.

Gloo's constructor waits through a Python store (:mod:`asyncrl.sync.asking_store`), so a
daemon thread still there when the interpreter finalizes took the GIL back in it and
crashed the process (SIGSEGV); the exit now lets those threads out first.


NCCL's ``work.wait(timeout)`` blocks until the work ends and, once the work is older than
``timeout``, fails it and aborts the communicator (torch's ``WorkNCCL::wait``). A wait
that asks, between short timed waits, whether to give the broadcast up would fail every
NCCL bucket slower than one slice, and every receive posted before the learner sent. No
GPU here: the twin below is a real gloo group on 127.0.0.1 whose works take a timed wait
as NCCL does, so the waits of :mod:`asyncrl.sync.weights` run against that rule (they wait
in timed slices only on a gloo group itself, whose timed wait leaves the collective be).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from asyncrl.sync import groups
from asyncrl.sync.groups import WeightSyncError, form_group, open_store
from asyncrl.sync.plan import plan_buckets, specs_of
from asyncrl.sync.weights import receive_weights, send_weights
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent

TIMEOUT_S = 20.0


class _TimedWaitEndsIt:
    """A gloo work whose timed wait behaves as NCCL's: it blocks until the work ends, and
    if the work is older than the timeout first, the work fails for good (NCCL aborts
    the communicator): it counts as completed, and every wait raises."""

    def __init__(self, work) -> None:
        self._work = work
        self._born = time.monotonic()
        self.failed = ""

    def is_completed(self) -> bool:
        return bool(self.failed) or self._work.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            while not self.is_completed():
                age = time.monotonic() - self._born
                if age >= timeout.total_seconds():
                    self.failed = f"timed out after {age:.2f}s (a timed wait of {timeout})"
                    break
                time.sleep(0.001)
        if self.failed:
            raise RuntimeError(self.failed)
        return self._work.wait()


class _Twin:
    """A gloo group whose broadcasts return :class:`_TimedWaitEndsIt` works."""

    def __init__(self, pg) -> None:
        self._pg = pg
        self.works: list[_TimedWaitEndsIt] = []

    def broadcast(self, tensors, root: int, timeout: timedelta):
        work = _TimedWaitEndsIt(self._pg.broadcast(tensors, root, timeout))
        self.works.append(work)
        return work


def _groups(n: int) -> list:
    """``n`` members of one gloo group, formed on threads of this process."""
    port = free_port()
    stores = [open_store("127.0.0.1", port, is_host=r == 0, timeout_s=10) for r in range(n)]
    groups: list = [None] * n

    def join(rank: int) -> None:
        groups[rank] = form_group(stores[rank], "twin", rank, n, timeout_s=10)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert all(g is not None for g in groups)
    return groups


@pytest.mark.timeout(60)
def test_waits_that_ask_to_give_up_never_time_a_running_work() -> None:
    """The receive is posted 0.3 s before the learner sends (as a server's is: it is told
    of the push first), and the sender's buckets take a while each; both sides ask
    ``abandon`` all along. Nothing may fail: a wait that ends a running work's collective
    has no place in a wait that only asks."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}": torch.randn(256, 1024, generator=g) for i in range(6)}
    plan = plan_buckets(specs_of(tensors), 1024 * 1024)  # one bucket per tensor
    sender_pg, receiver_pg = (_Twin(pg) for pg in _groups(2))
    asked = {"sender": 0, "receiver": 0}

    def ask(side: str):
        def abandon() -> str:
            asked[side] += 1
            return ""

        return abandon

    received: dict[str, torch.Tensor] = {}
    errors: list[str] = []

    def receive() -> None:
        try:
            for name, t in receive_weights(
                receiver_pg, plan, timeout_s=TIMEOUT_S, abandon=ask("receiver")
            ):
                received[name] = t.clone()
        except WeightSyncError as e:
            errors.append(str(e))

    receiver = threading.Thread(target=receive)
    receiver.start()
    time.sleep(0.3)
    send_weights(sender_pg, tensors, plan, timeout_s=TIMEOUT_S, abandon=ask("sender"))
    receiver.join(TIMEOUT_S)
    assert errors == []
    assert [w.failed for w in sender_pg.works + receiver_pg.works if w.failed] == []
    assert set(received) == set(tensors)
    assert all(torch.equal(received[k], tensors[k]) for k in tensors)
    assert asked["receiver"] >= 3  # the 0.3 s before the send were spent asking


# Ranks 0 and 1 of 3 connect on daemon threads; rank 2 met them and never connects (its
# address never comes); the main thread exits while they wait.
_EXIT_WHILE_CONNECTING = """
import threading, time
from asyncrl.sync.groups import WeightSyncError, form_group, open_store
from torch.distributed import PrefixStore
from tests.helpers import free_port

port = free_port()
host = open_store("127.0.0.1", port, is_host=True, timeout_s=30)
member = open_store("127.0.0.1", port, is_host=False, timeout_s=30)
PrefixStore("wsync/g", host).set("joined/2", b"1")

def join(rank, store):
    try:
        form_group(store, "g", rank, 3, timeout_s=30, abandon=(lambda: "") if rank == 0 else None)
    except WeightSyncError as e:
        print(e, flush=True)

for rank, store in ((0, host), (1, member)):
    threading.Thread(target=join, args=(rank, store), daemon=True).start()
time.sleep(1.5)
print("main exits", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_process_exits_cleanly_while_threads_wait_in_gloos_connect() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_WHILE_CONNECTING],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "main exits" in proc.stdout
    assert proc.stdout.count("given up while its members connected") == 2, proc.stdout
    assert proc.stdout.count("the process is exiting") == 2, proc.stdout


class _Group:
    """What a constructor returns here; ``aborted`` once it is let go."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("why", ["abandoned", "timeout", "in_time", "error"])
def test_a_constructor_that_asks_nothing_is_given_up_on_time(why: str) -> None:
    """Gloo's pairwise connect, after its store waits, asks nothing and outlasts the timeout
    it is given (25 s for 5 s on torch 2.13, a member that posted its address and died: a
    learner push held some 600 s in a chaos run). The constructor runs apart, and the
    waiting thread gives it up when ``stop`` says so or at the group's timeout; a group it
    makes after that is let go, one made in time is returned, an error is raised."""
    release, group, asked = threading.Event(), _Group(), []
    timeout_s = 1.0 if why == "timeout" else 30.0

    def build():
        release.wait(30 if why in ("abandoned", "timeout") else 0.3)
        if why == "error":
            raise RuntimeError("Connect timeout")
        return group

    def stop() -> str:
        asked.append(time.monotonic())
        return "lost" if why == "abandoned" and len(asked) > 3 else ""

    start = time.monotonic()
    try:
        if why == "in_time":  # made within its timeout: returned, not let go
            assert groups._build_watched(build, stop, timeout_s) is group
            assert not group.aborted.is_set()
            return
        if why == "error":
            with pytest.raises(RuntimeError, match="Connect timeout"):
                groups._build_watched(build, stop, timeout_s)
            return
        with pytest.raises(groups.ConnectGivenUp) as e:
            groups._build_watched(build, stop, timeout_s)
        took = time.monotonic() - start
        assert took < (timeout_s + 1.0 if why == "timeout" else 2.0), took
        assert ("lost" if why == "abandoned" else "not connected within 1s") in str(e.value)
        release.set()  # the constructor ends after all: its group is let go on its thread
        assert group.aborted.wait(5)
    finally:
        release.set()


@pytest.mark.timeout(60)
def test_the_learner_out_of_time_in_gloos_connect_tells_the_members() -> None:
    """Found by a review: the learner that gave its connect up at the group's timeout told
    nobody (only a lost member's give-up was written): a member whose own connect
    completed then waited in its receive for another ``sync.timeout_s``."""
    from torch.distributed import HashStore, PrefixStore  # pyright: ignore[reportPrivateImportUsage]

    store, release = HashStore(), threading.Event()
    PrefixStore("wsync/g", store).set("joined/1", b"1")
    build = groups._build
    try:
        groups._build = lambda *args: release.wait(30)
        with pytest.raises(WeightSyncError, match="not connected within 1s"):
            form_group(store, "g", 0, 2, timeout_s=1.0, abandon=lambda: "")
    finally:
        groups._build = build
        release.set()
    assert "not connected within 1s" in groups.given_up(store, "g")()
