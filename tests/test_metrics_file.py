"""The JSONL metrics sink: a resumed run appends, a new run in an old directory starts a
file of its own and keeps the old records beside it."""

import json

from asyncrl.metrics import METRICS_FILE, MetricsLogger, read_metrics


def _write(run, step: int, fresh: bool) -> None:
    logger = MetricsLogger(run, ["jsonl"], fresh=fresh)
    # Not numbers a record holds, dropped: text, bytes, and an int too large for a float
    # (its float() raised OverflowError, and the whole record with it).
    odd = {"note": "dropped: not a number", "raw": b"1.5", "huge": 10**400}
    logger.log(step, {"loss/pg": float(step), **odd})
    logger.close()


def test_resumed_run_appends_and_new_run_sets_old_records_aside(tmp_path):
    run = tmp_path / "run"
    _write(run, 1, fresh=True)  # nothing to set aside yet
    _write(run, 2, fresh=False)  # a resumed run continues the same file
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert not {"note", "raw", "huge"} & set(read_metrics(run)[0])
    _write(run, 1, fresh=True)  # a new run: the old records move to metrics.1.jsonl
    _write(run, 1, fresh=True)  # and the next new run's to metrics.2.jsonl
    assert [r["step"] for r in read_metrics(run)] == [1]
    old = sorted(p.name for p in run.iterdir() if p.name != METRICS_FILE)
    assert old == ["metrics.1.jsonl", "metrics.2.jsonl"]
    assert len((run / "metrics.1.jsonl").read_text().splitlines()) == 2
    assert len((run / "metrics.2.jsonl").read_text().splitlines()) == 1


def test_steps_lost_with_a_learner_are_replaced_by_the_steps_trained_again(tmp_path):
    """Steps 1-4 logged, the checkpoint at step 2: the resumed learner trains 3 and 4 again.
    The file keeps both copies (a walkthrough found step 66 twice, 0.758 then 0.711, with
    nothing saying which counts); the readers (live line, summary, plots) see the new ones
    only, after a record of the resume."""
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        _write(run, step, fresh=step == 1)
    logger = MetricsLogger(run, ["jsonl"], fresh=False)
    logger.mark_resumed(2)
    logger.log(3, {"loss/pg": 30.0})
    logger.close()
    records = read_metrics(run)
    assert [(r["step"], r.get("loss/pg")) for r in records] == [
        (1, 1.0),
        (2, 2.0),
        (2, None),
        (3, 30.0),
    ]
    assert records[2]["learner/steps_reached"] == 4
    assert len((run / METRICS_FILE).read_text().splitlines()) == 6  # nothing deleted
    again = MetricsLogger(run, ["jsonl"], fresh=False)
    again.mark_resumed(3)  # nothing past step 3 in the records: no marker
    again.close()
    assert len((run / METRICS_FILE).read_text().splitlines()) == 6


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    """W&B offline (no network): a restart of the learner continues its W&B run (the id is
    kept in the run directory); a new run in the directory gets a run of its own."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"

    def run_id(fresh: bool) -> str:
        logger = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=fresh)
        assert logger._wandb is not None
        rid = logger._wandb.id
        logger.log(1, {"loss/pg": 1.0})
        logger.close()
        # veRL's logger list without jsonl: the run's record is written all the same (the
        # launcher's live line, summary and plots read it).
        assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["loss/pg"] == 1
        return rid

    first = run_id(fresh=True)
    assert run_id(fresh=False) == first
    assert run_id(fresh=True) != first


def test_a_resume_that_trains_steps_again_says_wandb_charts_them_twice(
    tmp_path, monkeypatch, caplog
):
    """After a resume from step 1 of a learner that had logged step 3, W&B holds the lost
    steps 2-3 and the ones trained again (its steps only go up), and the learner says so
    once."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    logger = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=True)
    for step in (1, 2, 3):
        logger.log(step, {"loss/pg": float(step)})
    logger.close()
    logger = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=False)
    with caplog.at_level("WARNING", logger="asyncrl.metrics"):
        logger.mark_resumed(1)
        logger.mark_resumed(3)  # nothing to say: no step goes back
    logger.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.metrics"]
    assert lines == [
        "W&B charts steps 2-3 twice (at their train/step): as the learner lost with its "
        "checkpoint logged them, and as they are trained again; this run's metrics.jsonl "
        "keeps only the steps trained again"
    ]


class _ResumedWandbRun:
    """What the logger uses of a W&B run resumed online, whose next step is 10 (records
    moved ahead by piled-up rounds, or a learner that logged past its checkpoint)."""

    starting_step, resumed, id = 10, True, "r"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def define_metric(self, *args, **kwargs) -> None:
        pass

    def log(self, row: dict, step: int) -> None:
        assert not self.steps or step >= self.steps[-1], "W&B drops a step that goes back"
        self.steps.append(step)

    def finish(self) -> None:
        pass


def test_a_resumed_wandb_run_goes_on_from_its_next_step(tmp_path, monkeypatch):
    """Found by a review: the logger started its W&B steps over at every start, so a
    resumed run whose W&B steps were ahead of the learner's dropped the learner's first
    records after the resume, without a word."""
    import wandb

    fake = _ResumedWandbRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: fake)
    logger = MetricsLogger(tmp_path / "run", ["wandb"], project="p", experiment="e")
    for step in (6, 7, 12):
        logger.log(step, {"loss/pg": float(step)})
    logger.close()
    assert fake.steps == [10, 11, 12]  # steps 6 and 7 at W&B steps 10 and 11, never below


def test_a_half_written_last_record_is_cut_before_the_resume_appends(tmp_path):
    """Found by a review: a learner that died mid-line left a record without its newline;
    the resume's marker, appended, joined it into one line no reader parses, and the lost
    steps' records showed beside the ones trained again."""
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        _write(run, step, fresh=step == 1)
    with open(run / METRICS_FILE, "a") as f:
        f.write('{"step": 5, "time": 1.0, "loss/p')
    logger = MetricsLogger(run, ["jsonl"], fresh=False)
    logger.mark_resumed(2)
    logger.log(3, {"loss/pg": 30.0})
    logger.close()
    assert [(r["step"], r.get("loss/pg")) for r in read_metrics(run)] == [
        (1, 1.0),
        (2, 2.0),
        (2, None),
        (3, 30.0),
    ]


def test_wandbs_files_go_where_wandb_dir_says(tmp_path, monkeypatch):
    """WANDB_DIR set: W&B's files go there (the run directory was passed over it); unset,
    they go to the run directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    elsewhere = tmp_path / "wandb_files"
    elsewhere.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    logger = MetricsLogger(tmp_path / "run", ["wandb"], project="p", experiment="e", fresh=True)
    logger.log(1, {"loss/pg": 1.0})
    logger.close()
    assert list((elsewhere / "wandb").glob("offline-run-*"))
    assert not (tmp_path / "run" / "wandb").exists()
    monkeypatch.delenv("WANDB_DIR")
    logger = MetricsLogger(tmp_path / "run2", ["wandb"], project="p", experiment="e", fresh=True)
    logger.close()
    assert list((tmp_path / "run2" / "wandb").glob("offline-run-*"))


def test_the_metrics_doc_check_reads_families_and_continuations(tmp_path):
    """The check the e2e run makes: documented names match by their placeholders and the
    table's shorthand (``/std``, ``.../consumed``, ``_max``); anything else is reported."""
    from tests.e2e_helpers import undocumented_metrics

    records = [
        {
            "step": 1,
            "reward/std": 0.1,
            "coordinator/budget/consumed": 3.0,
            "importance/log_w_abs_max": 0.2,
            "buffer/drops/overflow": 1.0,
            "val/arithmetic/score": 0.5,
            "made/up_metric": 1.0,
            "health/w_mean/deeper": 1.0,  # a placeholder is one name part
        }
    ]
    assert undocumented_metrics(records) == ["health/w_mean/deeper", "made/up_metric"]


def test_a_new_run_keeps_the_earlier_runs_wandb_id_beside_its_records(tmp_path):
    """A new run in a directory holding an earlier one opens a new W&B run; the earlier
    run's id is set aside with its records (metrics.<k>.jsonl), not overwritten."""
    from asyncrl.metrics import WANDB_ID_FILE, _wandb_id

    (tmp_path / WANDB_ID_FILE).write_text("oldrun01\n")
    assert _wandb_id(tmp_path, fresh=False) == "oldrun01"  # a resume logs into it again
    new = _wandb_id(tmp_path, fresh=True)
    assert new != "oldrun01" and (tmp_path / WANDB_ID_FILE).read_text().strip() == new
    assert (tmp_path / f"{WANDB_ID_FILE}.1").read_text().strip() == "oldrun01"


def _wandb_history(run_dir) -> list[dict[str, float]]:
    """The history rows an offline W&B run wrote to its ``run-*.wandb`` file (``run_dir``:
    the run directory holding one, or that offline run's own folder), once they
    are all there: W&B's service process writes the file, and its ``finish()`` may return
    before the last records are (an earlier run in the same process made that likely, and
    the read found no row at all). Read again until the file has stopped growing for half
    a second, within 20 s."""
    import time

    (path,) = list(run_dir.glob("run-*.wandb")) or run_dir.glob("wandb/offline-run-*/run-*.wandb")
    size, since, deadline = -1, time.monotonic(), time.monotonic() + 20
    while time.monotonic() < deadline:
        if path.stat().st_size != size:
            size, since = path.stat().st_size, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            break
        time.sleep(0.05)
    return _history_rows(path.read_bytes())


def _history_rows(data: bytes) -> list[dict[str, float]]:
    """The history rows of a ``run-*.wandb`` file's bytes: W&B's own record (a
    LevelDB-style log of 32 KiB blocks holding protobuf records), read back."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    pos, pending, rows = 7, b"", []  # 7: the file's own header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):  # a first or middle piece: the record goes on
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            rows.append(row)
    return rows


def test_wandb_keeps_both_records_of_one_step_that_share_a_key(tmp_path, monkeypatch):
    """W&B keeps one value per key and step: two validation rounds completing at step 2
    (one started at step 1, one at 2) lost the first round's score there. The second goes
    to the next W&B step; a record of other keys still joins its own step's row."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    logger = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=True)
    logger.log(1, {"loss/pg": 1.0})
    logger.log(2, {"loss/pg": 2.0})
    logger.log(2, {"val/score": 0.25, "val/step": 1.0})
    logger.log(2, {"val/score": 0.5, "val/step": 2.0})
    logger.log(3, {"loss/pg": 3.0})
    logger.close()
    rows = [
        {k: v for k, v in r.items() if k in ("_step", "loss/pg", "val/score", "val/step")}
        for r in _wandb_history(run)
    ]
    assert rows == [
        {"_step": 1, "loss/pg": 1.0},
        {"_step": 2, "loss/pg": 2.0, "val/score": 0.25, "val/step": 1.0},
        {"_step": 3, "val/score": 0.5, "val/step": 2.0, "loss/pg": 3.0},
    ]
    # metrics.jsonl keeps each record at its learner step
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 2, 2, 3]


def test_an_offline_wandb_run_resumed_goes_on_past_its_last_step(tmp_path, monkeypatch):
    """Found by a review: offline, W&B gives a resumed run no ``starting_step`` (0), so
    the resumed learner logged its steps trained again below the steps the W&B run already
    held, and ``wandb sync`` dropped them. The last W&B step is kept beside the run's id."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    first = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=True)
    for step in (1, 2, 3):
        first.log(step, {"loss/pg": float(step)})
    first.close()
    again = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=False)
    again.mark_resumed(1)
    again.log(2, {"loss/pg": 20.0})
    again.close()
    second = max(run.glob("wandb/offline-run-*"), key=lambda p: p.stat().st_mtime)
    rows = [r for r in _wandb_history(second) if "loss/pg" in r]
    assert [(r["_step"], r["loss/pg"], r["train/step"]) for r in rows] == [(4, 20.0, 2.0)]
    # A learner that resumes after one that logged a single row goes on past that row (its
    # first, which the step file did not hold: the next learner logged W&B step 4 again).
    third = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=False)
    assert third._wandb_step == 5
    third.close()
    # A fresh run in the same directory starts its own W&B run at its own steps.
    fresh = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=True)
    assert fresh._wandb_step == -1
    fresh.close()


def test_wandb_charts_each_record_at_its_learner_step_after_rounds_pile_up(tmp_path, monkeypatch):
    """A review: three validation rounds read at one step took W&B steps 4, 5 and 6, and
    W&B's steps only go up, so step 5's training record went to W&B step 6, and every one
    after it a step late. Every row now carries its learner step (``train/step``) and
    every namespace is charted against it."""
    from wandb.proto import wandb_internal_pb2 as pb  # noqa: F401 (W&B is installed)

    from asyncrl.metrics import WANDB_AXIS

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    logger = MetricsLogger(run, ["wandb"], project="p", experiment="e", fresh=True)
    logger.log(4, {"loss/pg": 4.0})
    for started in (2, 4, 3):
        logger.log(4, {"val/score": 0.1 * started, "val/step": float(started)})
    for step in (5, 6, 7):
        logger.log(step, {"loss/pg": float(step), "timing/step_s": 0.1})
    logger.close()
    rows = _wandb_history(run)
    trained = [(r["loss/pg"], r[WANDB_AXIS]) for r in rows if "loss/pg" in r]
    assert trained == [(4.0, 4.0), (5.0, 5.0), (6.0, 6.0), (7.0, 7.0)]
    assert [r["val/step"] for r in rows if "val/score" in r] == [2.0, 4.0, 3.0]
    # Each namespace is charted against that step: W&B's file holds its metric records.
    (path,) = run.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert all(glob in data for glob in (b"loss/*", b"timing/*", WANDB_AXIS.encode()))


def test_the_live_reader_parses_only_what_was_appended_and_reads_as_the_whole_file(
    tmp_path, monkeypatch
):
    """Found by a review: the launcher's live line read and parsed the whole metrics file
    every second, which cost it a core by a few thousand steps. :class:`MetricsTail`
    parses only the lines appended since, and reads as :func:`read_metrics` does: across
    a resume's marker, a torn last line, and a new run's file in the old one's place."""
    from asyncrl import metrics

    run = tmp_path / "run"
    tail = metrics.MetricsTail(run)
    assert tail.read() == []  # no file yet
    for step in (1, 2, 3):
        _write(run, step, fresh=step == 1)
    assert tail.read() == read_metrics(run)
    parsed = []
    real = json.loads

    def loads(line):  # the reader's lines are bytes (the logger reads the file as text)
        if isinstance(line, bytes):
            parsed.append(line)
        return real(line)

    monkeypatch.setattr(metrics.json, "loads", loads)
    logger = MetricsLogger(run, ["jsonl"], fresh=False)
    logger.mark_resumed(1)  # steps 2 and 3 are trained again
    logger.log(2, {"loss/pg": 20.0})
    logger.close()
    with (run / METRICS_FILE).open("a") as f:
        f.write('{"step": 3, "loss')  # a record being written
    assert [r["step"] for r in tail.read()] == [1, 1, 2] and len(parsed) == 2  # the new lines
    assert tail.read() == read_metrics(run) and len(parsed) == 2  # nothing new: none parsed
    with (run / METRICS_FILE).open("a") as f:
        f.write('/pg": 30.0}\n')
    assert tail.read()[-1] == {"step": 3, "loss/pg": 30.0} and len(parsed) == 3
    _write(run, 7, fresh=True)  # a new run: the file is set aside and started again
    assert [r["step"] for r in tail.read()] == [7] and tail.read() == read_metrics(run)


def test_a_round_reported_after_the_checkpoint_is_read_once_after_a_resume(tmp_path):
    """Found by a review: a validation round read after step 2's checkpoint (while the
    learner waited for its next batch) was logged at step 2; the learner died, and the
    resumed one, whose checkpoint did not hold the round as reported, reported it again:
    two records of one round in the plots and summaries. The resume's record now names
    when its checkpoint's state was taken, and what the lost learner wrote after it goes."""
    import time

    run = tmp_path / "run"
    for step in (1, 2):
        _write(run, step, fresh=step == 1)
    saved_at = time.time()  # step 2's checkpoint
    time.sleep(0.01)
    logger = MetricsLogger(run, ["jsonl"], fresh=False)
    logger.log(2, {"val/score": 0.5, "val/step": 2.0})  # then the learner dies
    logger.close()
    again = MetricsLogger(run, ["jsonl"], fresh=False)
    again.mark_resumed(2, saved_at)  # no later step: the round alone made the mark
    again.log(2, {"val/score": 0.5, "val/step": 2.0})  # reported again
    again.close()
    records = read_metrics(run)
    assert [r["val/score"] for r in records if "val/score" in r] == [0.5]
    assert [r["step"] for r in records if "loss/pg" in r] == [1, 2]
    # Without a saved time (a checkpoint from before it was kept), steps alone decide.
    quiet = MetricsLogger(run, ["jsonl"], fresh=False)
    quiet.mark_resumed(2)
    quiet.close()
    assert read_metrics(run) == records


def test_a_run_extended_past_its_end_keeps_its_final_rounds_record(tmp_path):
    """Found by a review: a run ended whole at step 2 (its checkpoint saved, then its final
    validation round and accounting logged) and extended with a larger total: the resume
    record dropped every record written after the checkpoint, the final round's among
    them, though nothing writes it again. A run that died after its checkpoint still
    drops what it wrote after it."""
    import time

    from asyncrl.config.ending import mark_ended
    from learner.control_peer import Restored

    run = tmp_path / "run"
    for step in (1, 2):
        _write(run, step, fresh=step == 1)
    saved = Restored(run / "ckpt", None, None, step=2, saved_at=time.time())
    time.sleep(0.01)
    logger = MetricsLogger(run, ["jsonl"], fresh=False)
    logger.log(2, {"val/score": 0.75})  # the final round, after the checkpoint
    logger.close()
    lost = saved.records_lost_after(run)  # not ended: the round was lost with the learner
    assert lost == saved.saved_at
    mark_ended(run, 2)
    assert saved.records_lost_after(run) is None
    extended = MetricsLogger(run, ["jsonl"], fresh=False)
    extended.mark_resumed(2, saved.records_lost_after(run))
    extended.close()
    assert [r.get("val/score") for r in read_metrics(run)] == [None, None, 0.75]
    dying = MetricsLogger(run, ["jsonl"], fresh=False)  # as before the run had ended
    dying.mark_resumed(2, lost)
    dying.close()
    assert [r.get("val/score") for r in read_metrics(run)][-1] is None
    assert 0.75 not in [r.get("val/score") for r in read_metrics(run)]
