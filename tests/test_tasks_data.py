"""Generated prompt data is in veRL's parquet layout, reproducible, split without overlap,
and readable by plain pyarrow and pandas; veRL's own gsm8k layout reads back too."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.rewards import default_compute_score
from asyncrl.tasks import TASKS, arithmetic, countdown, gsm8k, prepare_task_data
from asyncrl.tasks.parquet import read_rows, write_rows
from asyncrl.tasks.schema import VERL_COLUMNS

SMALL = {
    "arithmetic": {},
    "calculator": {"n_train": 200, "n_val": 20},
    "countdown": {"n_train": 300, "n_val": 50},
}
# veRL's optional per-row agent column, written by tasks played as multi-turn episodes.
EXTRA = {"calculator": ["agent_name"]}


def prompts(rows: list[dict[str, Any]]) -> set[str]:
    return {row["prompt"][0]["content"] for row in rows}


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("data")
    return {task: prepare_task_data(task, out / task, seed=3, **SMALL[task]) for task in TASKS}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_plain_readers_see_verl_columns(prepared: dict, task: str) -> None:
    path = prepared[task]["train"]["path"]
    schema = pq.read_table(path).schema
    columns = list(VERL_COLUMNS) + EXTRA.get(task, [])
    assert schema.names == columns
    assert schema.field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    )
    truth_type = schema.field("reward_model").type.field("ground_truth").type
    frame = pd.read_parquet(path)
    assert list(frame.columns) == columns
    first = frame.iloc[0]
    assert first["data_source"] == task
    assert first["ability"] == "math"
    assert [dict(m) for m in first["prompt"]][0]["role"] == "user"
    assert first["reward_model"]["style"] == "rule"
    assert first["extra_info"]["split"] == "train"
    assert first["extra_info"]["index"] == 0
    assert frame.iloc[-1]["extra_info"]["index"] == len(frame) - 1
    if task == "countdown":
        assert truth_type == pa.struct([("target", pa.int64()), ("numbers", pa.list_(pa.int64()))])
        truth = read_rows(path)[0]["reward_model"]["ground_truth"]
        assert isinstance(truth["target"], int)
        assert isinstance(truth["numbers"], list)
        assert 3 <= len(truth["numbers"]) <= 4
    else:
        assert truth_type == pa.string()
    val = pd.read_parquet(prepared[task]["val"]["path"])
    assert set(val["extra_info"].map(lambda info: info["split"])) == {"test"}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_and_val_prompts_are_disjoint(prepared: dict, task: str) -> None:
    train = read_rows(prepared[task]["train"]["path"])
    val = read_rows(prepared[task]["val"]["path"])
    assert len(train) == prepared[task]["train"]["written"] > 0
    assert len(val) == prepared[task]["val"]["written"] > 0
    assert not prompts(train) & prompts(val)
    assert len(prompts(train)) == len(train)
    if task == "countdown":
        keys = [
            (
                tuple(sorted(r["reward_model"]["ground_truth"]["numbers"])),
                r["reward_model"]["ground_truth"]["target"],
            )
            for r in train + val
        ]
        assert len(set(keys)) == len(keys)


def test_arithmetic_defaults_cover_every_problem(prepared: dict) -> None:
    report = prepared["arithmetic"]
    assert (report["train"]["written"], report["val"]["written"]) == (80, 20)
    rows = read_rows(report["train"]["path"]) + read_rows(report["val"]["path"])
    assert prompts(rows) == {f"{a}+{b}=" for a in range(10) for b in range(10)}
    for row in rows:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))


def test_arithmetic_options_and_errors() -> None:
    train, val = arithmetic.generate(max_operand=4, ops=("-", "*"), seed=1, val_fraction=0.1)
    assert len(train) + len(val) == 50 and len(val) == 5
    row = next(r for r in train + val if r["prompt"][0]["content"] == "2-4=")
    assert row["reward_model"]["ground_truth"] == "-2"
    train, val = arithmetic.generate(max_operand=10**6, n_train=100, n_val=10, seed=1)
    assert len(prompts(train)) == 100 and not prompts(train) & prompts(val)
    with pytest.raises(ValueError, match="distinct problems"):
        arithmetic.generate(n_train=95, n_val=10)
    with pytest.raises(ValueError, match="ops"):
        arithmetic.generate(ops=("/",))
    with pytest.raises(KeyError, match="known tasks"):
        prepare_task_data("sudoku", Path("unused"), seed=0)


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    for task, kwargs in SMALL.items():
        first = prepare_task_data(task, tmp_path / "a" / task, seed=7, **kwargs)
        second = prepare_task_data(task, tmp_path / "b" / task, seed=7, **kwargs)
        other = prepare_task_data(task, tmp_path / "c" / task, seed=8, **kwargs)
        for split in ("train", "val"):
            assert sha256(first[split]["path"]) == sha256(second[split]["path"])
            assert sha256(first[split]["path"]) != sha256(other[split]["path"])


def test_long_prompts_are_dropped_and_counted(tmp_path: Path) -> None:
    def count(messages: list[dict]) -> int:
        return len(messages[0]["content"])

    # Operands up to 12: "3+5=" has 4 characters, anything with a 2-digit operand more.
    train, val = arithmetic.generate(max_operand=12, seed=5)
    expected = {
        "train": sum(count(r["prompt"]) > 4 for r in train),
        "val": sum(count(r["prompt"]) > 4 for r in val),
    }
    report = prepare_task_data(
        "arithmetic",
        tmp_path,
        seed=5,
        max_operand=12,
        count_prompt_tokens=count,
        max_prompt_length=4,
    )
    for split, rows in (("train", train), ("val", val)):
        kept = read_rows(report[split]["path"])
        assert report[split]["filtered"] == expected[split] > 0
        assert report[split]["written"] == len(kept) == len(rows) - expected[split]
        assert all(count(r["prompt"]) <= 4 for r in kept)
        assert [r["extra_info"]["index"] for r in kept] == list(range(len(kept)))
    with pytest.raises(ValueError, match="count_prompt_tokens"):
        prepare_task_data("arithmetic", tmp_path, seed=5, max_prompt_length=4)


def test_every_countdown_problem_is_solvable(prepared: dict) -> None:
    for split in ("train", "val"):
        for row in read_rows(prepared["countdown"][split]["path"]):
            truth = row["reward_model"]["ground_truth"]
            content = row["prompt"][0]["content"]
            assert content == countdown.PROMPT_TEMPLATE.format(
                numbers=truth["numbers"], target=truth["target"]
            )
            assert 1 <= truth["target"] <= 100
            response = f"<think>...</think><answer>{row['extra_info']['solution']}</answer>"
            assert default_compute_score("countdown", response, truth) == 1.0


def test_round_trip_gives_back_the_same_rows(tmp_path: Path) -> None:
    for task, kwargs in SMALL.items():
        train, _ = TASKS[task](seed=11, **kwargs)
        path = write_rows(train, tmp_path / f"{task}.parquet")
        assert read_rows(path) == train
    empty = write_rows([], tmp_path / "empty.parquet", schema=pq.read_schema(path))
    assert read_rows(empty) == []


def test_missing_column_is_named_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pd.DataFrame(
        {"data_source": ["x"], "prompt": [[{"role": "user", "content": "hi"}]]}
    ).to_parquet(path)
    with pytest.raises(ValueError, match=r"bad\.parquet.*'reward_model'"):
        read_rows(path)
    with pytest.raises(FileNotFoundError):
        read_rows(tmp_path / "nope.parquet")


def test_reads_verl_gsm8k_layout_written_by_pandas(tmp_path: Path) -> None:
    question = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?"
    )
    answer = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
    )
    frame = pd.DataFrame(
        [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {gsm8k.INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": "72"},
                "extra_info": {
                    "split": "train",
                    "index": 0,
                    "answer": answer,
                    "question": question,
                },
            },
            gsm8k.make_row(
                "What is 1,000 + 234?", "1000 + 234\n#### 1,234", split="train", index=1
            ),
        ]
    )
    path = tmp_path / "train.parquet"
    frame.to_parquet(path)
    rows = gsm8k.read_gsm8k(path)
    assert rows[0]["extra_info"] == {
        "split": "train",
        "index": 0,
        "answer": answer,
        "question": question,
    }
    assert rows[0]["prompt"][0]["content"].endswith('after "####".')
    assert rows[1]["reward_model"]["ground_truth"] == "1234"

    def score(row: dict[str, Any], response: str) -> float:
        truth = row["reward_model"]["ground_truth"]
        return default_compute_score(row["data_source"], response, truth)

    assert score(rows[0], "48 + 24 = 72 clips.\n#### 72") == 1.0
    assert score(rows[0], "#### 71") == 0.0
    assert score(rows[1], "So #### 1,234") == 1.0
    # A full "#### 72" answer as ground truth scores the same.
    assert default_compute_score("gsm8k", "#### 72", answer) == 1.0
