"""``data.filter_overlong_prompts`` on validation rows, as veRL applies it: with the filter
on, a validation prompt over ``data.max_prompt_length`` is left out of the validation set
when the coordinator loads it (veRL's loader leaves it out); with it off, a validation
prompt is cut as ``data.truncation`` says, as a training one is."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.setup import task_source_from_config
from asyncrl.prepare.tokenizer import build_tokenizer, chat_prompt_ids
from asyncrl.tasks import write_rows
from asyncrl.tasks.schema import make_row
from rollout_servers.groups import fit_task_prompt

LONG = "1+1= and so on " * 12  # some 190 characters: over the limit below


def _files(tmp_path: Path, val_prompts: list[str]) -> list[str]:
    train = [
        make_row("arithmetic", f"{i}+1=", str(i + 1), split="train", index=i) for i in range(4)
    ]
    val = [make_row("arithmetic", p, "2", split="test", index=i) for i, p in enumerate(val_prompts)]
    write_rows(train, tmp_path / "train.parquet")
    write_rows(val, tmp_path / "val.parquet")
    return [f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/val.parquet"]


def test_overlong_validation_rows_are_left_out_with_the_filter_on(tmp_path, caplog):
    """They were kept and cut at the left, whatever data.truncation said: validation scored
    prompts that veRL's run, on the same files, never sees."""
    tok_dir = tmp_path / "tok"
    tok = build_tokenizer(tok_dir)  # the tiny model's own tokenizer (asyncrl-prepare model)
    short = [{"role": "user", "content": "1+1="}]
    limit = len(chat_prompt_ids(tok, short)) + 8
    long_ids = chat_prompt_ids(tok, [{"role": "user", "content": LONG}])
    assert len(long_ids) > limit
    files = _files(tmp_path, ["1+1=", LONG, "2+1=", LONG, "3+1="])
    base = [*files, f"model.path={tok_dir}", f"data.max_prompt_length={limit}"]
    on = load_config(None, [*base, "data.filter_overlong_prompts=true", "data.truncation=right"])
    with caplog.at_level(logging.INFO, logger="asyncrl.tasks.lengths"):
        source = task_source_from_config(on)
    source.start_validation()
    dealt = [t.prompt[0]["content"] for t in iter(source.next_val, None)]
    assert dealt == ["1+1=", "2+1=", "3+1="]
    (line,) = [r.getMessage() for r in caplog.records if "validation rows" in r.getMessage()]
    assert line.startswith(
        f"data.filter_overlong_prompts: 2 of 5 validation rows are over "
        f"data.max_prompt_length={limit} tokens and left out"
    )
    # Off: every row is dealt, and a server cuts a long one as data.truncation says.
    off = load_config(None, [*base, "data.truncation=right"])
    assert len(task_source_from_config(off).val_rows) == 5
    assert fit_task_prompt(long_ids, off.data, True) == long_ids[:limit]
    # On, one still long at a server (measured otherwise) is cut as data.truncation says.
    assert fit_task_prompt(long_ids, on.data, True) == long_ids[:limit]
    assert fit_task_prompt(long_ids, on.data, False) is None  # a training one is dropped
    # Every validation row too long: validation would never report.
    only_long = _files(tmp_path, [LONG, LONG])
    every = [*only_long, f"model.path={tok_dir}", f"data.max_prompt_length={limit}"]
    cfg = load_config(None, [*every, "data.filter_overlong_prompts=true"])
    with pytest.raises(ConfigError, match="leaves out every one of the 2 rows of data.val_files"):
        task_source_from_config(cfg)


def test_an_episodes_prompt_is_measured_with_its_tools_as_its_server_renders_it(tmp_path):
    """Found by a review: with multi-turn on, validation rows were measured without the
    tools' schemas, which the server renders into an episode's first prompt (25 tokens
    against 50 here), so a row over the limit was kept and cut at the server, its tools
    line with it."""
    from asyncrl.tools.config import load_tool_config, schemas
    from asyncrl.tools.tokens import render

    tok_dir = tmp_path / "tok"
    tok = build_tokenizer(tok_dir)
    tools = schemas(load_tool_config("configs/tools/calculator.yaml"))
    messages = [{"role": "user", "content": "1+1="}]
    bare, with_tools = len(chat_prompt_ids(tok, messages)), len(render(tok, messages, tools, True))
    assert with_tools > bare
    files = _files(tmp_path, ["1+1=", "2+1="])
    base = [*files, f"model.path={tok_dir}", "data.filter_overlong_prompts=true"]
    multi = [
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml",
    ]
    between = f"data.max_prompt_length={bare + 2}"  # fits bare, not with the tools
    with pytest.raises(ConfigError, match="leaves out every one of the 2 rows"):
        task_source_from_config(load_config(None, [*base, *multi, between]))
    assert len(task_source_from_config(load_config(None, [*base, between])).val_rows) == 2
    enough = f"data.max_prompt_length={with_tools + 2}"
    assert len(task_source_from_config(load_config(None, [*base, *multi, enough])).val_rows) == 2


def test_an_overlong_validation_row_under_truncation_error_is_refused_at_start(tmp_path):
    """Found by a review: with data.truncation=error and the filter off, a validation row
    over the limit was loaded, failed at its server in every round and was given up, so
    every round scored without it and said so only in val/groups_given_up."""
    tok_dir = tmp_path / "tok"
    tok = build_tokenizer(tok_dir)
    limit = len(chat_prompt_ids(tok, [{"role": "user", "content": "1+1="}])) + 8
    files = _files(tmp_path, ["1+1=", LONG, "2+1="])
    base = [*files, f"model.path={tok_dir}", f"data.max_prompt_length={limit}"]
    with pytest.raises(ConfigError, match=r"data.truncation=error: 1 of the 3 rows .*row 1\)"):
        task_source_from_config(load_config(None, [*base, "data.truncation=error"]))
    # Cut, or left out by the filter, or no validation at all: the run starts.
    assert len(task_source_from_config(load_config(None, base)).val_rows) == 3
    on = [*base, "data.truncation=error", "data.filter_overlong_prompts=true"]
    assert len(task_source_from_config(load_config(None, on)).val_rows) == 2
    off = [*base, "data.truncation=error", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    assert task_source_from_config(load_config(None, off)).val_rows == []
    # Within the limit, an error mode loads every row.
    fits = _files(tmp_path, ["1+1=", "2+1="])
    ok = [
        *fits,
        f"model.path={tok_dir}",
        f"data.max_prompt_length={limit}",
        "data.truncation=error",
    ]
    assert len(task_source_from_config(load_config(None, ok)).val_rows) == 2
