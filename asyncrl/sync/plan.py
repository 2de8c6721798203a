"""The bucket plan of a weight sync: where every tensor travels (:class:`WeightPlan`), as
the sender computes it, the coordinator announces it inside ``SyncStart`` and every receiver
follows it (:mod:`asyncrl.sync.weights` moves the bytes). Pure, and without torch: the
coordinator's package imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

NonNeg = Annotated[int, msgspec.Meta(ge=0)]

_ITEMSIZE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "int8": 1,
    "bool": 1,
}


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype (torch's name without ``torch.``, e.g. ``"bfloat16"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class BucketEntry(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A tensor's place in its bucket: elements ``[offset, offset + numel)``. Travels as
    ``[name, shape, offset, numel]``."""

    name: str
    shape: tuple[NonNeg, ...]
    offset: NonNeg
    numel: NonNeg


class Bucket(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One flat buffer of a single dtype, broadcast in one collective."""

    dtype: str
    numel: NonNeg
    entries: tuple[BucketEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]


class WeightPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where every tensor of a sync travels: its buckets, in broadcast order.

    One type from end to end: the sender builds it (:func:`plan_buckets`), the coordinator
    sends it inside :class:`asyncrl.control.messages.SyncStart` as it is (msgspec encodes
    it), and every receiver hands it to :func:`asyncrl.sync.weights.receive_weights`.
    """

    buckets: tuple[Bucket, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> WeightPlan:
    """Pack tensors into dtype-grouped buckets of at most ``bucket_bytes`` each.

    Order is kept within a dtype (so receivers can load as they go); a tensor larger than
    ``bucket_bytes`` travels alone in its own bucket. Pure: the same specs give the same plan.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        if spec.dtype not in _ITEMSIZE:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be synced")
        by_dtype.setdefault(spec.dtype, []).append(spec)
    buckets: list[Bucket] = []
    for dtype, group in by_dtype.items():
        entries: list[BucketEntry] = []
        used = 0
        for spec in group:
            numel = 1
            for d in spec.shape:
                numel *= d
            if entries and (used + numel) * _ITEMSIZE[dtype] > bucket_bytes:
                buckets.append(Bucket(dtype, used, tuple(entries)))
                entries, used = [], 0
            entries.append(BucketEntry(spec.name, tuple(spec.shape), used, numel))
            used += numel
        if entries:
            buckets.append(Bucket(dtype, used, tuple(entries)))
    return WeightPlan(tuple(buckets))


def specs_of(tensors: Mapping[str, Any]) -> list[TensorSpec]:
    """Specs of named torch tensors, in their order."""
    return [
        TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for n, t in tensors.items()
    ]
