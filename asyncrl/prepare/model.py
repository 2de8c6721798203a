"""Local models: Qwen2-architecture causal LMs built from scratch, in HF format.

Nothing can be downloaded at run time, so the tests, the demo and the benchmarks use models
built here. head_dim is 64, one of the sizes vLLM's CPU attention supports
(32, 64, 96, ..., 256, 512). Weights are float32: the CPU stack is checked in float32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from asyncrl.prepare.tokenizer import build_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSize:
    """Shape of a built model; ``hidden // heads`` must be a vLLM CPU head_dim."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int


SIZES = {
    # ~0.33M parameters: tests and the CPU demo (about 5,000 tokens/s on 2 cores in vLLM).
    "tiny": ModelSize(
        hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, max_positions=512
    ),
    # ~24M parameters: benchmarks, where generation and training costs are realistic.
    "small": ModelSize(
        hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, max_positions=1024
    ),
}


def build_model(name: str, out_dir: Path, seed: int = 0):  # -> (model, tokenizer)
    """Build model ``name`` with random weights and its tokenizer; save both to ``out_dir``.

    Returns the transformers model (float32, eval mode) and tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    if name not in SIZES:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(SIZES)}")
    size = SIZES[name]
    tok = build_tokenizer(out_dir)
    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id  # looked up by name at run time
    assert isinstance(pad_id, int) and isinstance(eos_id, int), (pad_id, eos_id)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=size.max_positions,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Generation stops at the end of the assistant turn; sampling defaults are neutral so
    # that a plain `generate(do_sample=True)` samples the full distribution.
    model.generation_config = GenerationConfig(
        do_sample=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
    )
    save_model(model, tok, out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built %s: %.2fM parameters -> %s", name, n_params / 1e6, out_dir)
    return model.eval(), tok


def save_model(model, tokenizer, out_dir: Path) -> None:
    """Save in HF format (safetensors) that vLLM and transformers both load."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
