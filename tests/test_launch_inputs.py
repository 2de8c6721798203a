"""What the launcher checks before any role starts (:func:`asyncrl.config.inputs.
input_problems`): the model, the data files (present, in veRL's layout, with a scorer for
every ``data_source``), the scorer file, and the step count the data makes; each problem
one line naming the fix."""

from __future__ import annotations

import logging

import pandas as pd
import pytest

from asyncrl.config import ConfigError, load_config


def test_missing_inputs_are_named_with_the_fix(tmp_path, monkeypatch):
    from asyncrl.config.inputs import DATA, MODEL, REWARD, input_problems
    from asyncrl.config.machine import looks_like_hub_id

    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B") and looks_like_hub_id("gpt2")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # online: a hub id is the roles'
        monkeypatch.delenv(name, raising=False)
    assert not looks_like_hub_id("artifacts/models/tiny")
    assert not looks_like_hub_id("./tiny") and not looks_like_hub_id("/models/tiny")
    empty = tmp_path / "empty"
    empty.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    from asyncrl.tasks import prepare_task_data

    prepare_task_data("arithmetic", tmp_path / "data", seed=0, n_train=8, n_val=2)
    data = tmp_path / "data" / "train.parquet"
    base = [f"data.train_files={data}", "trainer.val_before_train=false", "trainer.test_freq=-1"]

    def problems(*overrides: str, needs=(MODEL, DATA, REWARD)) -> list[str]:
        return input_problems(load_config(None, [*base, *overrides]), needs)

    assert problems(f"model.path={model}") == []
    assert problems("model.path=Qwen/Qwen2.5-0.5B") == []  # a hub id: the roles load it
    assert problems(f"model.path={tmp_path}/none")[0].startswith(
        f"model.path={tmp_path}/none does not exist: build a model there with "
        f"`asyncrl-prepare model --name tiny --out {tmp_path}/none`"
    )
    assert "a directory without config.json" in problems(f"model.path={empty}")[0]
    # Every role crash-looped on these: a model without weights, a file for a directory.
    assert "holds no weights" in problems(f"model.path={no_weights}")[0]
    assert problems(f"model.path={data}")[0] == (
        f"model.path={data} is a file: point it at the HF model directory (the folder "
        "holding config.json and the weights)"
    )
    assert problems(f"model.path={tmp_path}/none", needs=(DATA,)) == []
    # A review: a critic's missing model was found after the actor loaded, as a traceback,
    # and the learner restarted until its restarts ran out. Checked only where it is used.
    ppo = ["algorithm.adv_estimator=gae", f"critic.model.path={tmp_path}/nocritic"]
    assert problems(f"model.path={model}", *ppo) == [
        f"critic.model.path={tmp_path}/nocritic does not exist: build a model there with "
        f"`asyncrl-prepare model --name tiny --out {tmp_path}/nocritic`, or give an existing "
        "HF model directory"
    ]
    assert problems(f"model.path={model}", ppo[1]) == []  # GRPO: no critic to load
    assert problems(f"model.path={model}", ppo[0], f"critic.model.path={model}") == []
    # Validation files only when validation runs; the scorer file only where it is loaded.
    val = f"data.val_files={tmp_path}/val.parquet"
    assert problems(f"model.path={model}", val) == []
    assert problems(f"model.path={model}", val, "trainer.test_freq=5") == [
        f"data.val_files: {tmp_path}/val.parquet does not exist: give an existing parquet "
        "file in veRL's schema (data_source, prompt, reward_model.ground_truth), or write a "
        "demo task's with asyncrl-prepare data"
    ]
    # veRL's layout names its task's files: no demo task is offered in their place.
    gsm8k = problems(f"model.path={model}", f"data.train_files={tmp_path}/gsm8k/test.parquet")
    assert "give an existing parquet file" in gsm8k[0] and "--task" not in gsm8k[0]
    arith = problems(f"model.path={model}", f"data.train_files={tmp_path}/arithmetic/train.parquet")
    assert f"--task arithmetic --out {tmp_path}/arithmetic`" in arith[0]
    # The repository's own artifacts name the make target that builds them (a review was
    # told to build the demo's model without --flatten, the calculator data as arithmetic).
    monkeypatch.chdir(tmp_path)  # where no artifacts are built
    made = problems(
        "model.path=artifacts/models/tiny-agent",
        "data.train_files=./artifacts/data/calculator/train.parquet",
    )
    assert made == [
        "model.path=artifacts/models/tiny-agent does not exist: build a model there with "
        "`make agent-artifacts`, or give an existing HF model directory",
        "data.train_files: ./artifacts/data/calculator/train.parquet does not exist: build it "
        "with `make agent-artifacts`",
    ]
    # The staleness study's task too (it was told to build the plain tiny model and the
    # demo's sums, 0..9 with 20 held out, where the study needs 0..19 and 200).
    study = problems(
        "model.path=artifacts/models/tiny-study",
        "data.train_files=artifacts/data/arithmetic19/train.parquet",
    )
    assert all("`make study-artifacts`" in line for line in study) and len(study) == 2
    countdown = problems(
        f"model.path={model}", f"data.train_files={tmp_path}/countdown/train.parquet"
    )
    assert f"--task countdown --out {tmp_path}/countdown`" in countdown[0]
    tools = [
        f"rollout.multi_turn.tool_config_path={tmp_path}/t.yaml",
        "rollout.multi_turn.enable=1",
    ]
    assert "t.yaml does not exist" in problems(f"model.path={model}", *tools)[0]
    scorer = f"reward.custom_reward_function.path={tmp_path}/score.py"
    assert "score.py does not exist" in problems(f"model.path={model}", scorer)[0]
    assert problems(f"model.path={model}", scorer, needs=(MODEL, DATA)) == []


def test_hub_id_offline_without_cached_copy_is_refused(tmp_path, monkeypatch, caplog):
    """A hub id is looked up in the local cache only: offline and not cached, no role could
    load it (they would crash-loop on the download), so the launcher says so first."""
    from asyncrl.config.inputs import MODEL, input_problems

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def problems() -> list[str]:
        return input_problems(load_config(None, ["model.path=Qwen/Qwen2.5-0.5B"]), (MODEL,))

    with caplog.at_level(logging.WARNING, logger="asyncrl.config.machine"):
        assert problems() == []  # online: the roles download it, and a line says so
    (said,) = [r.getMessage() for r in caplog.records if "hub id" in r.getMessage()]
    assert "every role downloads at its start" in said and "./Qwen/Qwen2.5-0.5B" in said
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (line,) = problems()
    assert line.startswith("model.path=Qwen/Qwen2.5-0.5B is no local directory and not in")
    assert "HF_HUB_OFFLINE is set" in line and "--local-dir DIR" in line
    snapshot = tmp_path / "hf" / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    assert len(problems()) == 1  # a snapshot without its config is no model
    (snapshot / "config.json").write_text("{}")
    assert problems() == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "true")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert "TRANSFORMERS_OFFLINE is set" in problems()[0]


def test_null_total_training_steps_counts_whole_batches_times_epochs(tmp_path):
    """veRL's count: len(dataloader) (whole batches, the last partial one dropped) times
    total_epochs; rows that make no batch are a config error with the fix."""
    from asyncrl.config.inputs import DATA, input_problems, total_training_steps
    from asyncrl.tasks import prepare_task_data

    prepare_task_data("arithmetic", tmp_path, seed=0, n_train=50, n_val=4)
    base = [
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/val.parquet",
        "trainer.total_training_steps=null",
    ]
    cfg = load_config(None, [*base, "data.train_batch_size=16", "trainer.total_epochs=3"])
    assert total_training_steps(cfg) == 50 // 16 * 3 == 9
    assert total_training_steps(load_config(None, ["trainer.total_training_steps=7"])) == 7
    too_big = load_config(None, [*base, "data.train_batch_size=64", "trainer.save_freq=-1"])
    with pytest.raises(ConfigError, match="make no batch of data.train_batch_size=64"):
        total_training_steps(too_big)
    assert "make no batch" in input_problems(too_big, [DATA])[0]
    # A critic warm-up as long as the counted run would leave the actor untrained.
    gae = ["algorithm.adv_estimator=gae", "critic.enable=true", "data.train_batch_size=16"]
    warm = load_config(None, [*base, *gae, "trainer.total_epochs=3", "trainer.critic_warmup=10"])
    assert "critic_warmup=10 is past the 9 steps" in input_problems(warm, [DATA])[0]
    fine = load_config(None, [*base, *gae, "trainer.total_epochs=3", "trainer.critic_warmup=9"])
    assert input_problems(fine, [DATA]) == []


def test_a_data_file_not_in_verls_layout_is_refused_before_anything_starts(tmp_path):
    """A file whose prompt column has another name (``question``) or that lacks
    ``reward_model`` is refused at launch in one line naming the fix (``data.prompt_key``),
    not by a learner that crash-loops on it (a walkthrough saw three restarts)."""
    from asyncrl.config import load_config
    from asyncrl.config.inputs import DATA, input_problems

    rows = {
        "data_source": ["arithmetic"],
        "question": [[{"role": "user", "content": "1+1="}]],
        "reward_model": [{"ground_truth": "2"}],
    }
    odd = tmp_path / "odd.parquet"
    pd.DataFrame(rows).to_parquet(odd)
    base = [f"data.train_files={odd}", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    (problem,) = input_problems(load_config(None, base), [DATA])
    assert f"{odd}: missing required column 'prompt'" in problem
    assert "set data.prompt_key=question" in problem
    assert input_problems(load_config(None, [*base, "data.prompt_key=question"]), [DATA]) == []
    rows.pop("reward_model")
    pd.DataFrame(rows).to_parquet(odd)
    (problem,) = input_problems(load_config(None, [*base, "data.prompt_key=question"]), [DATA])
    assert "missing required column 'reward_model'" in problem and "data.prompt_key" not in problem


def test_a_data_source_without_a_scorer_is_refused_at_launch(tmp_path):
    """veRL's MATH files (``data_source='lighteval/MATH'``) with no custom scorer: every
    sample would score 0 (a walkthrough's run ended "successfully" at reward 0). Refused
    at launch naming the source, its file and the fix; a custom scorer takes any source."""
    from asyncrl.config import load_config
    from asyncrl.config.inputs import DATA, REWARD, input_problems

    rows = {
        "data_source": ["lighteval/MATH", "arithmetic"],
        "prompt": [[{"role": "user", "content": "1+1="}]] * 2,
        "reward_model": [{"ground_truth": "2"}] * 2,
    }
    math = tmp_path / "math.parquet"
    pd.DataFrame(rows).to_parquet(math)
    base = [f"data.train_files={math}", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    (problem,) = input_problems(load_config(None, base), [DATA, REWARD])
    assert problem.startswith(f"data_source 'lighteval/MATH' ({math}) has no built-in scorer")
    assert "set reward.custom_reward_function.path" in problem
    assert input_problems(load_config(None, base), [DATA]) == []  # the learner's check
    scorer = tmp_path / "score.py"
    scorer.write_text("def compute_score(*args, **kwargs):\n    return 1.0\n")
    custom = [*base, f"reward.custom_reward_function.path={scorer}"]
    assert input_problems(load_config(None, custom), [DATA, REWARD]) == []


def test_rows_of_the_wrong_shape_are_config_errors_not_crashes(tmp_path):
    """A plain-string prompt, or a reward_model without ground_truth, never goes away: the
    launcher refuses a first row of the wrong shape in one line, and the learner, which
    reads every row, fails on any with a config error (exit 2, not restarted; a
    walkthrough saw three restarts, each with a traceback)."""
    from asyncrl.config.inputs import DATA, input_problems
    from asyncrl.control.task_source import load_rows

    rows = {
        "data_source": ["arithmetic", "arithmetic"],
        "prompt": ["1+1=", "2+2="],
        "reward_model": [{"ground_truth": "2"}, {"ground_truth": "4"}],
    }
    path = tmp_path / "plain.parquet"
    pd.DataFrame(rows).to_parquet(path)
    base = [f"data.train_files={path}", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    base += ["data.train_batch_size=1", "actor.ppo_mini_batch_size=1"]
    (problem,) = input_problems(load_config(None, base), [DATA])
    assert f"{path}: row 0: 'prompt' must be a list of chat messages" in problem
    assert "write a plain-text prompt as one user message" in problem
    with pytest.raises(ConfigError, match="row 0: 'prompt' must be a list"):
        load_rows([str(path)])  # the learner's read: every row
    rows["prompt"] = [[{"role": "user", "content": p}] for p in rows["prompt"]]
    rows["reward_model"] = [{"style": "rule"}, {"style": "rule"}]
    pd.DataFrame(rows).to_parquet(path)
    (problem,) = input_problems(load_config(None, base), [DATA])
    assert "row 0: reward_model must be a struct with 'ground_truth'" in problem
    # extra_info as a JSON string crashed the coordinator's deal; a map keyed by numbers
    # was dealt, and no server could read the task back.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows["reward_model"] = [{"ground_truth": "2"}, {"ground_truth": "4"}]
    rows["extra_info"] = ['{"index": 0}', '{"index": 1}']
    pd.DataFrame(rows).to_parquet(path)
    (problem,) = input_problems(load_config(None, base), [DATA])
    assert "row 0: extra_info must be a struct or a map with text keys" in problem
    assert "got str" in problem and "json.loads" in problem
    table = pa.Table.from_pydict(
        {k: v for k, v in rows.items() if k != "extra_info"}
        | {"extra_info": pa.array([[(1, "a")], [(2, "b")]], pa.map_(pa.int64(), pa.string()))}
    )
    pq.write_table(table, path)
    (problem,) = input_problems(load_config(None, base), [DATA])
    assert "got a dict with keys that are not text {1: 'a'}" in problem
    with pytest.raises(ConfigError, match="row 0: extra_info must be a struct"):
        load_rows([str(path)])
    text_keys = pa.array(
        [[("split", "train")], [("split", "train")]], pa.map_(pa.string(), pa.string())
    )
    pq.write_table(table.set_column(3, "extra_info", text_keys), path)
    assert input_problems(load_config(None, base), [DATA]) == []


def test_a_run_its_data_cannot_fill_is_refused_or_told_where_it_ends(tmp_path):
    """80 rows at batch 128 make no step: refused (it ran and reported success at step
    0). 80 rows at batch 16 for one epoch make 5 of 20 steps asked: the launcher says the
    run ends there, as veRL's does, and how to train them all."""
    from asyncrl.config.inputs import DATA, input_problems, short_data_line
    from asyncrl.tasks import prepare_task_data

    prepare_task_data("arithmetic", tmp_path, seed=0, n_train=80, n_val=4)
    base = [
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/val.parquet",
        "trainer.total_training_steps=20",
        "trainer.total_epochs=1",
    ]
    big = load_config(None, [*base, "data.train_batch_size=128"])
    (problem,) = input_problems(big, [DATA])
    assert "80 rows of data.train_files, dealt trainer.total_epochs=1 times, make no " in problem
    short = load_config(None, [*base, "data.train_batch_size=16"])
    assert input_problems(short, [DATA]) == []
    line = short_data_line(short)
    assert line is not None and "about 5 steps" in line and "raise trainer.total_epochs" in line
    enough = load_config(None, [*base, "data.train_batch_size=16", "trainer.total_epochs=4"])
    assert short_data_line(enough) is None


def test_wandb_without_a_key_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """trainer.logger=[console,wandb] online with no API key crashed the learner at its
    first W&B call, three times (restarted), then the run failed; it is refused at launch
    in one line naming the three fixes. An offline mode, a key or a ~/.netrc entry pass."""
    from asyncrl.config.inputs import LOGGER, input_problems

    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["trainer.logger=[console,wandb]"])
    (problem,) = input_problems(cfg, [LOGGER])
    assert "no API key" in problem and "wandb login" in problem and "WANDB_MODE=offline" in problem
    assert input_problems(load_config(None, ["trainer.logger=[console]"]), [LOGGER]) == []
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert input_problems(cfg, [LOGGER]) == []
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert input_problems(cfg, [LOGGER]) == []


def test_empty_validation_files_and_damaged_pages_are_refused(tmp_path):
    """An empty validation file made a run that never validated, and said nothing; a file
    whose footer reads but whose pages are damaged ended the launcher in a traceback; an
    empty training file was told to raise its epochs. Each is one line now."""
    import pyarrow.parquet as pq

    from asyncrl.config.inputs import DATA, input_problems
    from asyncrl.tasks import prepare_task_data

    prepare_task_data("arithmetic", tmp_path, seed=0, n_train=90, n_val=4)
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(val).slice(0, 0), empty)

    def problems(*overrides: str) -> list[str]:
        return input_problems(load_config(None, list(overrides)), [DATA])

    validating = [f"data.train_files={train}", f"data.val_files={empty}"]
    (line,) = problems(*validating, "trainer.val_before_train=true")
    assert line.startswith(f"data.val_files: {empty} has no rows, so validation would never")
    assert problems(*validating, "trainer.val_before_train=false", "trainer.test_freq=-1") == []
    quiet = ["trainer.val_before_train=false", "trainer.test_freq=-1"]
    (line,) = problems(f"data.train_files={empty}", *quiet)
    assert line == "data.train_files hold no rows: give files with training rows"

    damaged = tmp_path / "damaged.parquet"
    raw = bytearray(train.read_bytes())
    footer = int.from_bytes(raw[-8:-4], "little") + 8  # its length, the length, "PAR1"
    raw[4:-footer] = b"\xff" * (len(raw) - footer - 4)  # the pages; the footer stays whole
    damaged.write_bytes(bytes(raw))
    pq.read_schema(damaged)  # the footer reads
    (line,) = problems(f"data.train_files={damaged}", *quiet)
    assert line.startswith(f"data files: {damaged} cannot be read (")


def test_cores_and_a_device_this_machine_lacks_are_refused(monkeypatch):
    """``launch.cpus`` naming a core this machine does not give the launch ended the launch
    in a traceback after some roles had started; ``trainer.device=cuda`` where PyTorch finds
    no GPU crash-looped the learner three times. Each is one line now (the launcher checks
    the cores, the learner its device: the launcher does not import torch)."""
    import os

    import torch

    from asyncrl.config.inputs import CORES, DEVICE, input_problems

    have = sorted(os.sched_getaffinity(0))
    absent = max(have) + 1
    cpus = f"launch.cpus={{learner: [{have[0]}], rollout: [[{absent}], [{have[0]}]], buffer: [{have[0]}]}}"
    (line,) = input_problems(load_config("configs/cpu_demo.yaml", [cpus]), [CORES])
    assert line.startswith(f"launch.cpus names core(s) [{absent}], which this machine does not")
    assert input_problems(load_config("configs/cpu_demo.yaml"), [CORES]) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (line,) = input_problems(load_config(None, ["trainer.device=cuda"]), [DEVICE])
    assert "finds no CUDA device" in line and "set trainer.device=cpu" in line
    assert input_problems(load_config(None, ["trainer.device=cpu"]), [DEVICE]) == []


def test_shard_patterns_expand_and_remote_addresses_are_named(tmp_path):
    """veRL's loader reads ``data.train_files=/data/train-*.parquet`` (the files it
    matches, sorted) and copies ``hdfs://`` files to a local folder first: a pattern is
    expanded here, a remote address refused in one line (it was "does not exist")."""
    from asyncrl.config.inputs import DATA, input_problems
    from asyncrl.tasks import prepare_task_data

    for part in ("b", "a"):
        prepare_task_data("arithmetic", tmp_path / part, seed=0, n_train=8, n_val=2)
        (tmp_path / part / "train.parquet").rename(tmp_path / f"train-{part}.parquet")
    off = ["trainer.val_before_train=false", "trainer.test_freq=-1"]
    cfg = load_config(None, [f"data.train_files={tmp_path}/train-*.parquet", *off])
    assert cfg.data.train_files == [f"{tmp_path}/train-a.parquet", f"{tmp_path}/train-b.parquet"]
    assert input_problems(cfg, (DATA,)) == []
    listed = load_config(None, [f"data.train_files=[{tmp_path}/train-*.parquet,x.parquet]"])
    assert listed.data.train_files == [*cfg.data.train_files, "x.parquet"]
    nothing = load_config(None, [f"data.train_files={tmp_path}/none-*.parquet", *off])
    assert nothing.data.train_files == [f"{tmp_path}/none-*.parquet"]  # named as given
    assert "none-*.parquet does not exist" in input_problems(nothing, (DATA,))[0]
    remote = load_config(None, ["data.train_files=hdfs://cluster/data/train.parquet", *off])
    assert input_problems(remote, (DATA,)) == [
        "data.train_files: hdfs://cluster/data/train.parquet is a remote address: copy the "
        "files to a folder every role can read (the same path on every machine) and give that"
    ]


def test_a_multimodal_dataset_is_refused_rather_than_trained_without_its_images(tmp_path):
    """veRL's geo3k-style rows carry pictures in ``images`` (its image_key's default):
    prompts here are text, so such a file is refused in one line; an empty column is not."""
    from asyncrl.config.inputs import DATA, input_problems

    rows = {
        "data_source": ["arithmetic"],
        "prompt": [[{"role": "user", "content": "<image>What is 1+1?"}]],
        "reward_model": [{"ground_truth": "2"}],
        "images": [[{"bytes": b"\x89PNG"}]],
    }
    mm = tmp_path / "mm.parquet"
    pd.DataFrame(rows).to_parquet(mm)
    base = [f"data.train_files={mm}", "trainer.val_before_train=false", "trainer.test_freq=-1"]
    assert input_problems(load_config(None, base), [DATA]) == [
        f"data files: {mm} holds images (column 'images', data.image_key; first in row 0): "
        "prompts here are text only and would train without them; use a text dataset, or "
        "drop the column to train on the text alone"
    ]
    pd.DataFrame({**rows, "images": [[]]}).to_parquet(mm)
    assert input_problems(load_config(None, base), [DATA]) == []


def test_pictures_past_the_first_row_or_under_another_column_are_refused_at_launch(tmp_path):
    """The launch check reads every row's pictures, in the columns data.image_key and
    data.video_key name: a file whose first row has ``images: []`` (geo3k's text-only
    rows) or whose pictures sit in ``image`` trained on the text alone, without a word."""
    from asyncrl.config.inputs import DATA, ROWS, input_problems

    def frame(column: str, media: list) -> pd.DataFrame:
        n = len(media)
        return pd.DataFrame(
            {
                "data_source": ["arithmetic"] * n,
                "prompt": [[{"role": "user", "content": "<image>What is 1+1?"}]] * n,
                "reward_model": [{"ground_truth": "2"}] * n,
                column: media,
            }
        )

    png = [{"bytes": b"\x89PNG", "path": None}]
    off = ["trainer.val_before_train=false", "trainer.test_freq=-1"]
    late = tmp_path / "late.parquet"
    frame("images", [[], [], png, []]).to_parquet(late)
    cfg = load_config(None, [f"data.train_files={late}", *off])
    (line,) = input_problems(cfg, [DATA, ROWS])
    assert line.startswith(
        f"data files: {late} holds images (column 'images', data.image_key; first in row 2)"
    )
    # the learner's own check (no ROWS) reads the first row only, as before
    assert input_problems(cfg, [DATA]) == []
    named = tmp_path / "named.parquet"
    frame("image", [png, png]).to_parquet(named)
    plain = load_config(None, [f"data.train_files={named}", *off])
    assert input_problems(plain, [DATA, ROWS]) == []  # "image" is no media column by default
    keyed = load_config(None, [f"data.train_files={named}", "data.image_key=image", *off])
    assert keyed.data.image_key == "image"
    (line,) = input_problems(keyed, [DATA, ROWS])
    assert "holds images (column 'image', data.image_key; first in row 0)" in line
    videos = tmp_path / "videos.parquet"
    frame("clip", [None, "/data/clip.mp4"]).to_parquet(videos)
    verl = [f"data.train_files={videos}", "data.video_key=clip", *off]
    (line,) = input_problems(load_config(None, verl), [DATA, ROWS])
    assert "holds videos (column 'clip', data.video_key; first in row 1)" in line
