"""The probes that check a model takes packed or shared rows compare a layout's logprobs
with the padded rows' within a tolerance of the compute dtype: on CUDA the forward runs in
bf16, where the padded and packed forwards differ by bf16 steps; at float32's 1e-3 a real
model on a GPU always fell back to padded rows. Stand-in forwards, whose packed rows differ
as bf16 would, or as a model that mixes sequences does."""

from __future__ import annotations

import torch

from learner.collate import MicroBatch
from learner.layout import packing_works, probe_atol, resolve_layout


def _forward(packed_shift: float):
    def forward(mb: MicroBatch) -> torch.Tensor:  # [B, T] logprobs
        packed = mb.input_ids.shape[0] == 1  # the probe's two sequences in one row
        return torch.full(mb.mask.shape, -2.0) + (packed_shift if packed else 0.0)

    return forward


def test_the_probe_tolerance_follows_the_compute_dtype():
    bf16_noise, mixed = _forward(0.06), _forward(1.5)
    assert packing_works(bf16_noise, probe_atol("cuda"))  # bf16 rounding: packed rows kept
    assert not packing_works(bf16_noise, probe_atol("cpu"))  # float32 agrees to rounding
    assert not packing_works(mixed, probe_atol("cuda"))  # sequences mixed: padded rows
    assert packing_works(_forward(0.0), probe_atol("cpu"))


def test_the_chosen_layout_is_probed_at_its_devices_tolerance():
    """Through resolve_layout, as the trainer calls it: packed rows kept on CUDA under
    bf16-sized differences, refused under float32's."""
    bf16_noise = _forward(0.06)
    assert resolve_layout("packed", None, "cuda", forward=bf16_noise) == "packed"
    assert resolve_layout("packed", None, "cpu", forward=bf16_noise) == "padded"
    assert resolve_layout("packed", None, "cuda", forward=_forward(1.5)) == "padded"
