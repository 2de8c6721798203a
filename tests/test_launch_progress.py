"""The launcher's progress and summary lines (pure): the accounting line of a run's
metrics, and the restarts read from ``launch.jsonl`` in the live line and the summary
table. Supervision itself is tested in ``tests/test_launch.py``."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

from asyncrl.launch.progress import (
    ProgressView,
    accounting_line,
    accounting_lines,
    read_restarts,
    summary_table,
)


def test_accounting_line_names_every_part():
    metrics = {
        "accounting/train/dealt": 960.0,
        "accounting/train/in_flight": 0.0,
        "accounting/train/in_buffer": 12.0,
        "accounting/train/trained": 940.0,
        "accounting/train/dropped/lag": 8.0,
        "accounting/train/dropped/expired": 0.0,
        "accounting/train/given_up": 0.0,
        "accounting/train/unaccounted": 0.0,
        "accounting/val/dealt": 40.0,
        "accounting/val/in_flight": 2.0,
        "accounting/val/in_buffer": 0.0,
        "accounting/val/scored": 36.0,
        "accounting/val/dropped/lag": 0.0,
        "accounting/val/given_up": 0.0,
        "accounting/val/unaccounted": 2.0,
    }
    assert accounting_line(metrics) == (
        "accounting train: dealt 960 = in flight 0 + in buffer 12 + trained 940 + "
        "dropped 8 (lag 8) + given up 0"
    )
    assert accounting_line(metrics, "val") == (
        "accounting val: dealt 40 = in flight 2 + in buffer 0 + scored 36 + dropped 0 + "
        "given up 0; unaccounted 2"
    )
    assert accounting_line({"step": 3.0}) is None
    # From the last record that has the keys; nothing for a run without them.
    records = [{"step": 1.0, **metrics}, {"step": 2.0, "loss/pg": 0.1}]
    assert accounting_lines(records)[0].startswith("accounting train: dealt 960 ")
    assert accounting_lines([{"step": 1.0}]) == []


def test_restarts_in_the_live_line_and_the_summary(tmp_path):
    events = [
        {"role": "launcher", "event": "launch"},
        {"role": "rollout-0", "event": "start"},
        {"role": "rollout-0", "event": "restart", "launch/restarts/rollout-0": 1},
        {"role": "launcher", "event": "launch"},  # a new launch in the same directory
        {"role": "buffer", "event": "start"},
        {"role": "rollout-0", "event": "start"},
        {"role": "rollout-0", "event": "restart", "launch/restarts/rollout-0": 1},
        {"role": "rollout-0", "event": "restart", "launch/restarts/rollout-0": 2},
        {"role": "learner", "event": "start"},
        {"role": "learner", "event": "restart", "launch/restarts/learner": 1},
    ]
    (tmp_path / "launch.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + "{")
    restarts = read_restarts(tmp_path)
    assert restarts == {"buffer": 0, "rollout-0": 2, "learner": 1}
    cfg = SimpleNamespace(trainer=SimpleNamespace(total_training_steps=10))
    view = ProgressView(tmp_path, cfg, stream=io.StringIO())
    records = [{"step": 2.0, "reward/mean": 0.5}]
    assert " | restarts 3 | " in view.line(records, restarts)
    assert "restarts" not in view.line(records, {"buffer": 0})
    table = summary_table(records, restarts).splitlines()
    assert [line.split()[:3] for line in table[-3:]] == [
        ["restarts", "buffer", "0"],
        ["restarts", "rollout-0", "2"],
        ["restarts", "learner", "1"],
    ]
    assert read_restarts(tmp_path / "nowhere") == {}
