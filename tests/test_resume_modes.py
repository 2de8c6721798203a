"""What a learner start resumes from, by ``trainer.resume_mode``, when a launcher restarts it
with ``resume_mode=auto``: the checkpoints ``auto`` finds must be this run's. A start that
does not resume from the run directory's checkpoints moves them aside (an earlier run's
step 60 must not be picked over this run's step 20), and ``auto`` before this run's first
checkpoint falls back to ``resume_from_path`` (not the base model). A rewind to an earlier
step of the run moves the later steps out of ``auto``'s reach; a resume path that is no
checkpoint fails before anything moves; a new run here starts its metrics afresh.

The decision is :func:`learner.restore.restore` on a real run directory; the trainer is a
stand-in that records what it was asked to load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.metrics import METRICS_FILE, read_metrics
from learner.checkpoint import STATE_FILE
from learner.checkpoint_folders import latest_checkpoint
from learner.control_peer import Restored
from learner.control_start import open_metrics
from learner.loop import LearnerLoop
from learner.restore import restore


class LoadRecorder:
    rank, step, policy_version = 0, 0, 0

    def __init__(self) -> None:
        self.loaded: list[Path] = []

    def load(self, path: str | Path) -> dict:
        """As a real load: the step is the checkpoint's (here, from its folder's name)."""
        self.loaded.append(Path(path))
        self.step = int(Path(path).name.removeprefix("step_"))
        return {}


def _checkpoint(root: Path, step: int) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text("{}")
    return d


def _loop(run: Path, *overrides: str) -> LearnerLoop:
    loop = object.__new__(LearnerLoop)  # the decision only: no model, no control plane
    loop.cfg = load_config(None, list(overrides))
    loop.run_dir = run
    loop.trainer = LoadRecorder()  # type: ignore[assignment]
    return loop


def _start(loop: LearnerLoop) -> Restored:
    """What the loop's construction does first: choose and load the checkpoint."""
    start = restore(loop.cfg, loop.trainer, loop.run_dir)
    loop.new_run = start.new_run
    return start.restored


def _restore(run: Path, *overrides: str) -> tuple[LoadRecorder, object]:
    loop = _loop(run, *overrides)
    return loop.trainer, _start(loop)  # type: ignore[return-value]


def test_disable_moves_an_earlier_runs_checkpoints_aside(tmp_path):
    from asyncrl.config.ending import ended_at, mark_ended

    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", 60)
    mark_ended(run, 60)  # the earlier run ended whole at its step 60
    _restore(run, "trainer.resume_mode=auto")
    assert ended_at(run) == 60  # resumed: still that run's ending
    trainer, restored = _restore(run, "trainer.resume_mode=disable")
    # A new run: the earlier ending is not its own (were this one cut short at its step
    # 60, the launcher would have taken it as ended).
    assert ended_at(run) is None
    assert trainer.loaded == [] and restored.path is None  # type: ignore[attr-defined]
    assert not (run / "checkpoints").exists()
    assert (run / "checkpoints.1" / "step_60" / STATE_FILE).is_file()  # kept, apart
    # This run checkpoints step 20 and crashes; the launcher restarts it with auto.
    ours = _checkpoint(run / "checkpoints", 20)
    trainer, _ = _restore(run, "trainer.resume_mode=auto")
    assert trainer.loaded == [ours]


def test_auto_before_the_first_checkpoint_resumes_where_the_first_start_did(tmp_path):
    run, given = tmp_path / "run", _checkpoint(tmp_path / "elsewhere", 7)
    _checkpoint(run / "checkpoints", 60)  # an earlier run's, in the same directory
    first = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={given}"]
    trainer, _ = _restore(run, *first)
    assert trainer.loaded == [given] and (run / "checkpoints.1").is_dir()
    # Killed before its first checkpoint: restarted with auto, it loads the given one again.
    trainer, _ = _restore(run, *first, "trainer.resume_mode=auto")
    assert trainer.loaded == [given]


def _restarted(first: list[str]) -> list[str]:
    """The overrides of a learner the launcher restarts after a start under ``first``."""
    from asyncrl.launch.roles import learner_restart_args

    return [*first, *learner_restart_args(load_config(None, first))]


def test_a_restart_before_the_first_checkpoint_loads_what_the_first_start_did(tmp_path):
    """Found by a review: a start under ``disable`` with a ``resume_from_path`` left in
    its config (veRL reads it only under ``resume_path``) trained from the base model, and
    its restart, under ``auto`` and before any checkpoint (``save_freq=-1`` never writes
    one), loaded that other checkpoint: another run's weights, step and data cursor,
    logged on as this run's."""
    run, given = tmp_path / "run", _checkpoint(tmp_path / "elsewhere", 7)
    first = ["trainer.resume_mode=disable", f"trainer.resume_from_path={given}"]
    trainer, _ = _restore(run, *first)
    assert trainer.loaded == []
    trainer, restored = _restore(run, *_restarted(first))
    assert trainer.loaded == [] and restored.path is None  # type: ignore[attr-defined]
    # Under resume_path (and auto, which found it) the restart loads the given one again.
    for mode in ("resume_path", "auto"):
        first = [f"trainer.resume_mode={mode}", f"trainer.resume_from_path={given}"]
        trainer, _ = _restore(run, *_restarted(first))
        assert trainer.loaded == [given], mode


@pytest.mark.parametrize("kind", ["disable", "elsewhere", "rewind"])
def test_a_start_that_dies_while_its_model_loads_is_restarted_on_what_it_chose(
    tmp_path, monkeypatch, kind
):
    """Found by a review: the moves that keep ``auto`` off an earlier run's checkpoints (or
    off a rewind's abandoned branch) were made after the model loaded. A learner killed
    while it loaded (host memory, a failed process group) was restarted under ``auto``, which
    found the earlier run's step 100, or the abandoned branch's (and with that run's
    ``complete.json`` still there, ended at once as complete). The launcher's restart now
    finds what the first start chose: the moves come before the model loads."""
    import learner.trainer

    run, given = tmp_path / "runs/p/e", _checkpoint(tmp_path / "elsewhere", 7)
    sixty, _ = _checkpoint(run / "checkpoints", 60), _checkpoint(run / "checkpoints", 100)
    first, want = {
        "disable": (["trainer.resume_mode=disable"], []),
        "elsewhere": (
            ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={given}"],
            [given],
        ),
        "rewind": (
            ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={sixty}"],
            [sixty],
        ),
    }[kind]
    first += [
        f"trainer.default_local_dir={tmp_path / 'runs'}",
        "trainer.project_name=p",
        "trainer.experiment_name=e",
    ]

    def dies_loading(*args, **kwargs):
        raise MemoryError("killed while the model loads")

    monkeypatch.setattr(learner.trainer, "Trainer", dies_loading)
    with pytest.raises(MemoryError):
        LearnerLoop(load_config(None, first))
    trainer, _ = _restore(run, *_restarted(first))  # the launcher's restart
    assert trainer.loaded == want


def test_a_new_run_or_branch_does_not_keep_an_earlier_runs_final_export(tmp_path):
    """Found by a review: ``final/`` is made again at the end unless its mark names the
    run's last step. A new run (or a rewind) over a run that exported its step 100 would
    keep that export when it was itself cut short in its ending at step 100."""
    from learner.export import exported_step, mark_export

    run = tmp_path / "run"
    for folder in ("final", "final_adapter"):
        (run / folder).mkdir(parents=True)
    sixty = _checkpoint(run / "checkpoints", 60)
    _checkpoint(run / "checkpoints", 100)
    for start in (
        ["trainer.resume_mode=auto"],
        ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={sixty}"],
        ["trainer.resume_mode=disable"],
    ):
        for folder in ("final", "final_adapter"):
            mark_export(run / folder, 100)
        _restore(run, *start)
        kept = [exported_step(run / folder) for folder in ("final", "final_adapter")]
        assert kept == ([100, 100] if start[0].endswith("auto") else [None, None]), start
    # A new run without LoRA exports no adapter: the earlier run's is moved aside, not left
    # beside the new final/ (a review), and nothing is deleted.
    assert not (run / "final_adapter").exists() and (run / "final_adapter.1").is_dir()


@pytest.mark.parametrize("mode", ["auto", "resume_path"])
def test_resuming_from_the_run_directory_moves_nothing(tmp_path, mode):
    run = tmp_path / "run"
    old, new = _checkpoint(run / "checkpoints", 10), _checkpoint(run / "checkpoints", 20)
    extra = [f"trainer.resume_from_path={old}"] if mode == "resume_path" else []
    trainer, _ = _restore(run, f"trainer.resume_mode={mode}", *extra)
    assert trainer.loaded == [old if mode == "resume_path" else new]
    assert not (run / "checkpoints.1").exists()


def test_a_rewind_moves_the_later_steps_out_of_autos_reach(tmp_path, caplog):
    """Resumed from step 10 while step 20 exists, the run writes step 15 and crashes: the
    launcher's restart (auto) resumes step 15, not the abandoned step 20."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    ten = _checkpoint(root, 10)
    _checkpoint(root, 20)
    (root / "step_25.tmp").mkdir()  # a save of the abandoned branch, cut short
    rewind = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={ten}"]
    loop = _loop(run, *rewind)
    with caplog.at_level("INFO", logger="learner.restore"):
        _start(loop)
    trainer = loop.trainer
    assert trainer.loaded == [ten]  # type: ignore[attr-defined]
    # The new branch's metrics start a new record: the abandoned one logged steps 11-20.
    assert loop.new_run
    abandoned = root / "abandoned_after_step_10"
    assert (abandoned / "step_20" / STATE_FILE).is_file() and (abandoned / "step_25.tmp").is_dir()
    assert (
        f"rewound to step 10: the later checkpoints (the branch left behind) moved to {abandoned}"
        in caplog.text
    )
    assert sorted(p.name for p in root.iterdir()) == ["abandoned_after_step_10", "step_10"]
    fifteen = _checkpoint(root, 15)  # the new branch checkpoints, then crashes
    trainer, _ = _restore(run, *rewind, "trainer.resume_mode=auto")
    assert trainer.loaded == [fifteen]
    # Rewound to step 10 once more: the second abandoned branch is kept apart too.
    _restore(run, *rewind)
    assert (root / "abandoned_after_step_10.2" / "step_15" / STATE_FILE).is_file()
    assert latest_checkpoint(run) == ten


def test_a_checkpoint_of_an_abandoned_branch_is_refused_before_anything_moves(tmp_path):
    """Resumed in place, step 20 of the branch a rewind to step 10 left behind would write
    steps 21... beside the live branch's step 15, and a restart (auto) would resume step
    15: refused in one line that says how to go on with that branch."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    ten = _checkpoint(root, 10)
    _checkpoint(root, 20)
    _restore(run, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={ten}")
    fifteen = _checkpoint(root, 15)
    old = root / "abandoned_after_step_10" / "step_20"
    back = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={old}"]
    with pytest.raises(ConfigError, match="a branch its run left behind") as e:
        _restore(run, *back)
    assert len(e.value.problems) == 1 and f"move its step_N folders back into {root}" in str(
        e.value
    )
    assert (old / STATE_FILE).is_file() and latest_checkpoint(run) == fifteen


@pytest.mark.parametrize("given", ["checkpoints", "checkpoints/step_20/model", "nowhere"])
def test_a_resume_path_that_is_no_checkpoint_fails_before_anything_moves(tmp_path, given):
    run = tmp_path / "run"
    twenty = _checkpoint(run / "checkpoints", 20)
    (twenty / "model").mkdir()
    bad = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={run / given}"]
    with pytest.raises(ConfigError, match="point it at") as e:
        _restore(run, *bad)
    assert len(e.value.problems) == 1
    if given == "checkpoints":  # the folder of checkpoints: the message names the latest
        assert f"e.g. {twenty}" in e.value.problems[0]
    assert (twenty / STATE_FILE).is_file() and not (run / "checkpoints.1").exists()
    # The launcher's restart (auto) with none of this run's: the same error, not a load.
    empty = tmp_path / "empty_run"
    with pytest.raises(ConfigError, match="point it at"):
        _restore(empty, *bad, "trainer.resume_mode=auto")


def _old_records(run: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "reward/mean": 0.5}) for s in range(1, 61)]
    (run / METRICS_FILE).write_text("\n".join(lines) + "\n")


def test_a_new_run_over_an_earlier_one_starts_its_metrics_afresh(tmp_path):
    """Resumed from another directory's checkpoint, in a directory holding an earlier run's
    step 60 and metrics: the new run's steps do not follow the earlier run's 60; its
    launcher restart (auto) and a rewind within it append to its own."""
    run, given = tmp_path / "run", _checkpoint(tmp_path / "elsewhere", 7)
    _checkpoint(run / "checkpoints", 60)
    _old_records(run)
    first = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={given}"]
    rewind = [
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={run}/checkpoints/step_8",
    ]

    def start(step: int, *overrides: str) -> bool:
        loop = _loop(run, *overrides, "trainer.logger=[jsonl]")
        _start(loop)
        logger = open_metrics(loop.cfg, run, loop.new_run)
        logger.log(step, {"reward/mean": 1.0})
        logger.close()
        return loop.new_run

    assert start(8, *first)  # a new run here: the earlier one's records set aside
    _checkpoint(run / "checkpoints", 8)
    assert not start(9, *first, "trainer.resume_mode=auto")  # the launcher's restart
    assert not start(9, *rewind)  # a rewind within this run: its own records go on
    assert [r["step"] for r in read_metrics(run)] == [8, 9, 9]
    earlier = (run / "metrics.1.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in earlier] == list(range(1, 61))


def test_a_checkpoint_holds_its_own_steps_lag_decision(tmp_path, monkeypatch):
    """The adaptive lag controller steers on a step's metrics before that step's checkpoint
    is taken: the step is not trained again after a resume, so a decision (a narrowing on
    a bad ESS) taken after the save was lost with it, and the resumed run admitted one
    version wider than the one it replaced. The validation round due starts with the save
    (its servers score it while the checkpoint is written), and is polled after it."""
    from types import SimpleNamespace

    import learner.loop as loop_module
    from learner.control_peer import NoControl
    from learner.health import HealthMonitor

    calls: list[str] = []

    class Recording(NoControl):
        def steer_lag(self, step: int, metrics: dict) -> None:
            calls.append("steer")

        def checkpoint_extra(self, step: int) -> dict:
            calls.append("save")
            return {}

        def log_step(self, step: int, metrics: dict, version: int) -> None:
            calls.append("record")

        def after_step(self, step: int) -> None:
            calls.append("after")

    class Training(LoadRecorder):
        world_size, max_len = 1, None

        def train_step(self, rollouts, temperature) -> dict:
            self.step += 1
            return {"importance/ess": 0.1}

        def save(self, run_dir, extra=None) -> None:
            pass

    loop = _loop(tmp_path, "trainer.save_freq=1", "trainer.total_training_steps=4")
    loop.trainer, loop.control, loop.total = Training(), Recording(), 4  # type: ignore[assignment]
    loop.health, loop.unacked, loop._marked = HealthMonitor(loop.cfg.trainer.health), [], set()
    loop.last_batch_id, loop.last_batch_session = 0, ""
    loop._next_batch = lambda: SimpleNamespace(metrics={}, trajectories=[])  # type: ignore[method-assign]
    loop._account = lambda batch, rollouts: None  # type: ignore[method-assign]
    loop._push = lambda: {}  # type: ignore[method-assign]
    monkeypatch.setattr(loop_module, "to_rollouts", lambda batch: [])
    monkeypatch.setattr(loop_module.startup, "mark", lambda *args: None)
    assert loop._one_step()
    # The step's record is written before its checkpoint too: a learner dying between them
    # trains the step again (a second record, superseded), where it lost its record.
    assert calls == ["steer", "record", "save", "after"]


class StateReader(LoadRecorder):
    """Reads the checkpoint's state file as a real load does first (a damaged one raises)."""

    def load(self, path: str | Path) -> dict:
        json.loads((Path(path) / STATE_FILE).read_text())
        return super().load(path)


def test_a_checkpoint_that_cannot_be_loaded_names_the_one_before_it(tmp_path):
    """A damaged checkpoint (or one of another model) raised out of the learner's start:
    a traceback, three restarts that failed the same way, exit 1. It is one line now, which
    names the checkpoint before it to resume from, and the learner exits 2 (not restarted)."""
    run = tmp_path / "run"
    three = _checkpoint(run / "checkpoints", 3)
    six = _checkpoint(run / "checkpoints", 6)
    (six / STATE_FILE).write_text('{"step": 6, "bro')  # cut short by a full disk, say
    loop = _loop(run, "trainer.resume_mode=auto")
    loop.trainer = StateReader()  # type: ignore[assignment]
    with pytest.raises(ConfigError) as e:
        _start(loop)
    (line,) = e.value.problems
    assert line.startswith(f"checkpoint {six} cannot be loaded (JSONDecodeError: ")
    assert line.endswith(
        "it is damaged, or of another model or config; resume from an earlier one "
        f"(trainer.resume_mode=resume_path trainer.resume_from_path={three}), or move it aside"
    )


def test_auto_over_a_verl_run_directory_says_it_starts_over(tmp_path, caplog):
    """veRL's default_local_dir is the run directory here too: resume_mode=auto (veRL's
    default) found none of this project's checkpoints beside veRL's global_step_N and
    started from model.path without a word."""
    run = tmp_path / "run"
    (run / "global_step_20" / "actor").mkdir(parents=True)
    (run / "global_step_100" / "actor").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="learner.restore"):
        trainer, restored = _restore(run)
    assert trainer.loaded == [] and restored == Restored(None, None, None)
    (line,) = [r.getMessage() for r in caplog.records if "veRL" in r.getMessage()]
    assert line.startswith(
        f"{run} holds veRL checkpoints (latest global_step_100) and none of this project's "
        "(checkpoints/step_N): the run starts from actor_rollout_ref.model.path"
    )
    assert f"--local_dir {run / 'global_step_100' / 'actor'}" in line
    caplog.clear()
    _checkpoint(run / "checkpoints", 7)  # one of its own: resumed, nothing said
    with caplog.at_level("WARNING", logger="learner.restore"):
        trainer, _ = _restore(run)
    assert trainer.loaded == [run / "checkpoints" / "step_7"]
    assert not [r for r in caplog.records if "veRL" in r.getMessage()]
