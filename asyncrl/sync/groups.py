"""Weight-sync groups: the rendezvous store learner rank 0 hosts, and the process groups
formed in it, one :func:`form_group` per *group generation* (docs/DESIGN.md section 6).

A group is torch's own process-group class (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU) over a ``PrefixStore`` of the run's ``TCPStore``, beside
vLLM's and FSDP's own groups (not torch.distributed's default group). Its members meet
first, bounded by ``timeout_s``, so a member that never comes fails the others at once
instead of holding them in the first collective, and gloo's connect that follows asks,
as it waits, whether the group was given up; a group that failed is let go with
:func:`release_group`. What moves through a group is :mod:`asyncrl.sync.weights`. No vLLM
import here; torch is imported lazily.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A sync collective failed or timed out; the group that raised it is unusable."""


def open_store(host: str, port: int, *, is_host: bool, timeout_s: float):
    """The run's rendezvous store: hosted by learner rank 0, joined by every receiver.

    Joining waits up to ``timeout_s`` for the host; the host does not wait for anyone.
    The host listens at ``host`` only, as every other port of the run does: torch's own
    store server listens on every interface, and the store lists the keys that guard the
    sync groups.
    """
    # torch documents these store classes but re-exports them without marking them public
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

    try:
        fd = _listening_fd(host, port) if is_host else None
        return TCPStore(
            host,
            port,
            None,
            is_host,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except Exception as e:  # OSError, or torch's RuntimeError/DistStoreError subclasses
        role = "host" if is_host else "reach"
        raise WeightSyncError(
            f"cannot {role} the sync store at {host}:{port} within {timeout_s:.0f}s ({e}); "
            "check endpoints.host/endpoints.sync_store and that the learner is up"
        ) from e


def _listening_fd(host: str, port: int) -> int:
    """A socket listening at ``host:port`` alone, handed over to the store (which closes it
    with itself)."""
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted learner's
        sock.bind(address)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def store_prefix(secret: str, generation: str) -> str:
    """The key space of sync group ``generation``: behind the coordinator's session secret,
    which only registered servers learn, so a client of the store that does not know it
    cannot find a group by its generation's name or join one."""
    return f"{secret}/{generation}" if secret else generation


def form_group(
    store,
    generation: str | int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    abandon: Callable[[], str] | None = None,
):
    """Join group ``generation`` as ``rank`` of ``world_size``; blocks until all have joined.

    Every generation gets its own key space (a ``PrefixStore``), so a re-formed group never
    sees the keys of a broken one. ``backend`` is ``gloo`` (CPU tensors) or ``nccl``.
    ``abandon`` (the learner's): asked while members are missing, then while gloo connects
    them; a reason it returns gives the group up for every member (see
    :func:`_wait_for_members` and :func:`_connect`).
    """
    from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage]

    prefixed = PrefixStore(f"wsync/{generation}", store)
    start = time.monotonic()
    _wait_for_members(prefixed, generation, rank, world_size, timeout_s, abandon)
    pg = _connect(prefixed, generation, rank, world_size, backend, timeout_s, abandon)
    log.debug(
        "sync group %s formed (rank %d of %d) in %.2fs",
        generation,
        rank,
        world_size,
        time.monotonic() - start,
    )
    return pg


def _build(store, rank: int, world_size: int, backend: str, timeout_s: float):
    """Torch's process group of ``backend`` over ``store``: gloo's waits here for every
    member's address in the store, NCCL's connects at its first collective."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend must be gloo or nccl, got {backend!r}")


def _connect(
    prefixed,
    generation: str | int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    abandon: Callable[[], str] | None,
):
    """Build the group once its members met. Gloo's constructor waits in the store for
    every member's address (up to ``timeout_s``): a member that died after the meeting
    held every other one there that long. Its waits ask meanwhile whether the round was
    given up (:class:`~asyncrl.sync.asking_store.AskingStore`): ``abandon`` (the
    learner's, which then tells the members by the store's :data:`_GIVEN_UP` key) or that
    key (a member's). Its pairwise connect that follows asks nothing: the constructor
    runs on a thread of its own, and this one gives it up (:func:`_build_watched`). NCCL's
    constructor does not connect (its first collective does, after the meeting), so it
    gets the store as it is."""

    def stop() -> str:
        why = _sent_up(prefixed)
        if not why and abandon is not None and (reason := abandon()):
            why = f"rank {rank} abandoned it: {reason}"
            _tell_given_up(prefixed, generation, why)
        return why

    store = None
    try:
        if backend != "gloo":
            return _build(prefixed, rank, world_size, backend, timeout_s)
        from asyncrl.sync.asking_store import AskingStore

        store = AskingStore(prefixed, stop, timeout_s)
        return _build_watched(
            lambda: _build(store, rank, world_size, backend, timeout_s), stop, timeout_s
        )
    except ValueError:
        raise
    except ConnectGivenUp as e:
        if abandon is not None:  # the learner: members already connected stop waiting too
            _tell_given_up(prefixed, generation, str(e))
        raise WeightSyncError(
            f"sync group {generation} given up while its members connected "
            f"(rank {rank}/{world_size}): {e}"
        ) from e
    except Exception as e:
        if store is not None and (why := store.why):
            raise WeightSyncError(
                f"sync group {generation} given up while its members connected "
                f"(rank {rank}/{world_size}): {why}"
            ) from e
        raise WeightSyncError(
            f"sync group {generation}: rank {rank}/{world_size} could not connect to its "
            f"peers within {timeout_s:.0f}s ({e}); a member is missing or unreachable"
        ) from e


class ConnectGivenUp(RuntimeError):
    """Gloo's constructor was left to itself: given up (the message says why) or past the
    group's timeout."""


#: How often the thread waiting for gloo's constructor asks whether to give it up, seconds.
CONNECT_POLL_S = 0.1


def _build_watched(build: Callable[[], Any], stop: Callable[[], str], timeout_s: float) -> Any:
    """``build()`` (gloo's constructor) on a thread of its own, waited for here at most
    ``timeout_s``, asking ``stop`` every :data:`CONNECT_POLL_S`. After the store waits
    (which ask ``stop`` themselves) gloo connects the members pairwise and asks nothing;
    that wait outlasts the timeout it is given (checked on torch 2.13: 25 s for a timeout
    of 5 s, a member that posted its address but never connected), so a server killed
    there held a learner's push some 600 s under ``sync.timeout_s=120``. Given up, the
    constructor is left to end on its thread: a group it still makes is let go there."""
    from asyncrl.sync.asking_store import inside_constructor

    lock, box = threading.Lock(), {}
    done = threading.Event()

    def run() -> None:
        try:
            with inside_constructor():
                result = build()
        except BaseException as e:  # handed to the waiting thread
            result, box["error"] = None, e
        with lock:
            if box.get("left"):  # given up meanwhile: nobody takes the group
                release_group(result)
                return
            box["pg"] = result
            done.set()

    threading.Thread(target=run, name="sync-group-connect", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(CONNECT_POLL_S):
        why = stop()
        if not why and time.monotonic() >= deadline:
            why = f"not connected within {timeout_s:.0f}s (gloo's own wait runs longer)"
        if why:
            with lock:
                if not done.is_set():
                    box["left"] = True
                    raise ConnectGivenUp(why)
            break  # it ended as the give-up was decided: its result stands
    if "error" in box:
        raise box["error"]
    return box["pg"]


#: The longest a member waiting for the others goes without looking at the store, seconds
#: (the first looks come sooner: members of a push usually meet within milliseconds).
MEET_POLL_S = 0.1
#: The key that settles a meeting: :data:`_FORMED`, or why it was given up.
_VERDICT = "verdict"
_FORMED = "formed"


def _wait_for_members(
    store,
    generation: str | int,
    rank: int,
    world_size: int,
    timeout_s: float,
    abandon: Callable[[], str] | None = None,
) -> None:
    """Every member says it joined, then waits (bounded) until all have. NCCL connects a
    group at its first collective, a wait that ignores the group's timeout: a member that
    died before joining would hold everyone there for good. Here that is a
    :class:`WeightSyncError` naming the ranks missing.

    One verdict settles the meeting, first come (the store's compare-and-set): ``formed``,
    set by a member that saw every member joined, or why a member gave up (its timeout, or
    ``abandon``: the learner's coordinator lost a member). A member arriving after a give-up
    fails at once on it instead of passing the meeting and waiting for the one that gave
    up in the first collective; one that gives up after the group formed joins it after
    all. The joined flags stay, so every error names only the ranks that never joined.
    The store is looked at in slices (at most :data:`MEET_POLL_S`): a give-up reaches the
    others within one (a timed-out ``store.wait`` also logs a warning each time)."""
    try:
        store.set(f"joined/{rank}", b"1")
        keys = [f"joined/{r}" for r in range(world_size)]
        deadline = time.monotonic() + timeout_s
        pause = 0.002
        while True:
            why = ""
            if not store.check(keys):
                if store.check([_VERDICT]) and store.get(_VERDICT).decode() != _FORMED:
                    why = "given up"  # by another member: its reason is the verdict
                elif abandon is not None and (reason := abandon()):
                    why = f"rank {rank} abandoned it: {reason}"
                elif time.monotonic() >= deadline:
                    missing = [r for r in range(world_size) if not store.check([keys[r]])]
                    why = f"rank {rank} gave up after {timeout_s:.0f}s: "
                    why += f"rank(s) {missing} never joined"
                else:
                    time.sleep(pause)
                    pause = min(2 * pause, MEET_POLL_S)
                    continue
            verdict = store.compare_set(_VERDICT, "", why or _FORMED).decode()
            if verdict == _FORMED:
                return
            break
    except Exception as e:  # torch's DistError (a RuntimeError): the store itself is gone
        raise WeightSyncError(
            f"sync group {generation}: rank {rank}/{world_size} lost the sync store while "
            f"its members met ({e})"
        ) from e
    if verdict.startswith(f"rank {rank} gave up"):
        raise WeightSyncError(
            f"sync group {generation}: rank {rank}/{world_size} could not connect to its "
            f"peers within {timeout_s:.0f}s: {verdict.split(': ', 1)[-1]}; a member is missing "
            "or unreachable"
        )
    raise WeightSyncError(
        f"sync group {generation} not formed (rank {rank}/{world_size}): {verdict}"
    )


#: The key by which the learner tells a group's members it gave its broadcast up.
_GIVEN_UP = "given_up"


def give_up_send(store, generation: str, why: str) -> None:
    """The learner gave up its broadcast on group ``generation`` (:func:`store_prefix`'s
    key space): its members still waiting for a bucket stop at once (:func:`given_up`)
    instead of at their timeout. Best effort: a store gone says it to no one."""
    from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage]

    try:
        prefixed = PrefixStore(f"wsync/{generation}", store)
    except Exception as e:  # no store (a sender without one): nobody to tell
        log.warning("could not tell sync group %s's members it was given up: %s", generation, e)
        return
    _tell_given_up(prefixed, generation, why)


def given_up(store, generation: str) -> Callable[[], str]:
    """A member's question for its waits in group ``generation``: why the learner gave the
    broadcast up ("" while it did not; "" too when the store cannot be asked: the wait's
    own timeout and the collective's errors still hold)."""
    from torch.distributed import PrefixStore  # pyright: ignore[reportPrivateImportUsage]

    prefixed = PrefixStore(f"wsync/{generation}", store)
    return lambda: _sent_up(prefixed)


def _tell_given_up(prefixed, generation: str | int, why: str) -> None:
    try:
        prefixed.set(_GIVEN_UP, why or "given up")
    except Exception as e:  # torch's DistError: the members then wait out their timeout
        log.warning("could not tell sync group %s's members it was given up: %s", generation, e)


def _sent_up(prefixed) -> str:
    """Why the learner gave the group in ``prefixed`` up, or ""."""
    try:
        if not prefixed.check([_GIVEN_UP]):
            return ""
        return f"the learner gave the sync up ({prefixed.get(_GIVEN_UP).decode()})"
    except Exception:
        return ""


def release_group(pg: Any, busy_s: float = 0.0) -> None:
    """Let go of a sync group that failed or is replaced: abort it. Under NCCL a
    communicator that is only dropped can stay in a collective that never completes (a
    member died mid-broadcast), holding its GPU buffers and its watchdog's attention until
    the process ends; an abort ends those operations. Callers then drop the group: under
    gloo that closes its connections, and a member still waiting on it fails at once
    (checked: about 1 s, against its ``sync.timeout_s``).

    ``busy_s``: how long a collective the caller gave up on may still run in it. Gloo's
    abort does not end one (checked on torch 2.13: a broadcast to a member that stopped
    reading ran to its timeout after ``abort()``), and dropping the group joins gloo's
    threads, so the thread that dropped it last would wait that long: a thread of its own
    holds the group that long, then drops it (closing its connections then)."""
    if pg is None:
        return
    try:
        pg.abort()
    except Exception as e:  # a group already broken can fail its abort: it is let go anyway
        log.debug("sync group abort failed (%s); dropping it", e)
    if busy_s > 0:
        threading.Thread(
            target=_hold, args=([pg], busy_s), name="sync-group-release", daemon=True
        ).start()


def _hold(box: list[Any], seconds: float) -> None:
    """Keep a released group alive ``seconds``, then drop it (on this thread)."""
    time.sleep(seconds)
    box.clear()
