"""Files a run reads, checked before any role starts: a missing model or data file, or a
``trainer.resume_from_path`` that is no checkpoint, is a config error (exit 2, one line
naming the fix), not a traceback and a restart loop. What the model path and the machine
must be (a hub id is looked up in the local HF cache only) is :mod:`asyncrl.config.machine`'s.
"""

from __future__ import annotations

import netrc
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from asyncrl.config.data import val_files_problem
from asyncrl.config.load import ConfigError
from asyncrl.config.machine import cores_problem, data_hint, device_problem, model_problem
from asyncrl.config.media import media_problem
from asyncrl.config.schema import Config
from asyncrl.config.verl_checkpoints import latest_verl_step, resume_path_line, verl_step

if TYPE_CHECKING:
    from pyarrow.parquet import ParquetFile

# What a role reads before it can work: weights and tokenizer, the prompts (the learner's
# coordinator), the user's scoring file (the rollout servers' reward workers), the
# checkpoint trainer.resume_mode=resume_path starts from (the learner).
MODEL, DATA, REWARD, RESUME = "model", "data", "reward", "resume"
LOGGER = "logger"  # W&B, when trainer.logger names it: a key, or an offline mode
# This machine: the cores launch.cpus pins roles to (the launcher), the learner's device.
CORES, DEVICE = "cores", "device"
# Every data row, not only the first (the launcher's check, before any role starts; a
# learner reads every row itself at start, with the same lines, and does not read twice).
ROWS = "rows"
#: The file every complete learner checkpoint holds (``checkpoints/step_<n>/``); here, not in
#: ``learner.checkpoint``, so the launcher checks a resume path without importing torch.
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
#: A checkpoint folder's entry: ``step_<n>``, or a save in progress (``.tmp``) or being
#: replaced (``.old``).
STEP_ENTRY = re.compile(r"^step_(\d+)(\.tmp|\.old)?$")
#: Where a rewind to step ``k`` moves the run's later checkpoints (the branch left behind).
ABANDONED_DIR = "abandoned_after_step_{step}"
_ABANDONED = re.compile(r"^abandoned_after_step_(\d+)(?:\.\d+)?$")


def resume_problem(path: str) -> str | None:
    """Why ``path`` is not a checkpoint a learner can resume from (None if it is): it must
    be one ``checkpoints/step_<n>`` directory, the one holding :data:`STATE_FILE`."""
    local = Path(path).expanduser()
    if (local / STATE_FILE).is_file():
        return _abandoned_problem(path, local)
    fix = f"point it at checkpoints/step_N, which holds {STATE_FILE}"
    if local.name == STATE_FILE and local.is_file():
        return f"trainer.resume_from_path={path} is the checkpoint's state file: give its folder, {local.parent}"
    if not local.exists():
        return f"trainer.resume_from_path={path} does not exist: {fix}"
    # A checkpoints folder (or a run directory) given for one of its checkpoints: name it.
    folders = [f for f in (local, local / "checkpoints") if f.is_dir()]
    steps = {
        int(m.group(1)): s
        for f in folders
        for s in f.iterdir()
        if (m := _STEP_DIR.match(s.name)) and (s / STATE_FILE).is_file()
    }
    if steps:
        fix = f"point it at one of the checkpoints it holds, e.g. {steps[max(steps)]}"
    elif (step := verl_step(local.resolve()) or latest_verl_step(local)) is not None:
        return resume_path_line(path, step)
    return f"trainer.resume_from_path={path} is not a checkpoint (no {STATE_FILE}): {fix}"


def _abandoned_problem(path: str, local: Path) -> str | None:
    """A checkpoint of a branch its run left behind at a rewind is refused: resumed in
    place, the run would write the abandoned branch's steps among the live branch's
    checkpoints and records, and a restart (``auto``) would resume the live branch."""
    for folder in local.resolve().parents:
        if (m := _ABANDONED.match(folder.name)) and folder.parent.name == "checkpoints":
            return (
                f"trainer.resume_from_path={path} is in {folder.name}, a branch its run left "
                f"behind at a rewind to step {m.group(1)}: to go on with that branch, move its "
                f"step_N folders back into {folder.parent} (moving the ones after step "
                f"{m.group(1)} out) and resume from there, or copy the checkpoint out of the "
                "run directory to start a new run from it"
            )
    return None


def scan_checkpoints(root: Path) -> tuple[dict[int, Path], list[Path]]:
    """The complete checkpoints under ``root`` (a run's ``checkpoints/``) by step, and the
    folders skipped as incomplete (a ``.tmp``, or no state file: a save cut short). A
    ``step_<n>.old`` counts only while ``step_<n>`` is missing: a re-save of step n killed
    between its renames."""
    complete: dict[int, Path] = {}
    olds: dict[int, Path] = {}
    skipped: list[Path] = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not (m := STEP_ENTRY.match(p.name)) or not p.is_dir():
            continue
        whole = (p / STATE_FILE).is_file()
        if m.group(2) is None and whole:
            complete[int(m.group(1))] = p
        elif m.group(2) == ".old" and whole:
            olds[int(m.group(1))] = p
        elif m.group(2) != ".old":
            skipped.append(p)
    return {**olds, **complete}, skipped


def input_problems(cfg: Config, needs: Iterable[str]) -> list[str]:
    """One line per file a role needs (``needs``: :data:`MODEL`, :data:`DATA`,
    :data:`REWARD`, :data:`RESUME`) that is not there; empty when everything is."""
    needs = set(needs)
    problems: list[str] = []
    if CORES in needs and (problem := cores_problem(cfg)) is not None:
        problems.append(problem)
    if DEVICE in needs and (problem := device_problem(cfg)) is not None:
        problems.append(problem)
    if MODEL in needs and (problem := model_problem(cfg.model.path)) is not None:
        problems.append(problem)
    critic = cfg.critic.model.path if cfg.algorithm.adv_estimator == "gae" else None
    if MODEL in needs and critic and (problem := model_problem(critic, "critic.model.path")):
        problems.append(problem)  # else found after the actor loaded, and restarted for ever
    if DATA in needs:
        validating = cfg.trainer.val_before_train or cfg.trainer.test_freq > 0
        if validating and (problem := val_files_problem(cfg.data)) is not None:
            problems.append(problem)
        for key in ("train_files", "val_files") if validating else ("train_files",):
            for f in getattr(cfg.data, key):
                if "://" in f:  # hdfs://, s3://: veRL copies those to a local folder first
                    problems.append(
                        f"data.{key}: {f} is a remote address: copy the files to a folder "
                        "every role can read (the same path on every machine) and give that"
                    )
                elif not Path(f).expanduser().exists():
                    problems.append(f"data.{key}: {f} does not exist: {data_hint(f)}")
        if not problems:
            problems += _column_problems(cfg, validating, every_row=ROWS in needs)
        if not problems:
            try:
                steps = total_training_steps(cfg)
            except ConfigError as e:
                problems.extend(e.problems)
            else:
                if (empty := _no_batch(cfg)) is not None:
                    problems.append(empty)
                warmup = cfg.trainer.critic_warmup
                if cfg.trainer.total_training_steps is None and warmup > steps:
                    problems.append(
                        f"trainer.critic_warmup={warmup} is past the {steps} steps "
                        "trainer.total_training_steps=null counts from the data: the actor "
                        "would never train; lower trainer.critic_warmup"
                    )
    if REWARD in needs:
        scorer = cfg.reward.custom_reward_function.path
        if scorer and not Path(scorer).expanduser().is_file():
            problems.append(
                f"reward.custom_reward_function.path={scorer} does not exist: give the "
                "Python file that defines your scoring function"
            )
        mt = cfg.rollout.multi_turn
        if mt.enable and mt.tool_config_path and not Path(mt.tool_config_path).is_file():
            problems.append(
                f"rollout.multi_turn.tool_config_path={mt.tool_config_path} does not exist: "
                "give the YAML naming the tools (configs/tools/calculator.yaml is one)"
            )
        elif mt.enable and mt.tool_config_path:  # a server would refuse it at its start
            from asyncrl.tools.config import launch_problems

            problems += launch_problems(mt.tool_config_path)
        oe = cfg.rollout.openai_endpoint
        scored_here = not (oe.enable and not oe.take_tasks)  # else agents send the rewards
        if DATA in needs and scored_here and not scorer and not problems:
            problems += _source_problems(cfg)
    if LOGGER in needs and (problem := wandb_problem(cfg)) is not None:
        problems.append(problem)
    # Only resume_path starts from it for sure (auto falls back to it when the run has no
    # checkpoint yet; the learner checks that case itself, before it moves anything).
    resume = cfg.trainer.resume_from_path
    wanted = RESUME in needs and cfg.trainer.resume_mode == "resume_path"
    if wanted and resume and (problem := resume_problem(resume)) is not None:
        problems.append(problem)
    return problems


def _column_problems(cfg: Config, validating: bool, every_row: bool) -> list[str]:
    """The data files whose columns are not veRL's layout (read from their footers), or
    holding a row that is not a task (as the learner's read would say; the first row only
    unless ``every_row``), one line each."""
    d = cfg.data
    val = d.val_files if validating else []
    media = (d.image_key, d.video_key)
    out = []
    for f in [*d.train_files, *val]:
        if (problem := _file_problem(f, d.prompt_key, f in val, every_row, media)) is not None:
            out.append(problem)
    return out


def _file_problem(
    f: str,
    prompt_key: str,
    validation: bool,
    every_row: bool,
    media: tuple[str, ...] = ("images", "videos"),
) -> str | None:
    """Why one data file cannot be read as tasks (None: it can). At launch (``every_row``)
    every row is checked, not only the first: a bad row found by the learner fails the run
    after every role has started. ``media``: the columns of veRL's pictures and videos
    (``data.image_key``, ``data.video_key``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.tasks.parquet import column_problem

    path = Path(f).expanduser()
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowException) as e:
        return f"data files: {f} is not a parquet file ({e})"
    if (problem := column_problem(names, f, prompt_key)) is not None:
        return problem
    try:  # a footer that reads can still front damaged pages
        file = pq.ParquetFile(path)
        if (problem := _rows_problem(file, path, prompt_key, every_row)) is not None:
            return problem
        if (problem := media_problem(file, f, media, every_row)) is not None:
            return problem
    except (OSError, pa.ArrowException) as e:
        return f"data files: {f} cannot be read ({e}): write it again"
    if validation and file.metadata.num_rows == 0:
        return (
            f"data.val_files: {f} has no rows, so validation would never report: add "
            "rows, or set trainer.val_before_train=false trainer.test_freq=-1"
        )
    return None


#: The columns :func:`~asyncrl.tasks.parquet.row_problem` reads besides the prompt: only
#: these are read at launch, a batch at a time (the rest may be large and is not checked).
_ROW_COLUMNS = ("data_source", "reward_model", "extra_info", "agent_name")
_ROWS_PER_BATCH = 4096


def _rows_problem(
    file: ParquetFile, path: Path, prompt_key: str, every_row: bool = True
) -> str | None:
    """The first row of ``file`` that is not a task, in the line the learner's read of the
    file (:func:`~asyncrl.tasks.parquet.read_rows`) gives for it; None when every row is
    (with ``every_row`` off, when the first is)."""
    from asyncrl.tasks.parquet import row_problem

    names = file.schema_arrow.names
    columns = [c for c in dict.fromkeys((prompt_key, *_ROW_COLUMNS)) if c in names]
    number = 0
    size = _ROWS_PER_BATCH if every_row else 1
    for batch in file.iter_batches(batch_size=size, columns=columns):
        for row in batch.to_pylist():
            if (problem := row_problem(row, number, path, prompt_key)) is not None:
                return problem
            number += 1
        if not every_row:
            break
    return None


def _source_problems(cfg: Config) -> list[str]:
    """The data's ``data_source`` values no built-in scorer knows, when no custom scorer is
    set: every sample of theirs would score 0 (as veRL, which stops at the first)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.rewards.registry import KNOWN_DATA_SOURCES

    validating = cfg.trainer.val_before_train or cfg.trainer.test_freq > 0
    unknown: dict[str, str] = {}  # data source -> the first file it is in
    for f in [*cfg.data.train_files, *(cfg.data.val_files if validating else [])]:
        try:
            table = pq.read_table(Path(f).expanduser(), columns=["data_source"])
        except (OSError, pa.ArrowException, KeyError):  # named by the column check
            continue
        for source in table.column(0).unique().to_pylist():
            if source is not None and str(source) not in KNOWN_DATA_SOURCES:  # null: a row
                unknown.setdefault(str(source), f)
    if not unknown:
        return []
    named = ", ".join(f"{s!r} ({f})" for s, f in list(unknown.items())[:3])
    return [
        f"data_source {named} has no built-in scorer (known: {', '.join(KNOWN_DATA_SOURCES)}): "
        "set reward.custom_reward_function.path to a Python file defining "
        "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
    ]


def training_rows(cfg: Config) -> int:
    """Rows in ``data.train_files``, from the parquet footers (no row is read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 0
    for f in cfg.data.train_files:
        try:
            rows += pq.ParquetFile(f).metadata.num_rows
        except (OSError, pa.ArrowException) as e:
            raise ConfigError([f"data.train_files: {f} is not a parquet file ({e})"]) from None
    return rows


def wandb_problem(cfg: Config) -> str | None:
    """Why W&B would refuse to start (``trainer.logger`` names it, online, with no API key
    in the environment or ``~/.netrc``), or None. Checked without the network."""
    if "wandb" not in cfg.trainer.logger:
        return None
    if os.environ.get("WANDB_MODE", "online") in ("offline", "disabled", "dryrun"):
        return None
    if os.environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        if netrc.netrc().authenticators(host) is not None:
            return None
    except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one W&B cannot read either
        pass
    return (
        "trainer.logger includes wandb, but W&B has no API key here: run `wandb login` or set "
        "WANDB_API_KEY, or set WANDB_MODE=offline (its files stay in the run directory; "
        "`wandb sync` uploads them later)"
    )


def _no_batch(cfg: Config) -> str | None:
    """Why a run with a given ``trainer.total_training_steps`` would train nothing: all its
    epochs of rows make no batch (a run that could not train reported success, at step
    0)."""
    if cfg.trainer.total_training_steps is None:  # total_training_steps() says it then
        return None
    rows, steps = _data_steps(cfg)
    if steps > 0:
        return None
    if rows == 0:
        return "data.train_files hold no rows: give files with training rows"
    return (
        f"the {rows} rows of data.train_files, dealt trainer.total_epochs="
        f"{cfg.trainer.total_epochs} times, make no batch of data.train_batch_size="
        f"{cfg.data.train_batch_size}: the run would train nothing; lower it, add rows, or "
        "raise trainer.total_epochs"
    )


def short_data_line(cfg: Config) -> str | None:
    """When the data runs out before ``trainer.total_training_steps``: the run ends where it
    does, as veRL's does (one line naming the fix, for the launcher's console)."""
    total = cfg.trainer.total_training_steps
    if total is None:
        return None
    rows, steps = _data_steps(cfg)
    if steps >= total or steps == 0:
        return None
    return (
        f"the data makes about {steps} steps ({rows} rows, trainer.total_epochs="
        f"{cfg.trainer.total_epochs}, data.train_batch_size={cfg.data.train_batch_size}), "
        f"fewer than trainer.total_training_steps={total}: the run ends where the data does, "
        "as veRL's does; raise trainer.total_epochs to train them all"
    )


def _data_steps(cfg: Config) -> tuple[int, int]:
    """The training rows, and the batches all their epochs make: batches run on across
    epochs here, so rows times epochs is what counts."""
    rows = training_rows(cfg)
    return rows, rows * cfg.trainer.total_epochs // cfg.data.train_batch_size


def total_training_steps(cfg: Config) -> int:
    """``trainer.total_training_steps``, or when it is null, as veRL counts them: the whole
    batches in the training rows, times ``trainer.total_epochs``. Raises
    :class:`ConfigError` when the rows make no batch."""
    if cfg.trainer.total_training_steps is not None:
        return cfg.trainer.total_training_steps
    rows = training_rows(cfg)
    steps = rows // cfg.data.train_batch_size * cfg.trainer.total_epochs
    if steps == 0:
        raise ConfigError(
            [
                f"trainer.total_training_steps=null: the {rows} rows of data.train_files make no "
                f"batch of data.train_batch_size={cfg.data.train_batch_size}; lower it, or add rows"
            ]
        )
    return steps
