"""``asyncrl-prepare data`` refuses a flag it cannot honour in one line naming it, exit 2
(it printed tracebacks, accepted negative counts and ignored flags of another task), and
warns of a split that --max-prompt-length emptied."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncrl.prepare.main import main
from asyncrl.tasks import calculator

TINY = "artifacts/models/tiny-demo"


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["data", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--n-train", "-5"], "--n-train must be >= 0"),
        (["--n-val", "-1"], "--n-val must be >= 0"),
        (["--n-train", "0", "--n-val", "0"], "--n-train 0 and --n-val 0 write no rows"),
        (["--task", "countdown", "--ops", "*"], "--ops applies to --task arithmetic only"),
        (["--task", "calculator", "--max-operand", "3", "--ops", "+"], "--max-operand and --ops"),
        (["--max-operand", "-3"], "--max-operand must be >= 0"),
        (["--tokenizer", TINY, "--max-prompt-length", "0"], "--max-prompt-length must be >= 1"),
    ],
)
def test_bad_flags_are_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    assert named in _refused(capsys, "--out", str(tmp_path / "out"), *flags)
    assert not (tmp_path / "out" / "train.parquet").exists()


def test_tokenizer_and_out_problems_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    limit = ["--max-prompt-length", "10"]
    line = _refused(capsys, "--out", out, "--tokenizer", "/nonexistent", *limit)
    assert line.startswith("asyncrl-prepare data: --tokenizer /nonexistent does not exist")
    empty = tmp_path / "empty_model"
    empty.mkdir()
    assert f"--tokenizer {empty}: no tokenizer loads" in _refused(
        capsys, "--out", out, "--tokenizer", str(empty), *limit
    )
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert f"--out {a_file} is a file" in _refused(capsys, "--out", str(a_file))
    assert "--out" in _refused(capsys, "--out", str(a_file / "below"))


def test_a_split_emptied_by_the_prompt_limit_is_warned_of(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    tiny_model: Path,
) -> None:
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="asyncrl.prepare"):
        argv = ["--out", str(out), "--tokenizer", str(tiny_model), "--max-prompt-length", "1"]
        assert main(["data", "--n-val", "4", "--n-train", "8", *argv]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("raise --max-prompt-length" in w for w in warned)
    assert str(out / "val.parquet") in warned[1]
    capsys.readouterr()


@pytest.mark.timeout(60)  # it drew forever for the products that were not there
def test_calculator_refuses_more_rows_than_it_has_distinct_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """calculator rows alternate sums and products, and there are only 8,100 distinct
    products: one row more than 16,201 in all looped forever. Now refused in one line
    naming the flags and the most rows it gives, as arithmetic and countdown refuse; the
    most itself is generated, every problem distinct."""
    most = calculator.max_rows()
    assert most == 16201
    out = tmp_path / "out"
    argv = ["--task", "calculator", "--out", str(out), "--n-val", "32"]
    line = _refused(capsys, *argv, "--n-train", str(most - 32 + 1))
    assert line.startswith("asyncrl-prepare data: calculator has 8100 distinct products")
    assert line.rstrip().endswith(f"--n-train plus --n-val at most {most}.")
    assert not (out / "train.parquet").exists()
    train, val = calculator.generate(n_train=most - 32, n_val=32)
    assert len({row["prompt"][0]["content"] for row in train + val}) == most
