"""Per-row fields the task message constrains are checked where rows are read (the launch
check and the learner's read give the same line, naming the row): a null data_source, an
agent_name the wire cannot carry. Prompts given as text parts are dealt as text, which
every chat template (and a tokenizer without one) renders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.inputs import DATA, REWARD, ROWS, input_problems
from asyncrl.control.messages import Task, TaskGrant
from asyncrl.control.task_source import TaskSource, load_rows
from asyncrl.tasks.parquet import agent_name_limit

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1"]


def _row(i: int, **fields: Any) -> dict[str, Any]:
    row = {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": f"{i}+1="}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }
    return row | fields


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _first(path: Path, count: int = 1) -> list[Task]:
    """The first ``count`` tasks the learner deals from a training file, in file order."""
    source = TaskSource(load_rows([str(path)]), shuffle=False, lineage="")
    tasks = [source.next_train() for _ in range(count)]
    return [t for t in tasks if t is not None]


def _lines(path: Path) -> tuple[list[str], str]:
    """The launch check's lines for a training file (data and scorer), and the learner's."""
    cfg = load_config(None, [f"data.train_files={path}", *QUIET])
    launch = input_problems(cfg, [DATA, ROWS, REWARD])
    with pytest.raises(ConfigError) as refused:
        load_rows([str(path)])
    (learner,) = refused.value.problems
    return launch, learner


def test_a_null_data_source_names_the_row_not_a_scorer(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.parquet", [_row(0), _row(1, data_source=None), _row(2)])
    launch, learner = _lines(path)
    assert launch == [learner] == [f"drop or mend row 1 of {path}: its data_source is null"]


def test_a_data_source_longer_than_a_trajectory_carries_is_refused_at_launch(
    tmp_path: Path,
) -> None:
    """Found by a review: a data_source over the trajectory's 256 characters passed every
    check, then each of the row's groups was generated and scored and failed to push, was
    dealt again, and was given up after task_retries (four generations, four tracebacks)."""
    from asyncrl.wire.types import MAX_SHORT_STR

    ok = _write(tmp_path / "ok.parquet", [_row(0, data_source="s" * MAX_SHORT_STR)])
    assert input_problems(load_config(None, [f"data.train_files={ok}", *QUIET]), [DATA, ROWS]) == []
    bad = _write(
        tmp_path / "bad.parquet", [_row(0), _row(1, data_source="s" * (MAX_SHORT_STR + 1))]
    )
    launch, learner = _lines(bad)
    assert launch == [learner]
    assert learner.startswith(f"drop or mend row 1 of {bad}: its data_source 'sss")
    assert f"over {MAX_SHORT_STR} characters" in learner


def test_an_agent_name_longer_than_the_wire_carries_is_refused_at_launch(
    tmp_path: Path,
) -> None:
    limit = agent_name_limit()
    assert limit == 64  # Task.agent_name's max_length, read from the message itself
    fits, long = "a" * limit, "b" * (limit + 1)
    ok = _write(tmp_path / "ok.parquet", [_row(0, agent_name=fits), _row(1, agent_name=None)])
    assert input_problems(load_config(None, [f"data.train_files={ok}", *QUIET]), [DATA, ROWS]) == []
    grant = TaskGrant(tasks=_first(ok, 2), policy_version=0)
    assert len(grant.tasks) == 2
    msgspec.msgpack.decode(msgspec.msgpack.encode(grant), type=TaskGrant)  # as a server does
    named = [_row(0, agent_name=None), _row(1, agent_name="tool_agent")]
    bad = _write(tmp_path / "bad.parquet", [*named, _row(2, agent_name=long)])
    launch, learner = _lines(bad)
    assert launch == [learner]
    assert learner.startswith(f"drop or mend row 2 of {bad}: its agent_name 'bbb")
    assert f"at most {limit} characters" in learner
    number = _write(tmp_path / "n.parquet", [_row(0, agent_name=7)])
    assert "row 0" in _lines(number)[1]


def test_text_parts_are_dealt_as_text_every_template_renders(
    tmp_path: Path, tiny_model: Path
) -> None:
    from transformers import AutoTokenizer

    from asyncrl.prepare.tokenizer import prompt_text

    parts = [{"type": "text", "text": "3+5"}, {"type": "text", "text": "="}]
    path = _write(tmp_path / "p.parquet", [_row(0, prompt=[{"role": "user", "content": parts}])])
    assert input_problems(load_config(None, [f"data.train_files={path}", *QUIET]), [DATA]) == []
    (task,) = _first(path)
    assert task.prompt == [{"role": "user", "content": "3+5\n="}]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert "<|im_start|>user\n3+5\n=<|im_end|>" in prompt_text(tok, task.prompt)
    tok.chat_template = None  # a base model: the messages' text
    assert prompt_text(tok, task.prompt) == "3+5\n="
