"""The JSONL metrics sink: a resumed run appends, a new run in an old directory starts a
file of its own and keeps the old records beside it."""

from asyncrl.metrics import METRICS_FILE, MetricsLogger, read_metrics


def _write(run, step: int, fresh: bool) -> None:
    logger = MetricsLogger(run, ["jsonl"], fresh=fresh)
    logger.log(step, {"loss/pg": float(step), "note": "dropped: not a number"})
    logger.close()


def test_resumed_run_appends_and_new_run_sets_old_records_aside(tmp_path):
    run = tmp_path / "run"
    _write(run, 1, fresh=True)  # nothing to set aside yet
    _write(run, 2, fresh=False)  # a resumed run continues the same file
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert "note" not in read_metrics(run)[0]
    _write(run, 1, fresh=True)  # a new run: the old records move to metrics.1.jsonl
    _write(run, 1, fresh=True)  # and the next new run's to metrics.2.jsonl
    assert [r["step"] for r in read_metrics(run)] == [1]
    old = sorted(p.name for p in run.iterdir() if p.name != METRICS_FILE)
    assert old == ["metrics.1.jsonl", "metrics.2.jsonl"]
    assert len((run / "metrics.1.jsonl").read_text().splitlines()) == 2
    assert len((run / "metrics.2.jsonl").read_text().splitlines()) == 1
