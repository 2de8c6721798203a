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


def test_a_model_whose_attention_slides_gets_padded_rows_not_shared_ones():
    """Found by a review: transformers applies no sliding window on top of a 4D mask, so
    in the shared layout every layer of a model with one (Mistral, Gemma's local layers,
    Qwen2 with use_sliding_window) attended over the whole context, unlike vLLM and the
    padded rows: past the window, logprobs, ratios and gradients were silently another
    model's. The probe's short sequences fit in any real window and could not tell."""
    import random

    from transformers import Gemma2Config, MistralConfig, MistralForCausalLM, Qwen2Config

    from learner.collate import collate
    from learner.forward import response_logprobs
    from learner.layout import sliding_window
    from learner.rollouts import Rollout
    from learner.shared_prefix import collate_shared

    assert sliding_window(MistralConfig(sliding_window=10)) == 10
    assert sliding_window(Gemma2Config()) == 4096  # alternating local and global layers
    assert sliding_window(Qwen2Config()) is None  # use_sliding_window off by default
    on = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert sliding_window(on) == 64
    # Why: a tiny Mistral whose layers slide over 10 tokens, on sequences of 16.
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=10,
    )
    config._attn_implementation = "sdpa"
    model = MistralForCausalLM(config).eval()
    rng = random.Random(0)
    prompt = [rng.randrange(64) for _ in range(8)]
    batch = [Rollout(prompt, [rng.randrange(64) for _ in range(8)], [0.0] * 8, 0.0, 0)]
    batch.append(Rollout(prompt, [rng.randrange(64) for _ in range(8)], [0.0] * 8, 0.0, 0))
    with torch.no_grad():
        shared_mb = collate_shared(batch, torch.zeros(2), [0, 1])
        padded_mb = collate(batch, torch.zeros(2), [0, 1])
        assert shared_mb.attention_mask is not None and shared_mb.attention_mask.ndim == 4
        shared, _ = response_logprobs(model, shared_mb)
        padded, _ = response_logprobs(model, padded_mb)
    assert (shared - padded)[padded_mb.mask].abs().max() > 1e-3  # another model past it

    def shared_ok(mb: MicroBatch) -> torch.Tensor:  # a probe that passes, as it did
        return torch.zeros(mb.mask.shape)

    assert resolve_layout("auto", "sdpa", "cpu", forward=shared_ok) == "shared"
    assert resolve_layout("auto", "sdpa", "cpu", forward=shared_ok, window=10) == "padded"
    assert resolve_layout("shared", None, "cpu", forward=shared_ok, window=10) == "padded"
    assert resolve_layout("packed", None, "cpu", forward=shared_ok, window=10) == "packed"
