"""Role commands: instant --help, bad configs fail before any heavy import, and the import
boundaries between roles (docs/DESIGN.md section 2) hold in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import BIN, run_cli
from tests.helpers import endpoint_overrides

ROLES = ["asyncrl-launch", "asyncrl-rollout", "asyncrl-buffer", "asyncrl-learner"]


@pytest.mark.parametrize("command", [*ROLES, "asyncrl-prepare", "asyncrl-launch --ray"])
def test_help_is_instant(command):
    start = time.monotonic()
    name, *options = command.split()
    proc = subprocess.run([str(BIN / name), *options, "--help"], capture_output=True, text=True)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    assert elapsed < 5, f"{command} --help took {elapsed:.1f}s (heavy import before parsing?)"


def test_a_command_line_of_overrides_alone_needs_no_config_file():
    """veRL's command lines name no file: ``asyncrl-launch data.train_files=... a.b=1``
    (it was refused as "config file data.train_files=... not found")."""
    from asyncrl.cli import parse_role_args

    cfg, args = parse_role_args(
        "asyncrl-launch", "", None, ["actor_rollout_ref.rollout.n=4", "data.train_batch_size=32"]
    )
    assert args.config is None and (cfg.rollout.n, cfg.data.train_batch_size) == (4, 32)
    with pytest.raises(SystemExit):  # a file that is not there is still named
        parse_role_args("asyncrl-launch", "", None, ["missing.yaml", "rollout.n=4"])


@pytest.mark.parametrize("command", ROLES)
def test_help_lists_config_keys(command):
    out = subprocess.run([str(BIN / command), "--help"], capture_output=True, text=True).stdout
    assert "endpoints.host" in out  # every role talks to the others
    if command == "asyncrl-rollout":  # keys a server must share with the learner
        assert "staleness.max_policy_lag" in out and "algorithm.adv_estimator" in out
        assert "buffer.max_message_mb" in out
        assert "launch.start_timeout_s" in out  # how long it waits for the coordinator
    if command == "asyncrl-buffer":
        assert "control.max_message_mb" in out
    assert "override any as group.key=value" in out


def test_options_and_overrides_mix_in_any_order():
    from asyncrl.cli import role_parser

    parser = role_parser("asyncrl-rollout", "", None, lambda p: p.add_argument("--server-id"))
    for argv in (
        ["c.yaml", "--server-id", "r0", "a.b=1", "c=2"],
        ["c.yaml", "a.b=1", "--server-id", "r0", "c=2"],
    ):
        args = parser.parse_intermixed_args(argv)
        assert (args.config, args.server_id, args.overrides) == ("c.yaml", "r0", ["a.b=1", "c=2"])
    assert parser.parse_intermixed_args(["c.yaml", "--log-level", "debug"]).log_level == "DEBUG"


def test_a_bad_log_level_is_one_line_not_a_traceback(capsys):
    """``--log-level foo`` was a ``ValueError`` traceback from logging, after parsing."""
    from asyncrl.cli import parse_role_args

    with pytest.raises(SystemExit) as e:
        parse_role_args("asyncrl-buffer", "", None, ["c.yaml", "--log-level", "foo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'FOO'" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ROLES)
def test_bad_config_fails_fast_with_the_fix(command):
    proc = subprocess.run(
        [str(BIN / command), "configs/cpu_demo.yaml", "rollout.temprature=0.5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "did you mean rollout.temperature?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_launch_refuses_missing_files_before_starting_any_role(tmp_path):
    """A missing model or data file is a config error the launcher finds itself: exit 2 with
    the fix, and no role started (no restart loop around a typo)."""
    proc = subprocess.run(
        [
            str(BIN / "asyncrl-launch"),
            "configs/cpu_demo.yaml",
            f"trainer.default_local_dir={tmp_path}",
            f"model.path={tmp_path}/no-such-model",
            f"data.train_files={tmp_path}/none.parquet",
            *endpoint_overrides(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"model.path={tmp_path}/no-such-model does not exist" in proc.stderr
    assert "asyncrl-prepare model --name tiny --out" in proc.stderr
    assert f"data.train_files: {tmp_path}/none.parquet does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and "started" not in proc.stderr
    assert not (tmp_path / "asyncrl").exists()


def test_launch_refuses_what_only_its_machine_can_check(
    tiny_model, arithmetic_data, tmp_path, capsys
):
    """Every role of a local launch runs here: CURVE keys missing from endpoints.keys_dir,
    or a CUDA learner on a machine without CUDA, are refused before any role starts (each
    role refused them itself, after the launch had started them all)."""
    from asyncrl.launch.local import main

    base = [
        "configs/cpu_demo.yaml",
        f"trainer.default_local_dir={tmp_path}",
        f"model.path={tiny_model}",
        f"data.train_files={arithmetic_data / 'train.parquet'}",
        f"data.val_files={arithmetic_data / 'val.parquet'}",
        *endpoint_overrides(),
    ]
    keys = ["endpoints.auth=curve", f"endpoints.keys_dir={tmp_path}/keys"]
    assert main([*base, *keys]) == 2
    assert "missing" in capsys.readouterr().err and not (tmp_path / "asyncrl").exists()
    from asyncrl.config import load_config
    from asyncrl.net.security import keys_problem, write_keys

    endpoints = load_config(None, keys).endpoints
    write_keys(tmp_path / "keys")  # what asyncrl-prepare keys writes will do
    assert keys_problem(endpoints) is None
    (tmp_path / "keys" / "buffer.key_secret").unlink()
    assert "buffer.key_secret" in str(keys_problem(endpoints))
    import torch

    if not torch.cuda.is_available():
        assert main([*base, "trainer.device=cuda"]) == 2
        assert "finds no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "asyncrl").exists()


def test_launch_fails_fast_with_the_failing_roles_log(tmp_path):
    """A role that keeps failing at start ends the whole launch once its restarts are spent,
    with its last log lines shown; the resolved config and every role's command line are in
    the run directory."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # passes the file check, fails to load
    (broken / "model.safetensors").write_bytes(b"not weights")
    from asyncrl.tasks import prepare_task_data

    prepare_task_data("arithmetic", tmp_path / "data", seed=0, n_train=8, n_val=2)
    rows = tmp_path / "data" / "train.parquet"
    start = time.monotonic()
    proc = subprocess.run(
        [
            str(BIN / "asyncrl-launch"),
            "configs/cpu_demo.yaml",
            f"trainer.default_local_dir={tmp_path}",
            "staleness.max_policy_lag=4",
            f"model.path={broken}",
            f"data.train_files={rows}",
            f"data.val_files={rows}",
            "launch.max_restarts=1",
            *endpoint_overrides(),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode not in (0, None)
    assert time.monotonic() - start < 200
    assert "giving up; last lines of" in proc.stderr, proc.stderr[-3000:]
    run = tmp_path / "asyncrl" / "cpu_demo"
    events = [json.loads(line) for line in (run / "launch.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "gave_up"], events
    assert "max_policy_lag: 4" in (run / "config.yaml").read_text()
    commands = (run / "commands.txt").read_text()
    for role in ("buffer", "rollout-0", "rollout-1", "learner"):
        assert f"{role}:" in commands
    assert not list(run.glob("checkpoints/*"))


LIGHT = [
    "asyncrl",
    "asyncrl.config",
    "asyncrl.cli",
    "asyncrl.tasks",
    "asyncrl.rewards",
    "asyncrl.wire",
    "asyncrl.net.transport",
    "asyncrl.control",
    "asyncrl.launch",
    "buffer.service",
]


@pytest.mark.parametrize("module", LIGHT)
def test_light_modules_do_not_import_torch_or_vllm(module):
    code = (
        f"import sys, {module}; "
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import {module} pulled in {out.stdout.strip()}"


@pytest.mark.parametrize(
    ("role", "forbidden"),
    [
        ("buffer.main", ("learner", "rollout_servers", "torch", "vllm")),
        ("rollout_servers.main", ("learner", "buffer")),
        ("learner.main", ("rollout_servers", "buffer", "vllm")),
    ],
)
def test_roles_do_not_import_each_other(role, forbidden):
    code = f"import sys, {role}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{role} imports {out.stdout.strip()}"


def test_launching_a_finished_run_again_says_so_and_starts_nothing(
    tiny_model, arithmetic_data, tmp_path
):
    """The same command run again after a run ended would resume its last checkpoint
    (``resume_mode=auto``): the launcher says the run is complete and how to train again,
    and exits 0 without starting a role (a walkthrough's rerun started every role, then
    the learner sat 5 minutes on validation rounds)."""
    run = tmp_path / "asyncrl" / "cpu_demo"
    (run / "checkpoints" / "step_6").mkdir(parents=True)
    (run / "checkpoints" / "step_6" / "trainer_state.json").write_text("{}")
    (run / "complete.json").write_text('{"step": 6}')  # what an ended run's learner writes
    args = [
        "configs/cpu_demo.yaml",
        f"trainer.default_local_dir={tmp_path}",
        f"model.path={tiny_model}",
        f"data.train_files={arithmetic_data}/train.parquet",
        f"data.val_files={arithmetic_data}/val.parquet",
        *endpoint_overrides(),
    ]
    proc = run_cli("asyncrl-launch", *args, "trainer.total_training_steps=6", timeout=60)
    assert "this run is complete (its last checkpoint is at step 6 of 6)" in proc.stderr
    assert "trainer.resume_mode=disable" in proc.stderr
    assert not (run / "logs").exists() and not (run / "config.yaml").exists()
    # More steps asked for, or a start that does not resume: the run is not complete.
    from asyncrl.config import load_config
    from asyncrl.config.ending import finished_step

    assert finished_step(load_config(args[0], [*args[1:], "trainer.total_training_steps=6"])) == 6
    for more in (["trainer.total_training_steps=7"], ["trainer.resume_mode=disable"]):
        assert finished_step(load_config(args[0], [*args[1:], *more])) is None, more
    # Cut short in its ending (killed after the final checkpoint): the learner finishes it.
    (run / "complete.json").unlink()
    assert (
        finished_step(load_config(args[0], [*args[1:], "trainer.total_training_steps=6"])) is None
    )


def test_a_rollout_server_whose_scorer_does_not_load_exits_2_before_its_engine(
    tiny_model, tmp_path
):
    """A reward file without the function named (or one that fails to import) fails every
    restart the same way: the server says so in one line and exits 2 (not restarted),
    before it spends its start-up on the engine. A walkthrough saw three restarts per
    server, each with a traceback."""
    scorer = tmp_path / "my_reward.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    proc = _start_server(
        tiny_model,
        tmp_path,
        f"custom_reward_function.path={scorer}",
        "custom_reward_function.name=nope",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot start:" in proc.stderr and "has no function 'nope'" in proc.stderr
    assert "custom_reward_function.name" in proc.stderr and "Traceback" not in proc.stderr


def test_a_tool_that_does_not_load_stops_its_server_before_the_engine(tiny_model, tmp_path):
    """A tool config whose class cannot be imported failed after the engine had started,
    with a traceback and exit 1: the launcher restarted the server (and its engine) until
    out of restarts. It is now one line and exit 2, before the engine."""
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        "tools:\n"
        "  - class_name: mytools.py:Missing\n"
        "    config: {type: native}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function: {name: add, description: add, parameters: {type: object}}\n"
    )
    (tmp_path / "mytools.py").write_text("class Other:\n    pass\n")
    proc = _start_server(
        tiny_model,
        tmp_path,
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={tools}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot start:" in proc.stderr and "Missing" in proc.stderr
    assert "Traceback" not in proc.stderr and "engine_ready" not in proc.stderr


def _start_server(tiny_model, tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """A rollout server of the demo's config with ``overrides``, run to its exit."""
    args = ["configs/cpu_demo.yaml", f"trainer.default_local_dir={tmp_path}"]
    args += [f"model.path={tiny_model}", *overrides, *endpoint_overrides()]
    return subprocess.run(
        [sys.executable, "-m", "rollout_servers.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
