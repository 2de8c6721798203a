"""``asyncrl-prepare``: data with long prompts filtered, and the model build (a build cut
short, one into a folder that holds a model, its log line, its options)."""

from __future__ import annotations

import json
import subprocess

import pandas as pd
import pytest

from tests.conftest import BIN, run_cli


def test_prepare_data_filters_long_prompts(tiny_model, tmp_path):
    # Countdown prompts are 272-279 tokens with this tokenizer and chat template: a limit of 274
    # keeps some and drops others, and the report counts what it dropped.
    proc = run_cli(
        "asyncrl-prepare",
        "data",
        "--task",
        "countdown",
        "--out",
        str(tmp_path),
        "--n-train",
        "200",
        "--n-val",
        "50",
        "--tokenizer",
        str(tiny_model),
        "--max-prompt-length",
        "274",
    )
    report = json.loads(proc.stdout)
    for split in ("train", "val"):
        rows = pd.read_parquet(tmp_path / f"{split}.parquet")
        assert len(rows) == report[split]["written"]
        assert report[split]["written"] + report[split]["filtered"] == (
            200 if split == "train" else 50
        )
    assert report["train"]["filtered"] > 0 and report["train"]["written"] > 0


def test_prepare_rejects_limit_without_tokenizer(tmp_path):
    proc = subprocess.run(
        [str(BIN / "asyncrl-prepare"), "data", "--out", str(tmp_path), "--max-prompt-length", "9"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "needs --tokenizer" in proc.stderr


def test_a_model_build_cut_short_leaves_no_model_folder(tmp_path, monkeypatch):
    """The warm start takes minutes on a busy machine; a build interrupted during it left
    ``config.json`` and untrained weights where the model goes, which the demo then
    trained on. Now the folder appears only complete, and a rebuild replaces the rest."""
    from asyncrl.prepare import main as prepare

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "tiny-demo"
    monkeypatch.setattr(prepare, "_warm_start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["model", "--name", "tiny", "--out", str(out)])
    assert not out.exists() and (tmp_path / "tiny-demo.partial" / "config.json").is_file()
    monkeypatch.undo()
    assert prepare.main(["model", "--name", "tiny", "--warm-start", "off", "--out", str(out)]) == 0
    assert (out / "prepare_report.json").is_file() and not (tmp_path / "tiny-demo.partial").exists()


def test_a_model_build_over_a_built_model_is_refused_without_force(tmp_path, capsys):
    """Building again into the demo's model folder with other flags (``--flatten`` left
    out) replaced the model without a word, and ``make demo``, which looks for the folder
    only, trained the wrong one. Now it is refused in one line naming what is there."""
    from asyncrl.prepare import main as prepare

    out = tmp_path / "tiny-demo"
    assert prepare.main(["model", "--name", "tiny", "--warm-start", "off", "--out", str(out)]) == 0
    built = (out / "prepare_report.json").read_text()
    capsys.readouterr()
    assert prepare.main(["model", "--name", "tiny", "--warm-start", "off", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds a model already (tiny, no warm start); give another --out, or --force" in err
    assert (out / "prepare_report.json").read_text() == built
    force = ["model", "--name", "tiny", "--warm-start", "off", "--seed", "1", "--force"]
    assert prepare.main([*force, "--out", str(out)]) == 0


def test_the_flattened_warm_starts_line_formats_with_the_default_steps(monkeypatch, caplog):
    """The README's first build step printed a logging traceback: the line formatted
    ``--sft-steps``, None unless given, as a number (the report used the default, 800)."""
    import argparse

    from asyncrl.prepare import main as prepare
    from asyncrl.prepare import warmstart

    monkeypatch.setattr(warmstart, "supervised", lambda *a, **k: 0.5)
    monkeypatch.setattr(warmstart, "sampling_accuracy", lambda *a, **k: 0.25)
    monkeypatch.setattr(warmstart, "flatten", lambda *a, **k: (2.5, 0.25))
    args = argparse.Namespace(
        data_seed=0, max_operand=9, ops="+", n_val=None, flatten=True, sft_steps=None,
        seed=0, target_accuracy=None, max_accuracy=0.35,
    )  # fmt: skip
    with caplog.at_level("INFO", logger="asyncrl.prepare"):
        report = prepare._warm_start(None, None, args)
    (line,) = [r.getMessage() for r in caplog.records if "supervised steps" in r.msg]
    assert line.startswith("warm start: 800 supervised steps") and report["steps"] == 800


def test_prepare_refuses_an_unknown_log_level_as_a_usage_error(tmp_path, capsys):
    from asyncrl.prepare import main as prepare

    with pytest.raises(SystemExit) as exit_:
        prepare.main(["--log-level", "foo", "keys", "--out", str(tmp_path / "keys")])
    assert exit_.value.code == 2 and "invalid choice: 'foo'" in capsys.readouterr().err
    assert not (tmp_path / "keys").exists()
