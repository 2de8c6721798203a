"""Weight sync's transfer: the learner broadcasts named tensors to rollout workers over a
sync group (docs/DESIGN.md section 6; the store and the groups are
:mod:`asyncrl.sync.groups`). No vLLM import here; torch is imported lazily (the bucket
plan, which the coordinator sends over the wire, is :mod:`asyncrl.sync.plan`, without
torch).

Protocol of one sync (the coordinator drives it):

1. The sender computes a :class:`~asyncrl.sync.plan.WeightPlan` with ``plan_buckets`` from
   its tensor specs (once: :class:`asyncrl.sync.sender.WeightPusher` keeps it) and the
   coordinator announces ``(version, plan, generation, ranks)``, the plan inside the
   message as it is.
2. Every member calls :func:`asyncrl.sync.groups.form_group` with the same generation
   (rank 0: the learner); the group is reused while its membership is unchanged.
3. The sender calls :func:`send_weights`; each receiver iterates :func:`receive_weights`,
   which yields ``(name, tensor)`` pairs bucket by bucket, ready for ``load_weights``.

Tensors of one dtype are packed into flat buckets of at most ``bucket_mb`` so that a model
of thousands of small tensors moves in a few large collectives (on loopback gloo moved
0.58 GB/s with 1 MB tensors and 2.6 GB/s with 256 MB buckets). Every collective has a
timeout and raises :class:`~asyncrl.sync.groups.WeightSyncError` rather than hanging; a
broken group is dropped and the next sync forms a new generation without the members that
failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

from asyncrl.sync.groups import WeightSyncError
from asyncrl.sync.plan import Bucket, WeightPlan

log = logging.getLogger(__name__)


def _broadcast(pg, flat, timeout: timedelta, what: str):
    """Post the broadcast of ``flat`` from rank 0; its work. A collective that cannot even
    start raises here, not in :func:`_wait`: NCCL forms its communicator at the first
    call (a dead member, a GPU shared by two members), and that failure is the group's,
    to be dropped, not the process's."""
    try:
        return pg.broadcast(flat, 0, timeout)
    except RuntimeError as e:  # torch's DistBackendError and DistError are RuntimeErrors
        raise WeightSyncError(
            f"{what} could not start ({e}); a member died or cannot join: drop it and form a "
            "new group generation"
        ) from e


def on_device(tensor_device: Any, device: str) -> bool:
    """Whether a tensor on ``tensor_device`` is on ``device`` as the push means it:
    ``"cuda"`` is the current CUDA device (a tensor reports ``cuda:0``, and
    ``torch.device("cuda:0") != torch.device("cuda")``)."""
    import torch

    want = torch.device(device)
    if tensor_device.type != want.type:
        return False
    if want.index is None and want.type == "cuda":
        return tensor_device.index == torch.cuda.current_device()
    return want.index is None or tensor_device.index == want.index


#: How often a wait for a bucket asks whether to give the broadcast up, seconds (a
#: member's question is a round trip to the sync store).
ABANDON_POLL_S = 0.05
#: The longest a wait for a bucket goes without looking whether it ended, seconds (where
#: it only looks: :func:`takes_timed_waits`).
DONE_POLL_S = 0.001


class BroadcastAbandoned(WeightSyncError):
    """A broadcast given up before it ended: by the sender (a member was lost while it ran),
    or by a member the sender told so. The collective itself may run on in the backend
    until its timeout."""


def _wait(
    work,
    timeout_s: float,
    what: str,
    abandon: Callable[[], str] | None = None,
    timed_waits: bool = False,
) -> None:
    """Wait for ``work`` up to ``timeout_s``. ``abandon`` is asked while it runs: a reason
    it returns ends the wait at once with :class:`BroadcastAbandoned`. The sender's asks
    whether the coordinator lost a member still receiving (one that stopped reading holds
    the sender here until the timeout); a member's, whether the sender gave up (its next
    bucket would never come). ``timed_waits``: :func:`takes_timed_waits` of its group."""
    start = time.monotonic()
    if abandon is not None and (why := _until_done(work, timeout_s, abandon, timed_waits)):
        raise BroadcastAbandoned(
            f"{what} given up after {time.monotonic() - start:.1f}s: {why}; the group is "
            "held aside until its collective times out, and the next round forms a new "
            "generation"
        )
    try:
        work.wait(timedelta(seconds=max(0.001, timeout_s - (time.monotonic() - start))))
    except Exception as e:
        raise WeightSyncError(
            f"{what} failed after {time.monotonic() - start:.1f}s ({e}); a member died or "
            "stopped answering: drop it and form a new group generation"
        ) from e


def takes_timed_waits(pg) -> bool:
    """Whether a wait on ``pg``'s work that times out leaves its collective running:
    gloo's does (checked on torch 2.13: a later wait sees it end). NCCL's does not: it
    fails a work older than the wait's timeout, counted from the work's start, and aborts
    the communicator (read in torch's ``WorkNCCL::wait``; not run on a GPU here). Any
    group but gloo's is only looked at."""
    from torch.distributed import ProcessGroupGloo

    return isinstance(pg, ProcessGroupGloo)


def _until_done(work, timeout_s: float, abandon: Callable[[], str], timed_waits: bool) -> str:
    """Wait until ``work`` ends or ``timeout_s`` passes (""), or until ``abandon`` gives a
    reason (returned), asking it every :data:`ABANDON_POLL_S`. No callback on the work's
    future: one runs Python on gloo's thread, and a collective that failed as the process
    exited (its peer killed then) took the process down with SIGABRT in a review of real
    runs."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if _ended_within(work, min(ABANDON_POLL_S, left), timed_waits):
            return ""
        if why := abandon():
            return why
    return ""


def _ended_within(work, seconds: float, timed_waits: bool) -> bool:
    """Whether ``work`` ended (its own error included) within ``seconds``: a timed wait
    (it returns the moment the work ends), or looks at ``work.is_completed()`` (gloo's
    flag, the CUDA event of NCCL's end) every :data:`DONE_POLL_S` at most."""
    if timed_waits:
        try:
            work.wait(timedelta(seconds=seconds))
            return True
        except Exception:
            return work.is_completed()
    end, pause = time.monotonic() + seconds, 0.0001
    while not work.is_completed():
        if (left := end - time.monotonic()) <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, DONE_POLL_S)
    return True


class _SendBuffers:
    """Two flat byte buffers per device, kept from one push to the next, that buckets are
    packed into (bucket ``i`` into slot ``i % 2``: one packs while the other is in flight).

    Why: a fresh CPU tensor of more than 32 MB is a fresh ``mmap`` (glibc), so packing a
    256 MB bucket into a new tensor faulted in and then unmapped every page of it on every
    push, and with a single bucket nothing overlaps that cost. Each slot grows to the
    largest bucket packed into it and stays allocated for the life of the process (at most
    2 x ``sync.bucket_mb`` per device: a tensor larger than a bucket travels alone, as
    itself, see :func:`_pack`).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held by the one send_weights using these buffers
        self._bytes: dict[tuple[str, int], Any] = {}

    def get(self, slot: int, bucket: Bucket, device: str):
        """A ``[bucket.numel]`` tensor of the bucket's dtype in ``slot``'s buffer."""
        import torch

        key = (device, slot)
        buf = self._bytes.get(key)
        if buf is None or buf.numel() < bucket.nbytes:
            self._bytes.pop(key, None)  # free the smaller buffer before allocating
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            self._bytes[key] = buf
        return buf[: bucket.nbytes].view(getattr(torch, bucket.dtype))

    def clear(self) -> None:
        self._bytes.clear()


_SEND_BUFFERS = _SendBuffers()


def send_weights(
    pg,
    tensors: Mapping[str, Any],
    plan: WeightPlan,
    *,
    timeout_s: float = 120.0,
    device: str = "cpu",
    abandon: Callable[[], str] | None = None,
) -> dict[str, float]:
    """Broadcast ``tensors`` (name -> full tensor) from rank 0 bucket by bucket.

    Packing bucket ``i + 1`` overlaps the broadcast of bucket ``i`` (two buckets in memory
    at most), so the copy into flat buffers costs little beyond the raw broadcast. The flat
    buffers are reused from push to push (:class:`_SendBuffers`); a second send running
    at the same time in this process packs into buffers of its own.
    Returns ``{"bytes", "seconds", "buckets"}``. Raises :class:`WeightSyncError` when a
    collective fails or times out, or when ``abandon`` gives a reason while one runs (the
    coordinator lost a member that was still receiving: :func:`_wait`). A collective given
    up that way may still run in the backend until its timeout: drop the group with
    :func:`~asyncrl.sync.groups.release_group` and its ``busy_s``.
    """
    start, sent = time.monotonic(), 0
    timeout = timedelta(seconds=timeout_s)
    shared = _SEND_BUFFERS.lock.acquire(blocking=False)
    buffers = _SEND_BUFFERS if shared else _SendBuffers()
    in_flight = None  # (work, bucket index, flat buffer kept alive until done)
    timed_waits = takes_timed_waits(pg)
    try:
        for i, bucket in enumerate(plan.buckets):
            flat = _pack(bucket, tensors, buffers, i % 2, device)
            if in_flight is not None:
                what = f"weight broadcast of bucket {in_flight[1]}"
                _wait(in_flight[0], timeout_s, what, abandon, timed_waits)
            in_flight = (_broadcast(pg, flat, timeout, f"weight broadcast of bucket {i}"), i, flat)
            sent += bucket.nbytes
        if in_flight is not None:
            what = f"weight broadcast of bucket {in_flight[1]}"
            _wait(in_flight[0], timeout_s, what, abandon, timed_waits)
    except BaseException:
        buffers.clear()  # a failed broadcast may still be reading its buffer: never reuse it
        raise
    finally:
        if shared:
            _SEND_BUFFERS.lock.release()
    seconds = time.monotonic() - start
    return {"bytes": float(sent), "seconds": seconds, "buckets": float(len(plan.buckets))}


def _pack(
    bucket: Bucket, tensors: Mapping[str, Any], buffers: _SendBuffers, slot: int, device: str
):
    """One flat tensor ``[bucket.numel]`` holding the bucket's tensors in plan order.

    A bucket of one contiguous tensor already of its dtype and device is that tensor (a
    broadcast only reads the root's buffer), so a tensor larger than a bucket is neither
    copied nor kept in a send buffer; any other bucket is packed into ``buffers``' slot.
    """
    import torch

    for e in bucket.entries:
        shape = tuple(tensors[e.name].shape)
        if shape != e.shape:
            raise ValueError(f"{e.name}: shape {shape} != planned {e.shape}")
    dtype = getattr(torch, bucket.dtype)
    if len(bucket.entries) == 1:
        src = tensors[bucket.entries[0].name]
        if src.dtype == dtype and on_device(src.device, device) and src.is_contiguous():
            return src.detach().reshape(-1)
    flat = buffers.get(slot, bucket, device)
    flat_bytes = flat.view(torch.uint8).numpy() if flat.device.type == "cpu" else None
    for e in bucket.entries:
        src = tensors[e.name].detach().reshape(-1)
        if flat_bytes is not None and src.device.type == "cpu" and src.dtype == dtype:
            # One memcpy on this thread. ATen's copy_ splits every copy over its OpenMP
            # threads, which on a busy machine (the learner's other threads, gloo's, the
            # receivers on the same host) wait for each other: on 2 shared cores packing
            # one 96 MB bucket that way took ~3x the whole raw broadcast.
            start = e.offset * flat.element_size()
            flat_bytes[start : start + src.numel() * flat.element_size()] = src.view(
                torch.uint8
            ).numpy()
        else:
            flat[e.offset : e.offset + e.numel].copy_(src)
    return flat


def receive_weights(
    pg,
    plan: WeightPlan,
    *,
    timeout_s: float = 120.0,
    device: str = "cpu",
    on_bucket: Callable[[int], None] | None = None,
    abandon: Callable[[], str] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Receive the broadcast of :func:`send_weights`; yield ``(name, tensor)`` per tensor.

    Tensors are views into their bucket (no copy). The receive of bucket ``i + 1`` is
    posted before bucket ``i``'s tensors are handed out, so the caller's loading overlaps
    the transfer; memory holds two buckets at most plus what the caller keeps.
    ``on_bucket`` is told the number of buckets received as each arrives: a push of many
    buckets that still moves is told from a stuck one by it. ``abandon``
    (:func:`~asyncrl.sync.groups.given_up`): a reason it gives ends a wait at once with
    :class:`BroadcastAbandoned` (the learner gave the send up: the next bucket never comes;
    the receive stays posted until the group goes, so drop it with ``release_group``'s
    ``busy_s``).
    """
    import torch

    timeout = timedelta(seconds=timeout_s)
    buckets = plan.buckets

    def post(i: int):
        flat = torch.empty(buckets[i].numel, dtype=getattr(torch, buckets[i].dtype), device=device)
        return _broadcast(pg, flat, timeout, f"weight receive of bucket {i}"), flat

    if not buckets:
        return
    timed_waits = takes_timed_waits(pg)
    pending = post(0)
    for i, bucket in enumerate(buckets):
        work, flat = pending
        _wait(work, timeout_s, f"weight receive of bucket {i}", abandon, timed_waits)
        if on_bucket is not None:
            on_bucket(i + 1)
        if i + 1 < len(buckets):
            pending = post(i + 1)
        for e in bucket.entries:
            yield e.name, flat[e.offset : e.offset + e.numel].view(e.shape)
