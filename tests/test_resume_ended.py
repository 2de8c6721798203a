"""Starting a run again after it ended: the same command on a run that ended whole has
nothing to train and ends at once (its data spent, or its total reached), and a run whose
ending was cut short (killed after the final checkpoint) gets what the ending missed (the
export, the final validation, a LoRA adapter), and only that.

The decision is the learner loop's on a real run directory; the trainer is a stand-in
that records what it was asked to load (:class:`tests.test_resume_modes.LoadRecorder`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from learner.control_peer import Restored
from tests.test_resume_modes import LoadRecorder, _checkpoint, _loop


def test_a_run_that_spent_its_data_is_complete_until_more_epochs_are_asked(tmp_path):
    """A run of 20 steps whose one epoch of data ran out at step 5 ended whole there: the
    same command started again has nothing to train (it started every role, and the
    learner sat in a final validation for launch.start_timeout_s). More epochs, or a run
    that did not end whole, train on."""
    from asyncrl.config import run_dir
    from asyncrl.config.ending import complete_line, data_spent_at, finished_step, mark_ended

    args = ["trainer.total_training_steps=20", f"trainer.default_local_dir={tmp_path}"]
    cfg = load_config(None, [*args, "trainer.total_epochs=1"])
    run = run_dir(cfg)
    _checkpoint(run / "checkpoints", 5)
    assert finished_step(cfg) is None  # no ending recorded: cut short, finish it
    mark_ended(run, 5, data_spent_at_epochs=1)
    assert finished_step(cfg) == 5 and data_spent_at(run) == 1
    line = complete_line(5, 20, data_spent_at(run))
    assert "data was spent at step 5 (trainer.total_epochs=1)" in line
    assert "raise trainer.total_epochs" in line
    assert finished_step(load_config(None, [*args, "trainer.total_epochs=2"])) is None
    mark_ended(run, 5)  # ended at its total, which is 20 now: train on
    assert finished_step(cfg) is None


def test_a_complete_run_resumed_says_so_and_ends_at_once(tmp_path, caplog):
    """A finished run's final checkpoint is what ``auto`` resumes when the same command is
    run again (veRL with ``save_freq: -1`` would have none and train afresh): the learner
    says the run is complete and how to train again, asks for no batch, saves nothing, and
    ends the run without waiting for validation rounds (a walkthrough's rerun sat for
    ``launch.start_timeout_s`` on rounds its checkpoint held, reported long before).
    A run whose ending was cut short (killed after the final checkpoint: no
    ``complete.json``) gets the export and the final validation it missed."""
    from asyncrl.config.ending import COMPLETE_FILE, ended_at, mark_ended
    from learner.control_peer import NoControl
    from learner.export import mark_export

    class Finished(LoadRecorder):
        step = 10
        world_size = 1

        def export_state(self) -> dict:
            return {"w": 1}

        def full_state_for_push(self) -> dict:
            return {"w": 2}

    class Ending(NoControl):
        def __init__(self) -> None:
            self.exported: list[Path] = []
            self.resumed: list[dict] = []

        def export(self, tensors: dict, out: Path, step: int) -> None:
            self.exported.append(out)
            out.mkdir(exist_ok=True)
            mark_export(out, step)

        def resume(self, tensors: dict) -> None:
            self.resumed.append(tensors)

        def finish(
            self,
            step: int,
            validate: bool,
            wait_rounds: bool = True,
            complete: bool = False,
            keepalive=None,
        ) -> None:
            self.ended = (step, validate, wait_rounds, complete)

    run = tmp_path / "run"
    loop = _loop(run, "trainer.total_training_steps=10")
    loop.trainer = Finished()  # type: ignore[assignment]
    loop._one_step = lambda: pytest.fail("asked for a batch")  # type: ignore[method-assign]

    def start_again() -> Ending:
        loop.total, loop.control = 10, Ending()
        with caplog.at_level("WARNING", logger="learner.restore"):
            assert loop.run() == 0
        return loop.control  # type: ignore[return-value]

    run.mkdir()
    mark_ended(run, 10)
    control = start_again()
    assert (
        "this run is complete (its last checkpoint is at step 10 of 10): nothing to" in caplog.text
    )
    assert "new trainer.experiment_name" in caplog.text
    assert "raise trainer.total_training_steps" in caplog.text
    from asyncrl.config.ending import complete_line

    assert "(its last checkpoint is at step 3, past 2)" in complete_line(3, 2)
    assert control.ended == (10, False, False, True) and control.resumed == []
    # Killed between its last checkpoint and its export, the run had no final/: made now.
    assert control.exported == [run / "final"]
    assert start_again().exported == []
    # A final/ of another step (the run before it was extended, a branch given up by a
    # rewind, a new run in the same directory) or one cut short is not this ending's.
    mark_export(run / "final", 6)
    assert start_again().exported == [run / "final"]
    (run / "final" / "export.json").unlink()
    assert start_again().exported == [run / "final"]
    # Killed before its ending was recorded: the final validation runs now, on weights the
    # servers catch up to, and waits for its round; then the ending is recorded.
    (run / COMPLETE_FILE).unlink()
    caplog.clear()
    control = start_again()
    assert "its ending was cut short: finishing it" in caplog.text
    assert "this run is complete" not in caplog.text
    # (rank 0's control plane records the ending once the round is in: complete=True)
    assert control.ended == (10, True, True, True) and control.resumed == [{"w": 2}]
    mark_ended(run, 10)
    assert ended_at(run) == 10
    (run / COMPLETE_FILE).write_text("{")  # a torn write reads as not ended
    assert ended_at(run) is None


def test_an_ended_run_with_no_buffer_to_tell_needs_none(tmp_path, monkeypatch, tiny_model):
    """A learner killed after its run's ending was recorded and the peers were told (they
    exited for good) is started again by the launcher: it asks for the buffer only
    briefly, then ends without it (it waited launch.start_timeout_s for it, failed, and was
    restarted until the launcher gave up). A run not ended needs rank 0's control plane."""
    from asyncrl.config.ending import mark_ended
    from asyncrl.net.ports import free_ports
    from learner import loop as loop_module
    from learner.control_peer import NoControl

    class Finished(LoadRecorder):
        step, world_size = 10, 1

    monkeypatch.setattr(loop_module, "ENDED_PROBE_S", 0.5)
    run = tmp_path / "run"
    run.mkdir()
    port = free_ports("127.0.0.1", 1)[0]  # no buffer there
    loop = _loop(
        run,
        "trainer.total_training_steps=10",
        f"endpoints.batches={port}",
        f"model.path={tiny_model}",
    )
    loop.trainer, loop.total = Finished(), 10  # type: ignore[assignment]
    loop.restored, loop.new_run = Restored(None, None, None), False
    built: list[str] = []
    monkeypatch.setattr(loop_module, "RankZero", lambda *a, **k: built.append("rank0"))
    mark_ended(run, 10)
    start = time.monotonic()
    alone = loop._control_plane()
    assert isinstance(alone, NoControl) and built == []
    assert time.monotonic() - start < 5
    # Its final/ found missing is still exported (a plain no-op wrote nothing, and the
    # learner said the run complete with no final/).
    from transformers import AutoModelForCausalLM

    from learner.export import exported_step

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    alone.export(dict(model.named_parameters()), run / "final", 10)
    assert exported_step(run / "final") == 10
    (run / "complete.json").unlink()  # its ending cut short: it needs its peers
    loop._control_plane()
    assert built == ["rank0"]


def test_a_lora_run_cut_short_in_its_ending_gets_its_adapter(tmp_path, monkeypatch):
    """With LoRA the ending also writes the adapter alone (``final_adapter/``): a run
    killed before it gets it at the next start, and only then."""
    from asyncrl.config.ending import mark_ended
    from learner import loop as loop_module
    from learner.control_peer import NoControl
    from learner.export import mark_export

    adapters: list[Path] = []
    gathered: list[object] = []

    def full_state(model, keep=True, only=None):
        gathered.append(only)  # the adapter's tensors only: the merged export has the rest
        return {"w": 1}

    monkeypatch.setattr(loop_module.fsdp, "full_state", full_state)
    monkeypatch.setattr(
        loop_module.lora, "export_adapter", lambda state, cfg, out, step: adapters.append(out)
    )

    class Finished(LoadRecorder):
        step, world_size, model = 10, 1, None

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    mark_export(run / "final", 10)
    mark_ended(run, 10)
    loop = _loop(run, "trainer.total_training_steps=10", "model.lora_rank=4")
    loop.trainer, loop.total, loop.control = Finished(), 10, NoControl()  # type: ignore[assignment]
    assert loop.run() == 0
    assert adapters == [run / "final_adapter"] and gathered == [loop_module.lora.is_adapter_key]
    (run / "final_adapter").mkdir()
    mark_export(run / "final_adapter", 9)  # an adapter of another step is made again
    assert loop.run() == 0 and adapters == [run / "final_adapter"] * 2
    mark_export(run / "final_adapter", 10)
    assert loop.run() == 0 and adapters == [run / "final_adapter"] * 2


def test_every_gather_of_the_ending_comes_before_rank_0_writes_the_export(tmp_path, monkeypatch):
    """Found by a review: with LoRA, rank 0 wrote the merged model, and only then did
    every rank gather the adapter. The other ranks waited in that gather the whole write
    long, and a large model on a slow disk outlasts the collective's timeout."""
    from types import SimpleNamespace

    from learner import loop as loop_module

    order: list[str] = []
    monkeypatch.setattr(
        loop_module.fsdp, "full_state", lambda model, keep, only: order.append("gather") or {}
    )
    monkeypatch.setattr(
        loop_module.lora, "export_adapter", lambda *a, **kw: order.append("write adapter")
    )
    loop = _loop(tmp_path / "run", "model.lora_rank=4")
    loop.trainer = SimpleNamespace(  # type: ignore[assignment]
        rank=0, step=3, model=None, export_state=lambda: order.append("gather merged") or {}
    )
    loop.control = SimpleNamespace(export=lambda *a: order.append("write merged"))  # type: ignore[assignment]
    loop._export()
    assert order == ["gather", "gather merged", "write merged", "write adapter"]
