"""A ``trainer.resume_from_path`` that is no checkpoint is a config error before any role
starts (the launcher's and the learner's input check: one line naming the fix, exit 2);
with ``resume_mode=auto`` (the launcher's restart) the learner finds it itself, before it
moves anything, and exits 2 instead of a traceback the launcher would restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.config.inputs import DATA, MODEL, RESUME, STATE_FILE, input_problems
from asyncrl.launch.restart_policy import CONFIG_ERROR, FINAL_EXIT_FILE


def _checkpoint(root: Path, step: int) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text("{}")
    return d


def _problems(path: Path | str, mode: str = "resume_path", needs=(RESUME,)) -> list[str]:
    cfg = load_config(None, [f"trainer.resume_mode={mode}", f"trainer.resume_from_path={path}"])
    return input_problems(cfg, needs)


def test_the_input_check_names_the_checkpoint_to_give(tmp_path):
    run = tmp_path / "run"
    step_20 = _checkpoint(run / "checkpoints", 20)
    _checkpoint(run / "checkpoints", 3)
    assert _problems(step_20) == []
    for folder in (run / "checkpoints", run):  # the folder of checkpoints, the run dir
        (line,) = _problems(folder)
        assert line == (
            f"trainer.resume_from_path={folder} is not a checkpoint (no {STATE_FILE}): "
            f"point it at one of the checkpoints it holds, e.g. {step_20}"
        )
    (line,) = _problems(tmp_path / "none")
    assert line == (
        f"trainer.resume_from_path={tmp_path / 'none'} does not exist: point it at "
        f"checkpoints/step_N, which holds {STATE_FILE}"
    )
    (line,) = _problems(step_20 / STATE_FILE)  # the file for its folder
    assert line == (
        f"trainer.resume_from_path={step_20 / STATE_FILE} is the checkpoint's state file: "
        f"give its folder, {step_20}"
    )
    (step_20 / "model").mkdir()
    (line,) = _problems(step_20 / "model")
    assert line.endswith(f"point it at checkpoints/step_N, which holds {STATE_FILE}")
    # Only the learner (and the launcher for it) needs it; only resume_path starts from it
    # for sure (auto only when the run has no checkpoint yet: the learner checks that).
    assert not any("resume_from_path" in line for line in _problems(run, needs=(MODEL, DATA)))
    assert _problems(run, mode="auto") == [] and _problems(run, mode="disable") == []


def test_the_learner_exits_2_on_a_fallback_that_is_no_checkpoint(
    tiny_model, arithmetic_data, tmp_path, caplog
):
    """The launcher's restart adds resume_mode=auto: with none of this run's checkpoints
    yet, the learner falls back to resume_from_path, which it checks before loading or
    moving anything (a restart would meet it again: exit 2 is never restarted)."""
    from learner.main import main

    run = tmp_path / "runs" / "asyncrl" / "demo"
    earlier = _checkpoint(run / "checkpoints.1", 60)  # kept apart by the first start
    code = main(
        [
            "configs/cpu_demo.yaml",
            f"model.path={tiny_model}",
            f"data.train_files={arithmetic_data / 'train.parquet'}",
            f"data.val_files={arithmetic_data / 'val.parquet'}",
            f"trainer.default_local_dir={tmp_path / 'runs'}",
            "trainer.experiment_name=demo",
            "trainer.resume_mode=auto",
            f"trainer.resume_from_path={run / 'checkpoints.1'}",
        ]
    )
    assert code == CONFIG_ERROR
    # said where the launcher reads it too: under torchrun it sees 1, not 2
    assert (run / FINAL_EXIT_FILE).read_text() == f"{CONFIG_ERROR}\n"
    assert f"point it at one of the checkpoints it holds, e.g. {earlier}" in caplog.text
    assert (earlier / STATE_FILE).is_file()


def test_a_learner_started_with_a_bad_resume_path_exits_2_at_once(tmp_path, capsys):
    """resume_path: the learner's own input check, before any model loads."""
    from learner.main import main

    bad = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}"]
    with pytest.raises(SystemExit) as e:
        main(["configs/cpu_demo.yaml", *bad])
    assert e.value.code == CONFIG_ERROR
    assert f"trainer.resume_from_path={tmp_path} is not a checkpoint" in capsys.readouterr().err


def _verl_checkpoint(run: Path, step: int) -> Path:
    """veRL's layout: ``global_step_<n>/actor/`` with FSDP shards and a huggingface folder."""
    actor = run / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"")
    (run / "latest_checkpointed_iteration.txt").write_text(str(step))
    return actor.parent


def test_a_verl_checkpoint_given_to_resume_from_is_named_with_veRLs_conversion(tmp_path):
    """A veRL user's resume_from_path names a veRL checkpoint (its step, its actor folder,
    or the run folder holding them): it was "not a checkpoint", with a fix pointing at
    checkpoints/step_N, which a veRL run does not have."""
    run = tmp_path / "verl_run"
    _verl_checkpoint(run, 5)
    latest = _verl_checkpoint(run, 40)
    for given in (latest, latest / "actor", latest / "actor" / "model_world_size_1_rank_0.pt", run):
        (line,) = _problems(given)
        assert line.startswith(
            f"trainer.resume_from_path={given} is a veRL checkpoint (global_step_40), whose "
            "sharded format this project cannot resume: merge its actor into a Hugging Face "
            "model with veRL's model merger (python -m verl.model_merger merge --backend fsdp "
            f"--local_dir {latest.resolve() / 'actor'} --target_dir"
        ), line
        assert "actor_rollout_ref.model.path=" in line
    # This project's checkpoints beside veRL's: those are named, as before.
    ours = _checkpoint(run / "checkpoints", 3)
    (line,) = _problems(run)
    assert line.endswith(f"e.g. {ours}")


def test_only_a_global_step_folder_holding_an_actor_reads_as_veRLs(tmp_path):
    """A folder merely named global_step_N, or this project's checkpoint somewhere under
    one, is not a veRL checkpoint; a Megatron one is merged with veRL's Megatron backend."""
    unrelated = tmp_path / "global_step_3" / "exports"
    unrelated.mkdir(parents=True)
    (line,) = _problems(unrelated)
    assert "veRL" not in line and line.endswith(f"which holds {STATE_FILE}")
    ours = tmp_path / "global_step_7" / "myrun" / "checkpoints" / "step_2"  # a save cut short
    ours.mkdir(parents=True)
    (line,) = _problems(ours)
    assert "veRL" not in line, line
    megatron = tmp_path / "mg" / "global_step_50"
    (megatron / "actor" / "dist_ckpt").mkdir(parents=True)
    (line,) = _problems(megatron)
    assert f"--backend megatron --local_dir {megatron.resolve() / 'actor'}" in line, line
