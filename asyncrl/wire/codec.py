"""Encoding and validating decoding of the messages in :mod:`asyncrl.wire.types` and
:mod:`asyncrl.wire.requests`.

A decoder either returns well-formed objects or raises :class:`WireError` whose ``kind``
says what was wrong (one of :data:`asyncrl.wire.base.REJECT_KINDS`), so a service can count rejects by kind
and keep running. Array frames are checked for length (dtype width times the lengths the
header declares) and logprobs for infinities (NaN is allowed: a logprob the engine did not
report); decoded arrays are read-only views of the frames, never copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
import numpy as np

from asyncrl.wire.base import SCHEMA_VERSION, Frame, WireError, decode, encode, nbytes, single
from asyncrl.wire.requests import BatchHeader, Reply, Request
from asyncrl.wire.types import (
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    Batch,
    Group,
    Packed,
    ShortStr,
    TrajectoriesHeader,
    Trajectory,
    TrajectoryMeta,
    usable_reward,
)

_traj_decoder = msgspec.msgpack.Decoder(TrajectoriesHeader)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


@dataclass(frozen=True)
class Limits:
    """Bounds a receiver enforces (``oversize`` beyond them); None means unbounded."""

    max_message_bytes: int = 512 << 20
    max_items: int = 4096  # trajectories per message
    max_prompt_len: int | None = None  # e.g. data.max_prompt_length
    max_response_len: int | None = None  # e.g. data.max_response_length
    max_request_bytes: int = 1 << 20


DEFAULT_LIMITS = Limits()


# ----------------------------------------------------------------------- trajectories
def encode_trajectories(trajectories: Sequence[Trajectory], *, check: bool = True) -> list[Frame]:
    """Frames of one trajectory message (see :mod:`asyncrl.wire` for the layout).

    With ``check`` the message is validated like a receiver would (raises
    :class:`WireError`), so a producer learns of a bug before the buffer rejects it.
    """
    if not trajectories:
        raise WireError("invalid", "a trajectory message needs at least one trajectory")
    return encode_packed(Packed.pack(trajectories), check=check)


def encode_packed(packed: Packed, *, check: bool = True) -> list[Frame]:
    """Frames of a trajectory message whose arrays are already concatenated (zero-copy)."""
    header = TrajectoriesHeader(schema=SCHEMA_VERSION, trajectories=packed.metas)
    frames = [encode(header), packed.prompt_ids, packed.response_ids, packed.logprobs]
    if check:
        decode_packed(frames)
    return frames


def decode_packed(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> Packed:
    """Validate one trajectory message; its arrays are views of the frames."""
    if not frames:
        raise WireError("malformed", "empty message")
    sizes = [nbytes(f) for f in frames]
    if sum(sizes) > limits.max_message_bytes:
        raise WireError(
            "oversize", f"{sum(sizes)} bytes > {limits.max_message_bytes}", "buffer.max_message_mb"
        )
    header = decode(_traj_decoder, frames[0])
    metas = header.trajectories
    if not metas:
        raise WireError("invalid", "no trajectories in the message")
    if len(metas) > limits.max_items:
        raise WireError("oversize", f"{len(metas)} trajectories > {limits.max_items}")
    return _packed(metas, frames, sizes, limits)


class NamedTask(msgspec.Struct, frozen=True):
    """What a trajectory's meta says of its task and sender, read from a message that was
    refused (:func:`named_tasks`); other fields are not read."""

    task_id: ShortStr
    server_id: ShortStr = ""
    validation: bool = False


class _NamedHeader(msgspec.Struct):
    # At most the default Limits.max_items: a header of millions of tiny metas must not
    # cost more memory to name than to refuse.
    trajectories: Annotated[list[NamedTask], msgspec.Meta(max_length=DEFAULT_LIMITS.max_items)]


_named_decoder = msgspec.msgpack.Decoder(_NamedHeader)


def named_tasks(header: Frame) -> list[NamedTask]:
    """The tasks (first trajectory of each, in order) a trajectory message's ``header``
    frame names, read leniently (other fields, and their errors, ignored) so that a
    receiver that refused the message can say whose it was and report its groups; [] when
    even that cannot be read."""
    try:
        metas = _named_decoder.decode(header).trajectories
    except Exception:  # anything unreadable names nobody
        return []
    seen: dict[str, NamedTask] = {}
    for m in metas:
        seen.setdefault(m.task_id, m)
    return list(seen.values())


def decode_trajectories(
    frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS
) -> list[Trajectory]:
    """Validate one trajectory message and return its trajectories (arrays are views)."""
    return decode_packed(frames, limits).trajectories


# ----------------------------------------------------------------------- requests, replies
def encode_request(msg: Request) -> bytes:
    """One frame: the msgpack map of the request (its ``kind`` tag included)."""
    return encode(msg)


def decode_request(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> Request:
    """Validate a request (exactly one frame) of any kind in :data:`Request`."""
    return decode(_request_decoder, single(frames), limits.max_request_bytes)


def encode_reply(msg: Reply) -> list[Frame]:
    """Frames of a reply other than a batch (see :func:`encode_batch`)."""
    return [encode(msg)]


def encode_batch(batch: Batch) -> list[Frame]:
    """Frames of a batch reply: a :class:`BatchHeader`, then the 3 arrays of all its groups
    concatenated (one copy; zmq's cost is per frame, so fewer frames win)."""
    groups = batch.groups
    header = BatchHeader(
        schema=SCHEMA_VERSION,
        batch_id=batch.batch_id,
        policy_version=batch.policy_version,
        redelivered=batch.redelivered,
        group_sizes=[len(g.metas) for g in groups],
        trajectories=[m for g in groups for m in g.metas],
        lag_histogram=batch.lag_histogram,
        metrics=batch.metrics,
        session=batch.session,
    )
    return [
        encode(header),
        _joined([g.prompt_ids for g in groups]),
        _joined([g.response_ids for g in groups]),
        _joined([g.logprobs for g in groups]),
    ]


def _joined(arrays: list[np.ndarray]) -> bytes:
    """The arrays' bytes back to back: bytes.join has less per-array overhead than
    np.concatenate."""
    return b"".join([a.data for a in arrays])


def decode_reply(frames: Sequence[Frame], limits: Limits = DEFAULT_LIMITS) -> Reply | Batch:
    """A reply of any kind; a batch reply comes back as a :class:`Batch` with its arrays."""
    if not frames:
        raise WireError("malformed", "empty reply")
    msg = decode(_reply_decoder, frames[0])
    if not isinstance(msg, BatchHeader):
        if len(frames) != 1:
            raise WireError("malformed", f"a {type(msg).__name__} reply is one frame")
        return msg
    if sum(msg.group_sizes) != len(msg.trajectories):
        raise WireError("length", "group_sizes do not add up to the trajectories")
    packed = _packed(msg.trajectories, frames, [nbytes(f) for f in frames], limits)
    groups, i, p, r = [], 0, 0, 0
    for size in msg.group_sizes:
        metas = msg.trajectories[i : i + size]
        p2 = p + sum(m.prompt_len for m in metas)
        r2 = r + sum(m.response_len for m in metas)
        groups.append(
            Group(
                task_id=metas[0].task_id,
                metas=metas,
                prompt_ids=packed.prompt_ids[p:p2],
                response_ids=packed.response_ids[r:r2],
                logprobs=packed.logprobs[r:r2],
            )
        )
        i, p, r = i + size, p2, r2
    return Batch(
        batch_id=msg.batch_id,
        policy_version=msg.policy_version,
        groups=groups,
        lag_histogram=msg.lag_histogram,
        metrics=msg.metrics,
        redelivered=msg.redelivered,
        session=msg.session,
    )


# ----------------------------------------------------------------------- helpers
def _packed(
    metas: list[TrajectoryMeta], frames: Sequence[Frame], sizes: list[int], limits: Limits
) -> Packed:
    """Check the metas against the 3 array frames that follow the header."""
    if len(frames) != 4:
        raise WireError("malformed", f"a message is a header and 3 array frames, got {len(frames)}")
    n_prompt = n_response = 0
    for m in metas:
        _check_meta(m, limits)
        n_prompt += m.prompt_len
        n_response += m.response_len
    logprobs = _array(frames[3], sizes[3], LOGPROB_DTYPE, n_response, "logprobs")
    _check_logprobs(metas, logprobs)
    _check_masked_logprobs(metas, logprobs)
    return Packed(
        metas=metas,
        prompt_ids=_array(frames[1], sizes[1], TOKEN_DTYPE, n_prompt, "prompt ids"),
        response_ids=_array(frames[2], sizes[2], TOKEN_DTYPE, n_response, "response ids"),
        logprobs=logprobs,
    )


def _check_meta(m: TrajectoryMeta, limits: Limits) -> None:
    if m.group_index >= m.group_size:
        raise WireError(
            "invalid", f"task {m.task_id}: group_index {m.group_index} >= size {m.group_size}"
        )
    spans = m.version_spans
    if len(spans) == 1:
        covered = spans[0][1]
    else:
        covered = sum(n for _, n in spans)
        if any(a[0] > b[0] for a, b in zip(spans, spans[1:], strict=False)):
            raise WireError("invalid", f"task {m.task_id}: version spans go backwards")
    if covered != m.response_len:
        raise WireError(
            "length", f"task {m.task_id}: version spans do not cover {m.response_len} tokens"
        )
    end = 0
    for start, n in m.masked_spans:
        if start < end or start + n > m.response_len:
            raise WireError(
                "invalid", f"task {m.task_id}: masked spans overlap, go back or pass the response"
            )
        end = start + n
    if m.episode is not None and m.episode >= m.group_size:
        raise WireError("invalid", f"task {m.task_id}: episode {m.episode} >= {m.group_size}")
    if not usable_reward(m.reward) or (
        m.reward_parts and not all(usable_reward(x) for x in m.reward_parts.values())
    ):
        raise WireError(
            "nonfinite",
            f"task {m.task_id}: NaN or inf reward (in float32, as the learner holds it)",
        )
    if m.temperature is not None and not math.isfinite(m.temperature):
        raise WireError("nonfinite", f"task {m.task_id}: infinite sampling temperature")
    if limits.max_prompt_len is not None and m.prompt_len > limits.max_prompt_len:
        raise WireError(
            "oversize",
            f"task {m.task_id}: prompt of {m.prompt_len} tokens > {limits.max_prompt_len}",
            "data.max_prompt_length",
        )
    if limits.max_response_len is not None and m.response_len > limits.max_response_len:
        raise WireError(
            "oversize",
            f"task {m.task_id}: response of {m.response_len} tokens > {limits.max_response_len}",
            "data.max_response_length",
        )


def _array(frame: Frame, size: int, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if size != count * dtype.itemsize:
        raise WireError(
            "length", f"{what} frame has {size} bytes, the header says {count} x {dtype.itemsize}"
        )
    return np.frombuffer(frame, dtype=dtype)


def _check_masked_logprobs(metas: list[TrajectoryMeta], logprobs: np.ndarray) -> None:
    """Tokens the policy did not sample carry behaviour logprob 0 (a producer that put a
    real one there would be training on tool output)."""
    r = 0
    for m in metas:
        for start, n in m.masked_spans:
            if np.any(logprobs[r + start : r + start + n]):
                raise WireError(
                    "invalid", f"task {m.task_id}: a masked token has a behaviour logprob"
                )
        r += m.response_len


def _check_logprobs(metas: list[TrajectoryMeta], logprobs: np.ndarray) -> None:
    """Refuse infinite or absurdly large behaviour logprobs; NaN is allowed: it marks a
    token whose logprob the engine did not report, which the learner drops and counts
    (one token lost rather than the whole group)."""
    # A dot product is NaN or inf when any term is, at a third of isfinite().all()'s cost;
    # it also refuses absurd magnitudes (above ~1e19, whose squares overflow float32).
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(logprobs.dot(logprobs)):
            return
        reported = logprobs[~np.isnan(logprobs)]  # the rare path: some NaN, or worse
        if math.isfinite(reported.dot(reported)):
            return
    bad = np.flatnonzero(np.isinf(logprobs))
    if not len(bad):
        raise WireError("nonfinite", "behaviour logprobs too large in magnitude")
    r = 0
    for m in metas:
        if r <= bad[0] < r + m.response_len:
            raise WireError(
                "nonfinite", f"task {m.task_id}: infinite behaviour logprob at token {bad[0] - r}"
            )
        r += m.response_len
    raise WireError("nonfinite", "infinite behaviour logprobs")  # pragma: no cover
