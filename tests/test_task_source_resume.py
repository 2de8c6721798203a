"""A resumed cursor goes on under the config it is given, as veRL's resume does: only other
training rows or another training order is refused, and a validation set or schedule that
changed only while a round of the saved one is still under way (its ids name old rows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.admission import Budget
from asyncrl.control.ledger import TaskLedger
from asyncrl.control.ledger_checkpoint import load_ledger, save_ledger
from asyncrl.control.setup import state_from_config
from asyncrl.control.task_source import TaskSource, load_rows
from asyncrl.control.validation_schedule import ValidationSchedule
from asyncrl.tasks.schema import make_row
from asyncrl.wire.requests import ValidationGroup
from learner.validation import ValidationTracker


def _rows(n: int, split: str = "train") -> list[dict]:
    return [make_row("arithmetic", f"{i}+1=", str(i + 1), split=split, index=i) for i in range(n)]


def _source(n_val: int, **kw) -> TaskSource:
    return TaskSource(_rows(6), _rows(n_val, "test"), seed=2, lineage="", **kw)


def _dealt_round(n_val: int = 2) -> TaskSource:
    """A cursor past 3 training tasks and one validation round, fully dealt."""
    source = _source(n_val)
    for _ in range(3):
        source.next_train()
    source.start_validation()
    while source.next_val() is not None:
        pass
    return source


@pytest.mark.parametrize("n_val", [0, 1, 5])  # switched off; shrunk; grown
def test_validation_changes_resume_when_no_round_is_under_way(n_val: int) -> None:
    saved = _dealt_round().state_dict()
    fresh = _source(n_val)
    fresh.load_state_dict(saved)  # refused before: "data.val_files now holds 0"
    assert (fresh.epoch, fresh.position) == (0, 3)
    assert fresh.next_val() is None  # the finished round is not dealt again
    # Rounds go on after the saved ones (the learner reported round 0 already), over
    # this run's rows; the old round's ids name no task here.
    assert fresh.start_validation() == 1
    dealt = [t.task_id for t in iter(fresh.next_val, None)]
    assert dealt == [f"val/1/{r}" for r in range(n_val)]
    with pytest.raises(KeyError):
        fresh.task_for_id("val/0/0")
    again = _source(n_val)  # and so after one more checkpoint
    again.load_state_dict(fresh.state_dict())
    with pytest.raises(KeyError):
        again.task_for_id("val/0/0")


def test_a_round_being_dealt_over_other_rows_is_refused_in_one_line() -> None:
    source = _source(2)
    source.start_validation()
    source.next_val()  # round 0 half dealt
    with pytest.raises(ConfigError) as refused:
        _source(0).load_state_dict(source.state_dict())
    (line,) = refused.value.problems
    assert "round 0 is being dealt" in line and "validation is off" in line
    assert "trainer.resume_mode=disable" in line and "now holds 0" not in line
    same = _source(2)  # the same set: the round goes on where it was
    same.load_state_dict(source.state_dict())
    task = same.next_val()
    assert task is not None and task.task_id == "val/0/1"


def test_a_validation_set_swapped_for_another_of_its_size_counts_as_changed() -> None:
    """Same row count, other rows: a round under way is refused as for another size, and
    with none under way the saved round's ids name no task of the new set."""
    other = [make_row("arithmetic", f"{i}+2=", str(i + 2), split="test", index=i) for i in range(2)]
    source = _source(2)
    source.start_validation()
    source.next_val()  # round 0 half dealt
    with pytest.raises(ConfigError) as refused:
        TaskSource(_rows(6), other, seed=2, lineage="").load_state_dict(source.state_dict())
    (line,) = refused.value.problems
    assert "over 2 rows; data.val_files now holds 2 other," in line
    fresh = TaskSource(_rows(6), other, seed=2, lineage="")
    fresh.load_state_dict(_dealt_round().state_dict())
    with pytest.raises(KeyError):
        fresh.task_for_id("val/0/0")
    same = _source(2)  # the same rows: the saved round's ids still name them
    same.load_state_dict(_dealt_round().state_dict())
    assert same.task_for_id("val/0/1").prompt == _rows(2, "test")[1]["prompt"]


def test_a_round_over_the_replaced_set_completes_at_its_own_size() -> None:
    """Found by a review: a round of the saved set, scored but not yet read by the learner
    at the checkpoint, was awaited at the new set's size after a resume that changed it
    (the run's end then waited launch.start_timeout_s for it); and its groups lost with a
    buffer could not be dealt again over the new rows. Now the round completes at its own
    size, and lost groups are given up and named."""
    cfg = load_config(None, ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2"])
    old = state_from_config(cfg, _rows(6), _rows(2, "test"))
    old.start_validation(0)
    tasks, _ = old.ledger.deal("a", 2)
    ids = [t.task_id for t in tasks]
    assert all(t.validation for t in tasks)
    old.ledger.trained(ids)  # scored: the learner has read neither sum yet
    other = [make_row("arithmetic", f"{i}+2=", str(i + 2), split="test", index=i) for i in range(3)]
    new = state_from_config(cfg, _rows(6), other)
    new.load_state_dict(old.state_dict())
    progress = new.validation_progress()
    key = progress.round_key(0)
    assert progress.groups_in(key) == 2 and progress.round_groups == 3
    assert new.round_states([key]) == {key: {ids[0]: "done", ids[1]: "done"}}
    tracker = ValidationTracker()
    group = ValidationGroup("arithmetic", 4, 2.0, 2.0, 12)
    assert tracker.add({key: {ids[0]: group}}, progress) == []  # 1 of its 2
    assert new.rescore([ids[1]]) == 0  # lost with a buffer: not dealt over the new rows
    given_up = [t for t, st in new.round_states([key])[key].items() if st == "given_up"]
    assert given_up == [ids[1]]
    (report,) = tracker.add({}, progress, {key: given_up})
    assert report["val/groups_given_up"] == 1.0 and report["val/responses"] == 4.0
    assert new.metrics()["coordinator/tasks/val_lost_other_set"] == 1.0


def test_each_replaced_set_keeps_its_own_round_size_over_several_resumes() -> None:
    """Found by a review: one (rounds, rows) pair was kept, so a second resume that changed
    the set again overwrote the first's, and a round of the first set still pending was
    awaited at the second set's size (never completing)."""
    first = _dealt_round(2)  # round 0 over 2 rows
    second = _source(3)
    second.load_state_dict(first.state_dict())
    assert second.start_validation() == 1
    while second.next_val() is not None:  # round 1 over 3 rows
        pass
    third = _source(4)
    third.load_state_dict(second.state_dict())
    assert third.other_val == ((1, 2), (2, 3))
    progress = ValidationSchedule(third).progress()
    assert [progress.groups_in(f"val/{k}") for k in (0, 1, 2)] == [2, 3, 4]
    with pytest.raises(KeyError):
        third.task_for_id("val/1/0")
    legacy = {**second.state_dict(), "other_val": [1, 2]}  # saved before pairs were kept
    again = _source(3)
    again.load_state_dict(legacy)
    assert again.other_val == ((1, 2),)


def _ledger(n_val: int) -> TaskLedger:
    return TaskLedger(_source(n_val), Budget(4, 4))


def test_validation_tasks_outstanding_over_other_rows_are_refused() -> None:
    ledger = _ledger(2)
    ledger.source.start_validation()
    tasks, _ = ledger.deal("a", 2)  # the whole round, out at a server
    assert [t.task_id for t in tasks] == ["val/0/0", "val/0/1"]
    saved = save_ledger(ledger)
    with pytest.raises(ConfigError) as refused:
        load_ledger(_ledger(0), saved)
    (line,) = refused.value.problems
    assert "task val/0/0 is outstanding" in line and "val/ record is logged" in line
    load_ledger(_ledger(2), saved)  # the same set: the round is carried over
    ledger.trained([t.task_id for t in tasks])  # scored: nothing of it outstanding
    resumed = _ledger(0)
    load_ledger(resumed, save_ledger(ledger))
    assert resumed.deal("a", 1)[0][0].task_id.startswith("train/")


def test_config_resume_with_validation_switched_off_or_on() -> None:
    """The reviewer's case: nothing dealt, validation then switched off or on."""
    base = ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2"]
    off = ["trainer.test_freq=-1", "trainer.val_before_train=false"]
    rows, val = _rows(6), _rows(3, "test")
    on_state = state_from_config(load_config(None, base), rows, val).state_dict()
    state_from_config(load_config(None, base + off), rows, []).load_state_dict(on_state)
    off_state = state_from_config(load_config(None, base + off), rows, []).state_dict()
    state_from_config(load_config(None, base), rows, val).load_state_dict(off_state)


def test_unshuffled_resume_does_not_compare_the_seed() -> None:
    saved = _source(1, shuffle=False).state_dict()
    TaskSource(_rows(6), _rows(1), seed=7, shuffle=False, lineage="").load_state_dict(saved)
    shuffled = _source(1).state_dict()
    with pytest.raises(ConfigError, match="seed 2, shuffle True; this run has 6, 7, True"):
        TaskSource(_rows(6), _rows(1), seed=7, lineage="").load_state_dict(shuffled)


def _write_train(path: Path, tags: list[str]) -> str:
    rows = [
        make_row("arithmetic", f"{t}+1=", f"{t}1", split="train", index=i)
        for i, t in enumerate(tags)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_training_rows_edited_in_place_go_on_with_a_warning(tmp_path: Path, caplog) -> None:
    """A cursor restored over other training rows of the same count (or the same rows in
    another order) goes on from its position, as veRL's resume does, but no longer without
    a word: its ids name rows by index, so the tasks in flight are rebuilt from the rows
    now there. The rows' digest is saved and compared, the same in another process (no
    salted ``hash()``); a checkpoint without it, or over the same rows, says nothing."""
    first = _write_train(tmp_path / "a.parquet", ["1", "2", "3", "4"])
    source = TaskSource(load_rows([first]), seed=2, lineage="")
    in_flight = [source.next_train().task_id for _ in range(2)]  # type: ignore[union-attr]
    saved = source.state_dict()
    older = {k: v for k, v in saved.items() if k != "train_digest"}
    for name, tags in (
        ("other.parquet", ["5", "6", "7", "8"]),
        ("order.parquet", ["4", "3", "2", "1"]),
    ):
        swapped = TaskSource(load_rows([_write_train(tmp_path / name, tags)]), seed=2)
        caplog.clear()
        with caplog.at_level("WARNING", logger="asyncrl.control.task_source"):
            swapped.load_state_dict(saved)
            assert swapped.position == source.position
            (line,) = [r.getMessage() for r in caplog.records]
            assert line.startswith("data.train_files changed since the checkpoint (the same 4")
            caplog.clear()
            swapped.load_state_dict(older)  # saved before the digest was: taken as unchanged
            assert not caplog.records
    again = TaskSource(load_rows([first]), seed=2)
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncrl.control.task_source"):
        again.load_state_dict(saved)
    assert not caplog.records
    assert [again.task_for_id(t).prompt for t in in_flight] == [
        source.task_for_id(t).prompt for t in in_flight
    ]
    code = (
        "from asyncrl.control.task_source import TaskSource, load_rows; "
        f"print(TaskSource(load_rows([{first!r}])).state_dict()['train_digest'])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    other_process = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    )
    assert other_process.stdout.strip() == saved["train_digest"]
