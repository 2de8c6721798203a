"""Input rows checked before any role starts: every row of every data file (not only the
first) is read at launch and refused in the line the learner's read gives, naming the file,
the row and the fix; validation scheduled with no validation files is refused; a scorer
module that imports too slowly names the key that gives it longer."""

from __future__ import annotations

import datetime
import decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.inputs import DATA, ROWS, input_problems
from asyncrl.control.task_source import load_rows

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1"]


def _row(i: int) -> dict[str, Any]:
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"{i}+1="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }


def _write(path: Path, rows: list[dict[str, Any]], row_group_size: int | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _launch_and_learner_lines(path: Path) -> tuple[list[str], str]:
    """What the launch check says of a training file, and the learner's read of it."""
    problems = input_problems(load_config(None, [f"data.train_files={path}", *QUIET]), [DATA, ROWS])
    with pytest.raises(ConfigError) as refused:
        load_rows([str(path)])
    return problems, refused.value.problems[0]


def test_validation_scheduled_with_no_validation_files_is_refused(tmp_path: Path) -> None:
    """``data.val_files=[]`` with validation scheduled ran without ever validating, and
    said nothing (an empty validation file, by contrast, was refused)."""
    train = _write(tmp_path / "train.parquet", [_row(i) for i in range(32)])
    base = [f"data.train_files={train}", "data.val_files=[]"]
    for scheduled in (["trainer.val_before_train=true"], ["trainer.test_freq=5"]):
        (line,) = input_problems(load_config(None, [*base, *scheduled]), [DATA, ROWS])
        assert line == (
            "data.val_files is empty, so validation would never report: add files, or set "
            "trainer.val_before_train=false trainer.test_freq=-1"
        )
    assert input_problems(load_config(None, [*base, *QUIET]), [DATA, ROWS]) == []


@pytest.mark.parametrize(
    ("prompt", "what"),
    [
        (None, "its 'prompt' is null"),
        ([], "its 'prompt' is an empty list"),
        ([{"role": "user", "content": None}], "message 0 of its 'prompt' has content null"),
    ],
    ids=["null", "empty", "null-content"],
)
def test_a_bad_row_past_the_first_is_refused_at_launch_as_the_learner_would(
    tmp_path: Path, prompt: Any, what: str
) -> None:
    """Row 40 of 64 is bad: the launch check, which read row 0 only, passed the file, and
    either the learner refused it after every role had started (a null prompt) or no one
    did and each rollout server's tokenizer failed on it, retry after retry, in a traceback
    naming neither file nor row (an empty prompt, a message without text)."""
    rows = [_row(i) for i in range(64)]
    rows[40]["prompt"] = prompt
    path = _write(tmp_path / "train.parquet", rows, row_group_size=16)
    problems, learner = _launch_and_learner_lines(path)
    assert problems == [learner]
    assert learner.startswith(f"drop or mend row 40 of {path}: {what}")
    # A learner's own start checks the first row only: it reads every row next (the line
    # above), and would otherwise read the data twice.
    cfg = load_config(None, [f"data.train_files={path}", *QUIET])
    assert input_problems(cfg, [DATA]) == []


def test_rows_are_numbered_as_the_learner_numbers_them_across_batches(tmp_path: Path) -> None:
    """The launch check reads the prompt and reward columns a batch at a time; a bad row
    in a later batch and row group is named with its index in the file."""
    rows = [_row(i) for i in range(4200)]
    rows[4150]["prompt"] = [{"role": "user", "content": "a"}, {"role": None, "content": "b"}]
    path = _write(tmp_path / "train.parquet", rows, row_group_size=1000)
    problems, learner = _launch_and_learner_lines(path)
    assert problems == [learner]
    assert learner.startswith(f"drop or mend row 4150 of {path}: message 1 of its 'prompt' has")


def test_text_parts_and_tool_calls_stay_allowed(tmp_path: Path) -> None:
    """Content as a list of text parts, and an assistant message that only calls tools,
    were accepted before the content check and still are; an image part is not text."""
    rows = [_row(i) for i in range(32)]
    for i, row in enumerate(rows):
        row["prompt"] = [{"role": "user", "content": [{"type": "text", "text": f"{i}+1="}]}]
    parts = _write(tmp_path / "parts.parquet", rows)
    quiet = [f"data.train_files={parts}", *QUIET]
    assert input_problems(load_config(None, quiet), [DATA, ROWS]) == []
    assert len(load_rows([str(parts)])) == 32
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c0"}]}
    calls = [{**_row(i), "prompt": [_row(i)["prompt"][0], call]} for i in range(32)]
    assert len(load_rows([str(_write(tmp_path / "calls.parquet", calls))])) == 32
    rows[3]["prompt"] = [{"role": "user", "content": [{"type": "image", "text": None}]}]
    problems, learner = _launch_and_learner_lines(_write(tmp_path / "image.parquet", rows))
    assert problems == [learner] and "message 0 of its 'prompt' has content list" in learner


def test_a_scorer_module_slower_to_import_than_the_limit_names_the_key(tmp_path: Path) -> None:
    """A scorer module taking longer to import than the reward workers' 60 s start-up limit
    stopped its server in a line naming no fix, and no key changed the limit."""
    from rollout_servers.main import reward_pool

    scorer = tmp_path / "slow_scorer.py"
    scorer.write_text(
        "import time\n\ntime.sleep(1.0)  # a model loaded at import\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
    )
    base = [f"reward.custom_reward_function.path={scorer}", "reward.num_workers=1"]
    assert load_config(None, base).reward.startup_timeout_s == 60.0
    with pytest.raises(ConfigError, match="reward.startup_timeout_s"):
        load_config(None, [*base, "reward.startup_timeout_s=0"])
    with pytest.raises(ValueError) as refused:
        reward_pool(load_config(None, [*base, "reward.startup_timeout_s=0.3"]))
    line = str(refused.value)
    assert line.startswith("reward worker did not start within 0.3s")
    assert f"while importing {scorer}" in line
    assert line.endswith(
        "move heavy loading out of the module's import, or raise reward.startup_timeout_s"
    )
    with reward_pool(load_config(None, [*base, "reward.startup_timeout_s=30"])) as pool:
        assert pool.score("arithmetic", "2", "2").score == 1.0


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (datetime.datetime(2024, 1, 2, 3, 4, 5), "datetime"),
        (decimal.Decimal("1.25"), "Decimal"),
        (datetime.date(2024, 1, 2), "date"),
    ],
    ids=["timestamp", "decimal", "date"],
)
def test_extra_info_values_the_task_message_turns_to_text_are_refused(
    tmp_path: Path, value: Any, kind: str
) -> None:
    """A timestamp or decimal in ``extra_info`` reached the scorer as a string after the
    task message's msgpack trip, where veRL's scorer gets the object: a scorer comparing
    dates or prices went wrong without a word. Refused at launch and in the learner's read,
    nested ones too; the same values written as text or numbers load."""
    rows = [_row(i) for i in range(8)]
    for row in rows:
        row["extra_info"] = {"split": "train", "meta": {"tags": ["a"], "when": None}}
    rows[5]["extra_info"]["meta"]["when"] = value
    path = _write(tmp_path / "train.parquet", rows)
    problems, learner = _launch_and_learner_lines(path)
    assert problems == [learner]
    assert learner.startswith(
        f"drop or mend row 5 of {path}: its extra_info['meta']['when'] is a {kind} ("
    )
    assert "write it as text or a number" in learner
    rows[5]["extra_info"]["meta"]["when"] = str(value)
    fixed = _write(tmp_path / "fixed.parquet", rows)
    cfg = load_config(None, [f"data.train_files={fixed}", *QUIET])
    assert input_problems(cfg, [DATA, ROWS]) == []
    assert load_rows([str(fixed)])[5]["extra_info"]["meta"]["when"] == str(value)


@pytest.mark.parametrize(
    ("value", "where", "kind"),
    [
        (decimal.Decimal("0.25"), "", "Decimal"),
        (datetime.date(2024, 1, 2), "", "date"),
        (datetime.time(3, 4, 5), "", "time"),
        (datetime.datetime(2024, 1, 2, 3, 4, 5), "", "datetime"),
        (datetime.timedelta(seconds=90), "", "timedelta"),
        ({"price": decimal.Decimal("1.25"), "name": "x"}, "['price']", "Decimal"),
    ],
    ids=["decimal", "date", "time", "timestamp", "duration", "nested"],
)
def test_ground_truths_the_task_message_turns_to_text_are_refused(
    tmp_path: Path, value: Any, where: str, kind: str
) -> None:
    """A decimal, date, time, timestamp or duration ground truth passed the row check and
    reached the scorer as a string (the task message carries no such type), while the same
    value in ``extra_info`` was refused. Now refused alike, at launch and in the learner's
    read, in one line naming the row and the fix; the value written as text loads."""
    rows = [_row(i) for i in range(8)]
    for row in rows:
        row["reward_model"]["ground_truth"] = value
    path = _write(tmp_path / "train.parquet", rows)
    problems, learner = _launch_and_learner_lines(path)
    assert problems == [learner]
    assert learner.startswith(
        f"drop or mend row 0 of {path}: its reward_model['ground_truth']{where} is a {kind} ("
    )
    assert learner.endswith(
        "write it as text or a number (an ISO date string, a Unix time, a float) when "
        "writing the file"
    )
    for row in rows:
        row["reward_model"]["ground_truth"] = str(value)
    fixed = _write(tmp_path / "fixed.parquet", rows)
    assert (
        input_problems(load_config(None, [f"data.train_files={fixed}", *QUIET]), [DATA, ROWS]) == []
    )
    assert load_rows([str(fixed)])[3]["reward_model"]["ground_truth"] == str(value)
