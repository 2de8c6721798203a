"""The launcher's progress and summary lines (pure): the accounting line of a run's
metrics, the restarts read from ``launch.jsonl`` in the live line and the summary table,
a resumed run's summary (this launch only), and what an interrupted launch says it
resumes. Supervision itself is tested in ``tests/test_launch.py``."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

from asyncrl.launch.plots import lag_counts, write_plots
from asyncrl.launch.progress import (
    ProgressView,
    accounting_line,
    accounting_lines,
    eta_s,
    main,
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
    records = [{"step": 2.0, "reward/mean": 0.5, "timing/wait_fraction": 0.9}]
    assert " | restarts 3 | " in view.line(records, restarts)
    assert " | learner wait 90% | " in view.line(records, restarts)
    assert "restarts" not in view.line(records, {"buffer": 0})
    # The learner restarted from its step-2 checkpoint after step 4: step 3 again.
    marker = {"step": 2.0, "learner/resumed_from_step": 2.0, "learner/steps_reached": 4.0}
    replay = [{"step": 1.0}, {"step": 2.0}, marker, {"step": 3.0}]
    assert view.line(replay).startswith(
        "[######..............] 3/10 (again after a restart: 4 reached) | "
    )
    assert "again" not in view.line(records)
    slow = [{"step": 2.0, "rollout/score_wait_fraction": 0.4, "rollout/reward_errors": 7.0}]
    assert " | scorer wait 40% | reward errors 7 | " in view.line(slow)
    assert "scorer" not in view.line([{"step": 2.0, "rollout/score_wait_fraction": 0.01}])
    table = summary_table(records, restarts).splitlines()
    assert "wait" not in "".join(table)  # one step's share: the time split has the run's
    from asyncrl.launch.progress import reward_errors_line

    assert reward_errors_line(records) == []
    assert reward_errors_line([{"rollout/reward_errors": 0.0}, {"step": 3.0}]) == []
    (line,) = reward_errors_line([{"rollout/reward_errors": 382.0}, {"step": 3.0}])
    assert line.startswith("reward errors: 382 samples scored 0.0 because the scorer failed")
    assert [line.split()[:3] for line in table[-3:]] == [
        ["restarts", "buffer", "0"],
        ["restarts", "rollout-0", "2"],
        ["restarts", "learner", "1"],
    ]
    assert read_restarts(tmp_path / "nowhere") == {}


def test_the_progress_command_explains_itself_and_bad_directories(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as asked:
        main(["--help"])
    assert asked.value.code == 0 and "RUN_DIR" in capsys.readouterr().out.upper()
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no run directory" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 1
    assert "no metrics in" in capsys.readouterr().err


def test_plots_name_the_run_show_only_lags_seen_and_a_critic(tmp_path):
    records = [
        {"step": s, "time": float(s), "reward/mean": 0.1 * s, "perf/tokens_per_s": 100.0}
        | {f"lag/hist_{k}": float(k < 2) for k in range(8)}  # lags 0 and 1 only
        | {"critic/vf_loss": 1.0 / s, "critic/vf_explained_var": 0.1 * s}
        for s in range(1, 4)
    ]
    assert lag_counts(records) == {0: 3.0, 1: 3.0}
    (run := tmp_path / "proj" / "exp").mkdir(parents=True)
    (path,) = write_plots(run, records)
    assert path.stat().st_size > 0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(run)]) == 0


def test_the_eta_goes_by_the_pace_of_steps_not_start_up():
    records = [{"step": 0, "time": 0.0}]  # the launch; engines load for 100 s
    records += [{"step": s, "time": 100.0 + 2.0 * s, "timing/step_s": 2.0} for s in (1, 2, 3)]
    assert eta_s(records[:2], 10) != eta_s(records[:2], 10)  # NaN: one step says no pace
    assert eta_s(records, 10) == 14.0  # 7 steps left at 2 s each
    # A critic's warmup steps train no actor and carry no loss/*: their pace counts (a
    # review: the ETA read "-" through trainer.critic_warmup); a validation record does not.
    assert not any("loss/pg" in r for r in records)
    assert eta_s([*records, {"step": 3, "time": 500.0, "val/score": 0.5}], 10) == 14.0


def _records(
    train_s: float, wait_s: float, task_wait_rate: float, pause_rate: float, score_rate=0.0
):
    """Ten steps a second apart, two servers whose waits grow at the given rates."""
    return [
        {
            "time": float(t),
            "timing/step_s": train_s + wait_s,
            "timing/train_s": train_s,
            "timing/wait_batch_s": wait_s,
            "timing/gather_s": 0.01,
            "timing/push_wait_s": 0.0,
            "rollout/task_wait_s": 2 * task_wait_rate * t,
            "rollout/sync_pause_s": 2 * pause_rate * t,
            "rollout/score_wait_s": 2 * score_rate * t,
            "rollout/servers_reporting": 2.0,
        }
        for t in range(10)
    ]


def test_the_time_split_names_the_side_that_holds_the_run_back():
    from asyncrl.launch.time_split import time_split

    learner_bound = time_split(_records(0.9, 0.0, task_wait_rate=0.3, pause_rate=0.05))
    assert learner_bound[0].startswith("learner: training 90%, waiting for batches 0%")
    assert learner_bound[1] == (
        "rollout servers (mean): generating 65%, waiting for tasks 30%, paused for weight syncs 5%"
    )
    assert learner_bound[2].startswith("bottleneck: the learner")
    generation_bound = time_split(_records(0.5, 0.45, task_wait_rate=0.0, pause_rate=0.1))
    assert "waiting for batches 45%" in generation_bound[0]
    assert generation_bound[2].startswith("bottleneck: generation")
    assert time_split(_records(0.5, 0.45, 0.0, 0.1)[:1]) == []  # one step: no window
    # Every training group through the OpenAI endpoint: the servers wait for the agents.
    agents = _records(0.3, 0.6, task_wait_rate=0.8, pause_rate=0.05)
    agents[-1] |= {"accounting/train/dealt": 40.0, "accounting/external/dealt": 40.0}
    split = time_split(agents)
    assert "waiting for the agents' requests 80%" in split[1], split
    assert split[2].startswith("bottleneck: the agents"), split
    # A slow reward function: the engine idles while every response waits for its reward.
    scorer_bound = _records(0.5, 0.45, task_wait_rate=0.0, pause_rate=0.05, score_rate=0.4)
    split = time_split(scorer_bound)
    assert split[1] == (
        "rollout servers (mean): generating 55%, waiting for tasks 0%, "
        "paused for weight syncs 5%, waiting for the scorer 40%"
    )
    assert split[2].startswith("bottleneck: the scorer") and "reward.num_workers" in split[2]


def test_a_server_that_started_over_leaves_its_window_out_of_the_split():
    """Server s1 restarted between two records while s0 ran on: the summed uptime still
    rose (110 -> 205) and no wait went back, so the pair was pooled, and s1's lost counters
    came off s0's waits (12.6% read where s0 waited 20%). Its registration marks it."""
    from asyncrl.launch.time_split import _rollout_split

    def record(uptime: float, task_wait: float, registrations: float) -> dict:
        return {
            "time": uptime,
            "rollout/uptime_s": uptime,
            "rollout/task_wait_s": task_wait,
            "rollout/sync_pause_s": 0.0,
            "rollout/servers_reporting": 2.0,
            "coordinator/registrations": registrations,
        }

    before, after = record(110.0, 19.0, 2.0), record(205.0, 31.0, 3.0)
    assert _rollout_split([before, after]) is None  # no window left to measure
    steady = record(305.0, 51.0, 3.0)  # then 100 server-seconds, 20 of them waiting
    split = _rollout_split([before, after, steady])
    assert split is not None and abs(split["waiting for tasks"] - 0.2) < 1e-9


def test_a_resumed_runs_summary_covers_this_launch_only(tmp_path):
    """A run resumed half an hour after it stopped: the summary's time and the split of
    the learner's time are this launch's (a walkthrough's read "step 1 to end 1852s",
    training 1%, other 98%), while the records keep the whole run's curve."""
    cfg = SimpleNamespace(trainer=SimpleNamespace(total_training_steps=20))
    out = io.StringIO()
    view = ProgressView(tmp_path, cfg, stream=out)
    now = view.launched

    def step(s: int, t: float) -> dict:
        return {"step": s, "time": t, "loss/pg": 0.0, "reward/mean": 0.1 * s}

    step_parts = {"timing/step_s": 2.0, "timing/train_s": 1.5, "timing/wait_batch_s": 0.5}
    earlier = [step(s, now - 1800 - 2.0 * (10 - s)) | step_parts for s in range(1, 11)]
    this = [step(s, now + 30 + 2.0 * (s - 10)) | step_parts for s in range(10, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier + this))
    assert view.line(earlier + this, {}).endswith("ETA 0s")
    view.finish(ok=True)
    text = out.getvalue()
    assert "step 1 to end" in text and " 20s" in text.split("step 1 to end")[1].splitlines()[0]
    assert "learner: training 75%, waiting for batches 25%" in text


def test_an_interrupted_run_says_what_the_same_command_resumes(tmp_path):
    from asyncrl.config import load_config
    from asyncrl.launch.roles import _resume_hint

    cfg = load_config(None, [])
    assert "starts the run over" in _resume_hint(tmp_path, cfg)
    # auto falls back to resume_from_path before the run's first checkpoint (review: the
    # line said the run starts over)
    given = load_config(None, ["trainer.resume_from_path=/ckpt/step_7"])
    assert _resume_hint(tmp_path, given).endswith(
        "starts again from trainer.resume_from_path=/ckpt/step_7"
    )
    for step in (20, 40):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text("{}")
    assert _resume_hint(tmp_path, cfg).endswith("resumes the run from its checkpoint at step 40")
    disabled = load_config(None, ["trainer.resume_mode=disable"])
    assert "does not resume here" in _resume_hint(tmp_path, disabled)
    from asyncrl.config.ending import mark_ended

    mark_ended(tmp_path, 40)  # stopped while its roles wound down after the end
    ended = load_config(None, ["trainer.total_training_steps=40"])
    assert _resume_hint(tmp_path, ended).endswith(
        "ended whole at step 40: the same command starts nothing"
    )
    assert _resume_hint(tmp_path, cfg).endswith("at step 40")  # more steps asked: it trains on


class _LearnerFailsAtOnce:
    """A supervisor whose learner fails before its first step: the view is finished
    with whatever records the run directory holds."""

    def begin(self) -> None: ...
    def start_all(self) -> None: ...
    def close(self) -> None: ...

    def run(self, view) -> int:
        view.finish(ok=False)
        return 1


def _earlier_run(run) -> None:
    earlier = {"step": 7, "time": 1.0, "loss/pg": 0.1, "accounting/train/dealt": 96.0}
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps(earlier) + "\n")


def test_a_new_run_whose_learner_fails_at_once_shows_nothing_of_the_earlier_run(tmp_path, capsys):
    """A review's launch into a used run directory with no checkpoint to resume: the
    learner died before it set the earlier run's records aside, and the launcher showed
    that run's step 7 and accounting as this run's. The launcher sets them aside itself
    when the start begins a new run (as the learner decides), and keeps them on a resume."""
    from asyncrl.config import load_config, run_dir
    from asyncrl.launch.roles import drive

    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path}"])
    run = run_dir(cfg)
    _earlier_run(run)
    assert drive(_LearnerFailsAtOnce(), run, cfg) == 1  # type: ignore[arg-type]
    shown = capsys.readouterr().err
    assert "run FAILED" in shown and "accounting" not in shown and "plot:" not in shown
    assert (run / "metrics.1.jsonl").is_file() and not (run / "metrics.jsonl").exists()

    resumed = tmp_path / "resumed"
    cfg = load_config(None, [f"trainer.default_local_dir={resumed}"])
    run = run_dir(cfg)
    _earlier_run(run)
    (run / "checkpoints" / "step_7").mkdir(parents=True)
    (run / "checkpoints" / "step_7" / "trainer_state.json").write_text("{}")
    assert drive(_LearnerFailsAtOnce(), run, cfg) == 1  # type: ignore[arg-type]
    assert "accounting train: dealt 96" in capsys.readouterr().err


def test_which_starts_begin_a_new_run(tmp_path):
    """The launcher's reading of a start (:func:`new_run`) is the learner's
    (``starts_new_run``, tested through ``learner.restore.restore`` in test_resume_modes)."""
    from asyncrl.config import load_config, run_dir
    from asyncrl.config.ending import new_run

    base = [f"trainer.default_local_dir={tmp_path}"]
    elsewhere = tmp_path / "other" / "step_3"
    assert new_run(load_config(None, base))  # nothing to resume
    assert not new_run(load_config(None, [*base, f"trainer.resume_from_path={elsewhere}"]))
    own = run_dir(load_config(None, base)) / "checkpoints" / "step_5"
    own.mkdir(parents=True)
    (own / "trainer_state.json").write_text("{}")
    assert not new_run(load_config(None, base))  # auto resumes the run's own step 5
    assert new_run(load_config(None, [*base, "trainer.resume_mode=disable"]))
    path_mode = [*base, "trainer.resume_mode=resume_path"]
    assert not new_run(load_config(None, [*path_mode, f"trainer.resume_from_path={own}"]))
    assert new_run(load_config(None, [*path_mode, f"trainer.resume_from_path={elsewhere}"]))


def test_the_live_line_shows_no_server_rates_while_no_server_reports(tmp_path):
    """Records written while every server is down or restarting leave the servers' rates
    out (``rollout/servers_reporting`` 0): the line said the last ones of an older record
    (``gen tok/s 2000 | rollout wait 20%``) with no server generating."""
    cfg = SimpleNamespace(trainer=SimpleNamespace(total_training_steps=10))
    view = ProgressView(tmp_path, cfg, stream=io.StringIO())
    up = {"step": 1.0, "rollout/servers_reporting": 2.0, "rollout/tokens_per_s": 2000.0}
    up |= {"rollout/wait_fraction": 0.2, "rollout/score_wait_fraction": 0.5}
    down = [{"step": s, "rollout/servers_reporting": 0.0} for s in (2.0, 3.0)]
    assert " | gen tok/s 2000 | " in view.line([up]) and "scorer wait 50%" in view.line([up])
    line = view.line([up, *down])
    assert " | gen tok/s - | " in line and " | rollout wait - | " in line, line
    assert "scorer" not in line
    back = {"step": 4.0, "rollout/servers_reporting": 1.0, "rollout/tokens_per_s": 900.0}
    assert " | gen tok/s 900 | " in view.line([up, *down, back])


def test_validation_rounds_read_at_the_weights_they_measured(tmp_path, monkeypatch):
    """Rounds that started at steps 2, 4 and 3 completed together at step 4 (recorded
    there, in that order): the plot put all three at x=4 in completion order, and the
    live line and the summary's end showed step 3's round, not step 4's."""
    from asyncrl.launch import plots

    records = [{"step": 1.0, "time": 1.0, "val/score": 0.1, "val/step": 0.0}]
    records += [{"step": 4.0, "time": 9.0, "val/score": v, "val/step": s} for s, v in VAL_OUT]
    drawn: list[tuple[list, list]] = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.plot

    def plot(self, *args, **kwargs):
        if kwargs.get("label") == "validation score" and self.get_title() == "":
            drawn.append((list(args[0]), list(args[1])))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    plots.write_plots(tmp_path, records)
    assert drawn[0] == ([0, 2, 3, 4], [0.1, 0.4, 0.3, 0.5])
    cfg = SimpleNamespace(trainer=SimpleNamespace(total_training_steps=10))
    assert " | val 0.500 | " in ProgressView(tmp_path, cfg, io.StringIO()).line(records)
    val_row = [r for r in summary_table(records).splitlines() if r.startswith("val ")]
    assert val_row[0].split()[1:] == ["0.100", "0.500"]


VAL_OUT = [(2.0, 0.4), (4.0, 0.5), (3.0, 0.3)]  # (val/step, score) in completion order
