"""The resolved config.yaml a launcher writes and a role reads: the same advisories as the
launcher's (it records which keys the user wrote), and local paths that read the same from
any directory; a resume compares the model's folder, not its spelling."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from asyncrl.config import load_config, run_dir, write_resolved
from asyncrl.config.advisories import config_advisories
from asyncrl.config.resolved import WRITTEN, written_keys
from asyncrl.config.resumed import changed_settings, settings_of

DEMO = "configs/cpu_demo.yaml"


@pytest.mark.parametrize(
    ("path", "overrides"),
    [
        (DEMO, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]),
        (DEMO, ["actor.policy_loss.loss_mode=gspo"]),
        (None, ["actor_rollout_ref.rollout.n=4", "algorithm.kl_ctrl.kl_coef=0.01"]),
    ],
)
def test_resolved_config_gives_the_launchers_advisories(tmp_path, path, overrides):
    launched = load_config(path, overrides)
    assert config_advisories(launched)  # each case has one to lose or to gain
    role = load_config(write_resolved(launched, tmp_path), [])
    assert config_advisories(role) == config_advisories(launched)
    again = load_config(write_resolved(role, tmp_path / "again"), [])  # the learner rewrites it
    assert config_advisories(again) == config_advisories(launched)


def test_resolved_config_counts_a_restarts_own_overrides(tmp_path):
    written = write_resolved(load_config(DEMO), tmp_path)
    assert config_advisories(load_config(written, [])) == []
    role = load_config(written, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    assert [a.split(" ")[0] for a in config_advisories(role)] == [
        "actor.ppo_micro_batch_size_per_gpu=4"
    ]


def test_a_key_a_role_deletes_is_no_longer_written(tmp_path):
    """``~key`` given to a role put the key back to its default but left it in the
    resolved config's record of written keys: its advisory said the default was chosen,
    and the role's own config.yaml recorded it again."""
    key = "actor.ppo_micro_batch_size_per_gpu"
    launched = load_config(DEMO, [f"{key}=4"])
    written = write_resolved(launched, tmp_path)
    for deletion in (f"~{key}", "~actor"):
        role = load_config(written, [deletion])
        assert key not in written_keys(role), deletion
        assert config_advisories(role) == []
        again = yaml.safe_load(write_resolved(role, tmp_path / "again").read_text())
        assert key not in again[WRITTEN]
    # given again after the deletion, it is written
    role = load_config(written, [f"~{key}", f"{key}=2"])
    assert key in written_keys(role)


def test_resolved_config_holds_absolute_local_paths(tmp_path, monkeypatch):
    demo = Path(DEMO).resolve()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/train.parquet").write_bytes(b"")
    cfg = load_config(
        demo,
        [
            "trainer.default_local_dir=runs_x",
            "model.path=hub/Model-1B",
            "data.train_files=[data/train.parquet]",
        ],
    )
    written = write_resolved(cfg, tmp_path / "run")
    saved = yaml.safe_load(written.read_text())
    assert saved["trainer"]["default_local_dir"] == str(tmp_path / "runs_x")
    assert saved["data"]["train_files"] == [str(tmp_path / "data/train.parquet")]
    assert saved["model"]["path"] == "hub/Model-1B"  # not a folder here: a hub id, as written
    monkeypatch.chdir(tmp_path / "run")  # a role restarted by hand from another directory
    again = load_config(written, [])
    assert again.data.train_files == [str(tmp_path / "data/train.parquet")]
    assert run_dir(again) == tmp_path / "runs_x" / run_dir(cfg).relative_to("runs_x")


@pytest.mark.parametrize(
    "spelling",
    [
        "artifacts/models/tiny-demo",
        "./artifacts/models/tiny-demo/",
        "{cwd}/artifacts/models/tiny-demo",
    ],
)
def test_resume_reads_one_model_path_in_any_spelling(spelling):
    saved = json.loads(json.dumps(settings_of(load_config(DEMO))))  # as the state file has it
    now = load_config(DEMO, [f"model.path={spelling.format(cwd=os.getcwd())}"])
    assert changed_settings(saved, now) == []
    other = load_config(DEMO, ["model.path=artifacts/models/other"])
    assert changed_settings(saved, other) == [
        "model.path artifacts/models/tiny-demo -> artifacts/models/other"
    ]


def test_a_resume_names_a_changed_push_schedule_and_importance_correction():
    """Found by a review: a resume that changed staleness.sync_every (how versions are
    counted, also by the replay), the lag controller or the importance correction went on
    without a word, though each changes how a step trains as much as loss_mode does."""
    saved = json.loads(json.dumps(settings_of(load_config(DEMO))))
    now = load_config(
        DEMO,
        [
            "staleness.sync_every=1",
            "staleness.controller=adaptive",
            "algorithm.importance.mode=mis",
            "algorithm.importance.cap=3.0",
        ],
    )
    changed = {line.split()[0] for line in changed_settings(saved, now)}
    assert changed == {
        "staleness.sync_every",
        "staleness.controller",
        "algorithm.importance.mode",
        "algorithm.importance.cap",
    }


def test_text_that_looks_like_a_number_reads_back_as_text(tmp_path):
    """A review: the resolved config was written by plain YAML, which writes ``'1e5'``
    bare, and read by the loader that reads a bare ``1e5`` as a float: a scorer's
    ``reward_kwargs`` text reached every role as a number."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "reward:\n  custom_reward_function:\n    reward_kwargs: {tag: '1e5', flag: 'true'}\n"
        "model:\n  override_config: {name: '2e3'}\n"
    )
    launched = load_config(path, [])
    role = load_config(write_resolved(launched, tmp_path / "run"), [])
    kwargs = role.reward.custom_reward_function.reward_kwargs
    assert kwargs == {"tag": "1e5", "flag": "true"}
    assert role.model.override_config == {"name": "2e3"}
