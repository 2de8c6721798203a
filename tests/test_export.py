"""The final HF export (``learner.export``): what transformers loads from ``final/`` is
the function the learner trained, whatever ``model.path`` was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from learner.export import EXPORT_MARK, export_hf, exported_step


def _state(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    # Parameters, not the state dict: a tied head is one tensor, as the trainer gives it.
    return {k: v.detach().to(dtype) for k, v in model.named_parameters()}


def test_the_config_is_the_one_trained_with_in_the_weights_dtype(tiny_model, tmp_path):
    """``model.override_config`` changes the function the learner trains: the export's
    config carries it (a copy of the source's config did not: its logits differed), and
    its dtype is the weights' (bf16 weights read as float32, at twice the memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    eps = AutoConfig.from_pretrained(str(tiny_model)).rms_norm_eps
    out = export_hf(
        tmp_path / "final",
        _state(tiny_model, torch.bfloat16),
        tiny_model,
        step=7,
        config_overrides={"rms_norm_eps": 1e-3},
    )
    assert out is not None and eps != 1e-3
    config = AutoConfig.from_pretrained(str(out))
    assert config.rms_norm_eps == 1e-3 and config.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    assert exported_step(out) == 7


def test_an_export_replaces_the_last_whole(tiny_model, tmp_path):
    """The new export is moved in whole over the old one, leaving no ``.tmp`` or
    ``.old``; a directory whose mark is missing or torn holds no whole export."""
    state = _state(tiny_model, torch.float32)
    final = tmp_path / "final"
    export_hf(final, state, tiny_model, step=3)
    (final / "stale.bin").write_text("old weights")
    export_hf(final, state, tiny_model, step=5)
    assert exported_step(final) == 5 and not (final / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    (final / EXPORT_MARK).write_text("{")
    assert exported_step(final) is None
    assert exported_step(tmp_path / "nothing") is None


def test_a_hub_id_exports_from_the_cache_it_loaded(tiny_model, tmp_path):
    """``model.path`` may be a hub id, loaded from the local cache: the export takes the
    tokenizer and config from that cache's snapshot (it read ``Path(model.path)``, no
    directory, and the run failed at its last step, at every restart)."""
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(tiny_model, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from learner.export import export_hf\n"
        "m = AutoModelForCausalLM.from_pretrained('org/tiny', dtype=torch.float32)\n"
        "export_hf(sys.argv[1], dict(m.named_parameters()), 'org/tiny', step=2)\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "final"
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(str(out))
    assert AutoTokenizer.from_pretrained(str(out)).encode("3+4=") == [18, 10, 19, 28]
    assert json.loads((out / EXPORT_MARK).read_text()) == {"step": 2}


def test_every_exported_file_is_on_disk_before_the_export_is_published(
    tiny_model, tmp_path, monkeypatch
):
    """After a node's crash (not a kill: the page cache is lost), a renamed ``final/``
    whose files were never flushed can hold empty ones under a valid-looking mark. Each
    file, the mark among them, and the folder are flushed before the rename publishes it,
    and the rename itself after."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(self: Path, target):
        events.append(("rename", str(self)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    export_hf(tmp_path / "final", _state(tiny_model, torch.float32), tiny_model, step=2)
    tmp = str(tmp_path / "final.tmp")
    published = events.index(("rename", tmp))
    flushed = {path for kind, path in events[:published] if kind == "fsync"}
    written = {str(tmp_path / "final.tmp" / p.name) for p in (tmp_path / "final").iterdir()}
    assert EXPORT_MARK in {Path(p).name for p in written} and "model.safetensors" in {
        Path(p).name for p in written
    }
    assert written | {tmp} <= flushed, sorted(written | {tmp} - flushed)
    assert ("fsync", str(tmp_path)) in events[published:]
