"""The messages that cross process boundaries, as msgspec structs.

What rollout servers push to the buffer: :class:`TrajectoriesHeader` (a list of
:class:`TrajectoryMeta`) followed by three raw array frames (prompt ids, response ids,
logprobs of all its trajectories, each concatenated in header order). What a consumer
exchanges with the buffer on its request/reply socket is in :mod:`asyncrl.wire.requests`.

Every message that is sent on its own carries ``schema`` (:data:`asyncrl.wire.base.SCHEMA_VERSION`); the
decoder refuses any other value. Python-side objects that the codec builds from messages
(:class:`Trajectory`, :class:`Group`, :class:`Batch`) hold numpy arrays and are never
msgpack-encoded themselves. See :mod:`asyncrl.wire` for the frame layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np

#: Raw frame dtypes: little-endian whatever the host (token ids, behaviour logprobs).
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
#: The largest policy version a message may carry. Versions count weight pushes (a push a
#: second runs 68 years before it); the bound keeps any difference of two versions, a lag,
#: an integer msgpack can encode (a version near 2**64 passed the decoder and crashed the
#: buffer when it encoded that group's lag in a batch).
MAX_VERSION = 2**31 - 1
Version = Annotated[int, msgspec.Meta(ge=0, le=MAX_VERSION)]
#: The largest reward magnitude the learner can train on: it holds rewards in float32,
#: where a larger float64 is inf (and its group's advantages NaN, which skips the update
#: of every group in the mini-batch). A quarter of float32's range, so that a group's
#: differences stay finite too (RLOO's n/(n-1) * (r - mean) reaches twice a reward).
MAX_ABS_REWARD = float(np.finfo(np.float32).max) / 4


def usable_reward(x: float) -> bool:
    """Whether ``x`` is a reward the learner can train on: finite, within
    :data:`MAX_ABS_REWARD`."""
    return math.isfinite(x) and abs(x) <= MAX_ABS_REWARD


# A task id is printed in logs and written to parquet: keep it a short, non-empty string.
TaskId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
#: The longest name, label or reward-part key a message carries.
MAX_SHORT_STR = 256
ShortStr = Annotated[str, msgspec.Meta(max_length=MAX_SHORT_STR)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
#: Most masked runs one response may carry (a turn adds one: far more than any episode has).
MAX_MASKED_SPANS = 4096


class TrajectoryMeta(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Everything about one sampled response except its arrays.

    ``version_spans`` covers the response in order: ``[(policy_version, n_tokens), ...]``
    with ``sum(n_tokens) == response_len``. A response generated without a weight push has
    one span; a push in the middle of generation adds one. Its *oldest version* is the
    smallest ``policy_version``; lag (docs/DESIGN.md section 4) is the learner's version minus
    it. A zero-length response still has one span ``(version, 0)`` so its version is known.
    """

    task_id: TaskId  # unique per deal: every member of a group shares it
    group_index: NonNegInt  # 0 .. group_size - 1
    group_size: Annotated[int, msgspec.Meta(ge=1, le=65536)]
    prompt_len: NonNegInt  # tokens in the prompt frame
    response_len: NonNegInt  # tokens in the response and logprob frames
    version_spans: Annotated[list[tuple[Version, NonNegInt]], msgspec.Meta(min_length=1)]
    reward: float
    reward_parts: dict[ShortStr, float] = {}
    finish_reason: ShortStr = "stop"  # vLLM's: stop, length, abort
    validation: bool = False  # validation groups never reach a training batch
    data_source: ShortStr = ""
    server_id: ShortStr = ""  # the rollout server that generated it
    created_at: float = 0.0  # wall clock (time.time()) when the request started
    finished_at: float = 0.0  # wall clock when the response was complete
    # The temperature the engine sampled at (after its own adjustments; 0 = greedy, as in
    # validation). The learner divides this trajectory's logits by it; None (not stated, as
    # from older producers) leaves it to the learner's configured rollout.temperature.
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    # Multi-turn only: the response tokens the policy did not sample (tool output, user
    # turns, the chat template's tokens between turns) as ``(start, length)`` runs, sorted
    # and apart. They have loss mask 0 and behaviour logprob 0. Empty: all were sampled.
    masked_spans: Annotated[
        list[tuple[NonNegInt, PosInt]], msgspec.Meta(max_length=MAX_MASKED_SPANS)
    ] = []
    # Multi-turn only: the episode (0 .. n - 1) this sample is part of, when an episode
    # became several samples (a chat template rewrote the history); group statistics count
    # episodes. None: the sample is its own episode, ``group_index``.
    episode: NonNegInt | None = None
    # The scorer failed on this response (raised, timed out, returned nothing usable):
    # ``reward`` is the 0.0 it was scored instead. Validation rounds count these
    # (``val/reward_errors``), so a score pulled down by a broken scorer says so.
    reward_error: bool = False

    @property
    def episode_index(self) -> int:
        """The episode this sample belongs to (its ``group_index`` unless split)."""
        return self.group_index if self.episode is None else self.episode

    @property
    def oldest_version(self) -> int:
        """The policy version of the oldest token (lag is measured against it).

        Spans are in generation order and versions never go backwards (the codec refuses
        spans that do), so it is the first span's.
        """
        return self.version_spans[0][0]


class Trajectory(msgspec.Struct, eq=False):
    """One response with its arrays: ``meta`` plus three 1-D little-endian arrays.

    Arrays decoded from a message are read-only views of the received frames (no copy);
    copy them before writing. Build new ones with :meth:`build`.
    """

    meta: TrajectoryMeta
    prompt_ids: np.ndarray  # int32, prompt_len
    response_ids: np.ndarray  # int32, response_len
    logprobs: np.ndarray  # float32, response_len: behaviour logprobs from vLLM

    @classmethod
    def build(
        cls,
        *,
        task_id: str,
        prompt_ids: Any,
        response_ids: Any,
        logprobs: Any,
        version_spans: list[tuple[int, int]] | None = None,
        policy_version: int = 0,
        reward: float = 0.0,
        **meta: Any,
    ) -> Trajectory:
        """A trajectory from array-likes; lengths are derived, dtypes converted.

        Without ``version_spans`` the whole response is attributed to ``policy_version``.
        Other keyword arguments are :class:`TrajectoryMeta` fields.
        """
        p = np.ascontiguousarray(prompt_ids, dtype=TOKEN_DTYPE).reshape(-1)
        r = np.ascontiguousarray(response_ids, dtype=TOKEN_DTYPE).reshape(-1)
        lp = np.ascontiguousarray(logprobs, dtype=LOGPROB_DTYPE).reshape(-1)
        spans = version_spans if version_spans is not None else [(policy_version, len(r))]
        m = TrajectoryMeta(
            task_id=task_id,
            prompt_len=len(p),
            response_len=len(r),
            version_spans=[(int(v), int(n)) for v, n in spans],
            reward=float(reward),
            **meta,
        )
        return cls(meta=m, prompt_ids=p, response_ids=r, logprobs=lp)

    # Read-through accessors for what every consumer needs; the rest is on ``meta``.
    @property
    def task_id(self) -> str:
        return self.meta.task_id

    @property
    def group_index(self) -> int:
        return self.meta.group_index

    @property
    def group_size(self) -> int:
        return self.meta.group_size

    @property
    def reward(self) -> float:
        return self.meta.reward

    @property
    def validation(self) -> bool:
        return self.meta.validation

    @property
    def data_source(self) -> str:
        return self.meta.data_source

    @property
    def oldest_version(self) -> int:
        return self.meta.oldest_version

    def detached(self) -> Trajectory:
        """This trajectory with arrays of its own: decoded ones are views of the received
        message's frames, which they keep alive as long as they live."""
        return Trajectory(
            meta=self.meta,
            prompt_ids=self.prompt_ids.copy(),
            response_ids=self.response_ids.copy(),
            logprobs=self.logprobs.copy(),
        )

    def loss_mask(self) -> np.ndarray:
        """Per response token, 1 where the policy sampled it, else 0 (bool)."""
        mask = np.ones(self.meta.response_len, dtype=bool)
        for start, n in self.meta.masked_spans:
            mask[start : start + n] = False
        return mask

    def token_versions(self) -> np.ndarray:
        """Per response token, the policy version that produced it (int64)."""
        v = [v for v, _ in self.meta.version_spans]
        n = [n for _, n in self.meta.version_spans]
        return np.repeat(np.asarray(v, dtype=np.int64), n)


P = TypeVar("P", bound="Packed")


class Packed(msgspec.Struct, eq=False, dict=True, kw_only=True):
    """Trajectories with their arrays concatenated in order: what one message carries.

    ``prompt_ids`` holds every trajectory's prompt ids one after the other (lengths in
    ``metas``), likewise ``response_ids`` and ``logprobs``: the layout a learner packs
    sequences from, and one copy (or none) per message instead of one per trajectory.
    :attr:`trajectories` gives per-trajectory views, built on first use.
    """

    metas: list[TrajectoryMeta]
    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32

    @classmethod
    def pack(cls: type[P], trajectories: Sequence[Trajectory], **fields: Any) -> P:
        """Concatenate trajectories (one copy of their arrays)."""
        return cls(
            metas=[t.meta for t in trajectories],
            prompt_ids=_concat([t.prompt_ids for t in trajectories], TOKEN_DTYPE),
            response_ids=_concat([t.response_ids for t in trajectories], TOKEN_DTYPE),
            logprobs=_concat([t.logprobs for t in trajectories], LOGPROB_DTYPE),
            **fields,
        )

    def __len__(self) -> int:
        return len(self.metas)

    @functools.cached_property
    def trajectories(self) -> list[Trajectory]:
        """One :class:`Trajectory` per meta; its arrays are views of the packed ones."""
        out, p, r = [], 0, 0
        for m in self.metas:
            p2, r2 = p + m.prompt_len, r + m.response_len
            out.append(
                Trajectory(
                    meta=m,
                    prompt_ids=self.prompt_ids[p:p2],
                    response_ids=self.response_ids[r:r2],
                    logprobs=self.logprobs[r:r2],
                )
            )
            p, r = p2, r2
        return out

    @property
    def response_lens(self) -> np.ndarray:
        return np.fromiter((m.response_len for m in self.metas), np.int64, len(self.metas))

    @property
    def prompt_lens(self) -> np.ndarray:
        return np.fromiter((m.prompt_len for m in self.metas), np.int64, len(self.metas))


class Group(Packed, kw_only=True):
    """All ``group_size`` responses to one task, packed in ``group_index`` order."""

    task_id: str

    @classmethod
    def from_trajectories(cls, task_id: str, trajectories: Sequence[Trajectory]) -> Group:
        return cls.pack(trajectories, task_id=task_id)

    @property
    def validation(self) -> bool:
        return self.metas[0].validation

    @property
    def data_source(self) -> str:
        return self.metas[0].data_source

    @property
    def oldest_version(self) -> int:
        return min(m.version_spans[0][0] for m in self.metas)

    def lag(self, policy_version: int) -> int:
        """Learner version minus the oldest version among this group's tokens."""
        return policy_version - self.oldest_version


class Batch(msgspec.Struct, eq=False, kw_only=True):
    """A training batch as the consumer sees it (decoded from a :class:`BatchHeader`).

    Each group's arrays are views of the three frames of the reply.
    """

    batch_id: int  # unique within the buffer's session
    policy_version: int  # the learner version it was released against (lag reference)
    groups: list[Group]
    lag_histogram: dict[int, int]  # lag -> number of groups in this batch
    metrics: dict[str, float]
    redelivered: bool = False  # released again after a consumer restart
    session: str = ""  # the buffer session that numbered it

    @property
    def task_ids(self) -> list[str]:
        return [g.task_id for g in self.groups]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


def _concat(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    if len(arrays) == 1:
        return np.ascontiguousarray(arrays[0], dtype=dtype)
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)


# ----------------------------------------------------------------------- trajectory socket
class TrajectoriesHeader(
    msgspec.Struct, tag="trajectories", tag_field="kind", kw_only=True, forbid_unknown_fields=True
):
    """First frame of a trajectory message; 3 array frames follow (see :mod:`asyncrl.wire`)."""

    schema: int
    trajectories: list[TrajectoryMeta]
