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


def test_a_model_build_into_a_folder_of_other_files_is_refused_and_keeps_them(tmp_path, capsys):
    """Found by a review: ``--out artifacts/models`` (a folder the model goes *into*, as
    ``data --out`` is) passed the check for a model already there, and the build then
    replaced the whole folder, deleting the models and checkpoints in it. Now refused,
    with or without ``--force``."""
    from asyncrl.prepare import main as prepare

    models = tmp_path / "models"
    (models / "tiny-demo").mkdir(parents=True)
    (models / "tiny-demo" / "model.safetensors").write_text("weights")
    for force in ([], ["--force"]):
        argv = ["model", "--warm-start", "off", *force, "--out", str(models)]
        assert prepare.main(argv) == 2
        err = capsys.readouterr().err
        assert f"--out {models} holds files and no model" in err
        assert f"give an empty or new folder (say, {models / 'tiny'})" in err
    assert (models / "tiny-demo" / "model.safetensors").read_text() == "weights"
    assert not (tmp_path / "models.partial").exists()  # refused before anything was built
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare.main(["model", "--warm-start", "off", "--out", str(empty)]) == 0
    assert (empty / "config.json").is_file()


def test_the_calculator_warm_start_refuses_arithmetic_flags_and_holds_out_n_val(tmp_path, capsys):
    """Found by a review: the calculator warm start ignored ``--n-val``, ``--max-operand``
    and ``--ops`` without a word. With ``--n-val 100`` given to both commands, as their
    help asks, the model trained on 68 of the data's 100 validation problems."""
    from asyncrl.prepare import main as prepare
    from asyncrl.tasks import calculator

    base = ["model", "--task", "calculator", "--warm-start", "on", "--sft-steps", "1"]
    for flags, named in (
        (["--ops", "+"], "--ops apply"),
        (["--max-operand", "0", "--ops", "*"], "--max-operand and --ops apply"),
    ):
        assert prepare.main([*base, *flags, "--out", str(tmp_path / "refused")]) == 2
        assert f"{named} to the arithmetic warm start only" in capsys.readouterr().err
    assert not (tmp_path / "refused.partial").exists()
    out = tmp_path / "agent"
    assert prepare.main([*base, "--n-val", "6", "--out", str(out)]) == 0
    report = json.loads((out / "prepare_report.json").read_text())["warm_start"]
    assert report["n_val"] == 6 and report["steps"] == 1
    zero = [*base[:-1], "0", "--out", str(tmp_path / "zero")]
    assert prepare.main(zero) == 2  # 0 steps was read as the default, 800
    assert "--sft-steps must be >= 1, got 0" in capsys.readouterr().err
    # The rows it held out are the data command's validation rows for the same flags.
    assert len(calculator.generate(seed=0, n_val=6)[1]) == 6


def test_an_arithmetic_split_does_not_depend_on_the_order_the_operators_are_given():
    """Found by a review: problems were listed in the order ``--ops`` gave them, so a model
    warm started on ``+-`` trained on validation rows of data built with ``-+``."""
    from asyncrl.tasks import arithmetic

    assert arithmetic.generate(ops="+-") == arithmetic.generate(ops="-+")
    assert arithmetic.generate(ops=("*", "+", "*")) == arithmetic.generate(ops="+*")
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        arithmetic.generate(ops="+/")


def test_both_data_files_appear_together(tmp_path, monkeypatch):
    """Found by a review: ``make`` and the benchmarks take ``train.parquet`` for a complete
    build, but it was written before ``val.parquet``: a build cut short between them left
    a new train file beside none, or beside an older build's validation rows."""
    from asyncrl.tasks import parquet, prepare_task_data

    out = tmp_path / "data"
    prepare_task_data("arithmetic", out, seed=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["train.parquet", "val.parquet"]
    real = parquet.write_rows

    def cut_at_val(rows, path, **kwargs):
        if "val" in path.name:
            raise KeyboardInterrupt
        return real(rows, path, **kwargs)

    monkeypatch.setattr(parquet, "write_rows", cut_at_val)
    with pytest.raises(KeyboardInterrupt):
        prepare_task_data("arithmetic", out, seed=1)
    assert {p.name: p.read_bytes() for p in out.glob("*.parquet")} == before
