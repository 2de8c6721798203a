"""The launcher's supervision: the restart policy, and on real process trees (stand-in
roles, not vLLM) that a dead role's whole tree is killed before it restarts, that a run
fails only when a role's restarts are used up, and that nothing outlives the launcher; the
real launcher stops only what it started, gently then firmly, on SIGTERM (twice, too). The
progress and summary lines are tested in ``tests/test_launch_progress.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.launch.process_tree import find_tree, has_exited, signal_group
from asyncrl.launch.progress import read_restarts
from asyncrl.launch.supervise import RestartPolicy, Role, Supervisor, exit_status, restart_delay
from asyncrl.sandbox.proc_table import scan
from tests.helpers import alive, endpoint_overrides, wait_until


def processes_of_run(run_dir: Path) -> list[int]:
    """Live processes of the latest launch in ``run_dir`` (from ``launch.jsonl``): the
    sessions of every role it started and whatever carries its marker; empty once the
    launcher is gone and left nothing behind."""
    launch_id, roots = None, set()
    for line in (Path(run_dir) / "launch.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "launch":
            launch_id, roots = event["launch_id"], set()
        elif event["event"] == "start":
            roots.add(event["pid"])
    prefix = f"{launch_id} "
    match = (lambda m: m.startswith(prefix)) if launch_id is not None else None
    return sorted(find_tree(scan(), roots, match))


def test_sigterm_stops_every_role_it_started(tmp_path):
    # Files that pass the launcher's check: the roles only need to start before the signal.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    from asyncrl.tasks import prepare_task_data

    prepare_task_data("arithmetic", tmp_path / "data", seed=0, n_train=8, n_val=2)
    inputs = [
        f"model.path={tmp_path}/model",
        f"data.train_files={tmp_path}/data/train.parquet",
        f"data.val_files={tmp_path}/data/val.parquet",
    ]
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.launch",
            "configs/cpu_demo.yaml",
            f"trainer.default_local_dir={tmp_path}",
            *inputs,
            *endpoint_overrides(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids: dict[str, int] = {}
    try:
        while len(pids) < 4:  # buffer, two rollout servers, learner
            line = proc.stdout.readline()
            assert line, "launcher ended before starting its roles"
            if m := re.search(r"started (\S+) \(pid (\d+)\)", line):
                pids[m.group(1)] = int(m.group(2))
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # impatience must not leave roles behind
        assert proc.wait(60) == 143  # 128 + SIGTERM, as a shell reports it
        assert "stopped before the first checkpoint: the same command starts the run over" in (
            proc.stdout.read()
        )
        wait_until(lambda: not [n for n, p in pids.items() if alive(p)], "the roles to stop", 10)
        run = json.loads((tmp_path / "asyncrl" / "cpu_demo" / "pids.json").read_text())
        assert run["roles"] == {name: None for name in pids}  # each reaped
        assert not processes_of_run(tmp_path / "asyncrl" / "cpu_demo")  # nor what they started
        events = (tmp_path / "asyncrl" / "cpu_demo" / "launch.jsonl").read_text().splitlines()
        stopped = {
            e["role"]
            for e in map(json.loads, events)
            if e["event"] == "exit" and e.get("stopped_by") == "launcher"
        }
        assert stopped == set(pids), events  # every exit recorded, a stop's too
        assert bystander.poll() is None  # nothing it did not start
    finally:
        bystander.kill()
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------- restart policy (pure)


def test_restart_delay_doubles_and_runs_out_within_the_window():
    policy = RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=2.0)
    assert restart_delay(policy, [], now=1000.0) == 2.0
    assert restart_delay(policy, [950.0], now=1000.0) == 4.0
    assert restart_delay(policy, [950.0, 990.0], now=1000.0) == 8.0
    assert restart_delay(policy, [950.0, 960.0, 990.0], now=1000.0) is None  # used up
    # A restarted process that ran the window through starts the row over.
    assert restart_delay(policy, [800.0, 850.0, 990.0], now=1000.0) == 4.0
    assert restart_delay(policy, [800.0, 850.0, 899.0], now=1000.0) == 2.0
    # max_restarts 0: the first death ends the run (the launcher's old behaviour).
    assert restart_delay(RestartPolicy(0, 100.0, 2.0), [], now=0.0) is None


def test_a_role_that_dies_the_same_way_after_minutes_runs_out_of_restarts():
    """Found by a review: restarts were counted within the window, so a role living 200 s
    before each crash (a model that loads for minutes, then fails alike) never had three in
    600 s and was restarted for ever; so was one with a backoff near the window."""
    policy = RestartPolicy(max_restarts=3, window_s=600.0, backoff_s=2.0)
    starts, died = [], 0.0
    for _ in range(3):  # each restarted process runs 200 s
        delay = restart_delay(policy, starts, now=died)
        assert delay is not None
        starts.append(died + delay)
        died = starts[-1] + 200.0
    assert restart_delay(policy, starts, now=died) is None
    slow = RestartPolicy(max_restarts=3, window_s=600.0, backoff_s=500.0)
    assert restart_delay(slow, [], now=0.0) == 300.0  # at most half the window
    assert restart_delay(slow, [300.0, 601.0, 902.0], now=903.0) is None


def test_exit_status_reads_like_a_shell():
    assert exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 137
    assert exit_status(-signal.SIGTERM) == 143


def test_the_learner_restarts_from_its_last_checkpoint():
    learner = Role("learner", ["learner", "config.yaml"], restart_args=["trainer.resume_mode=auto"])
    assert learner.command() == ["learner", "config.yaml"]
    learner.attempt = 1  # it was started once
    assert learner.command() == ["learner", "config.yaml", "trainer.resume_mode=auto"]


# ---------------------------------------------------------------- real process trees

# A stand-in role: it starts a child in its own session, a child in a new session (which
# starts a child of its own) and a child in a new session without the run's marker in its
# environment (as vLLM's renamed engine core shows it), records the pids of the five, then
# follows its plan for this
# attempt ("run": sleep; "exit:N": exit N; "kill": SIGKILL itself; "wait:NAME": exit 0 once
# the file NAME exists; "end:S": record the run's ending as a learner does, exit 0 S s later). Plans are comma-separated, one per attempt, the last one repeated;
# arguments after the plan (a restarted role's extra arguments) are recorded too, and so are
# the processes of its previous attempt still alive when it started.
TOY_ROLE = r"""
import json, os, signal, subprocess, sys, time
from pathlib import Path

state, name, plans, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4:]
count = state / f"{name}.attempts"
attempt = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(attempt))
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
before = state / f"{name}.{attempt - 1}.json"
old = json.loads(before.read_text()) if before.exists() else {"role": 0, "tree": []}
left_over = [p for p in [old["role"], *old["tree"]] if p and alive(p)]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
same = subprocess.Popen(sleeper)
spawner = "import subprocess, sys, time; c = subprocess.Popen(sys.argv[1:]); print(c.pid, flush=True); time.sleep(600)"
escaped = subprocess.Popen([sys.executable, "-c", spawner, *sleeper], start_new_session=True,
                           stdout=subprocess.PIPE, text=True)
nested = int(escaped.stdout.readline())
hidden = subprocess.Popen(sleeper, start_new_session=True, env={})  # no session, no marker
record = {"role": os.getpid(), "tree": [same.pid, escaped.pid, nested, hidden.pid], "extra": extra,
          "left_over": left_over}
(state / f"{name}.{attempt}.json").write_text(json.dumps(record))
plan = plans[min(attempt, len(plans)) - 1]
print(f"{name} attempt {attempt}: {plan}", flush=True)
if plan.startswith("exit:"):
    sys.exit(int(plan[5:]))
if plan == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if plan.startswith("end:"):
    (state / "complete.json").write_text('{"step": 1}\n')
    time.sleep(float(plan[4:]))
    sys.exit(0)
while plan == "run" or not (state / plan[5:]).exists():
    time.sleep(0.05)
"""

# Runs the supervisor (subreaper and watchdog included) over stand-in roles, as the launcher
# does: argv is the run directory, the stand-in's path and a JSON spec.
DRIVER = r"""
import json, logging, sys
from pathlib import Path
from asyncrl.launch import supervise
from asyncrl.launch.supervise import QuietView, RestartPolicy, Role, Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
run_dir, toy, spec = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
supervise.STOP_GRACE_S, supervise.POLL_S = spec.get("grace_s", 2.0), 0.1
supervise.AFTER_LEARNER_S = 0.5  # stand-ins are not told that the run is over
supervise.EARLY_EXIT_GRACE_S = spec.get("early_grace_s", 0.5)
roles = [Role(name, [sys.executable, toy, str(run_dir), name, plan], restart_args=extra,
              server_id=name if name.startswith("rollout") else None)  # as plan_roles
         for name, plan, extra in spec["roles"]]
sup = Supervisor(roles, run_dir, RestartPolicy(**spec["policy"]))
try:
    sup.begin()
    sup.start_all()
    code = sup.run(QuietView())
finally:
    sup.close()
sys.exit(code)
"""


def _tree(state: Path, name: str, attempt: int) -> dict:
    """The tree the toy role wrote, once written whole (seen in CI: read while empty)."""
    path = state / f"{name}.{attempt}.json"

    def whole() -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    return wait_until(whole, f"{name} attempt {attempt}")


@pytest.fixture
def toy(tmp_path) -> Path:
    path = tmp_path / "toy_role.py"
    path.write_text(TOY_ROLE)
    return path


def test_a_role_killed_with_sigkill_takes_its_whole_tree_and_runs_again(tmp_path, toy):
    """In this process (no subreaper): what is left of a SIGKILLed role, its session and
    the child that started a session of its own, is killed; the role starts again."""
    role = Role("rollout-0", [sys.executable, str(toy), str(tmp_path), "rollout-0", "run"])
    sup = Supervisor([role], tmp_path, RestartPolicy())
    (tmp_path / "logs").mkdir()
    sup.start(role)
    first = _tree(tmp_path, "rollout-0", 1)
    assert first["role"] == role.proc.pid and all(alive(p) for p in first["tree"])
    sup._track()  # the supervisor's look at its roles' trees, once per second in a run
    os.kill(role.proc.pid, signal.SIGKILL)
    wait_until(lambda: has_exited(role.proc.pid), "the role to die")
    assert all(alive(p) for p in first["tree"])  # killing the role alone leaves its tree
    assert sup.reap(role) == -signal.SIGKILL and role.proc is None
    assert not [p for p in [first["role"], *first["tree"]] if alive(p)]

    sup.start(role)  # a restart: a new process, running, with a tree of its own
    second = _tree(tmp_path, "rollout-0", 2)
    assert second["role"] == role.proc.pid != first["role"] and alive(role.proc.pid)
    assert json.loads((tmp_path / "pids.json").read_text())["roles"] == {"rollout-0": role.proc.pid}
    sup._track()
    signal_group(role.proc.pid, signal.SIGTERM)
    wait_until(lambda: has_exited(role.proc.pid), "the role to stop")
    assert sup.reap(role) == -signal.SIGTERM
    assert not [p for p in [second["role"], *second["tree"]] if alive(p)]
    assert not processes_of_run(tmp_path)


@pytest.fixture
def drive(tmp_path, toy):
    """Starts the supervisor over stand-in roles; one still running at the end is killed
    (its watchdog then clears its roles)."""
    started: list[subprocess.Popen] = []

    def start(spec: dict) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(tmp_path), str(toy), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "launch.jsonl").read_text().splitlines()]


@pytest.mark.timeout(60)
def test_the_supervisor_restarts_dead_roles_and_finishes_with_the_learner(tmp_path, drive):
    """rollout-0 is killed (SIGKILL) at its first start, the learner crashes once; both are
    restarted (the learner with its resume argument) after each's tree was killed;
    rollout-1 leaves with exit 0 and is not restarted; the run ends when the learner
    exits 0, and nothing of it is left."""
    spec = {
        "policy": {"max_restarts": 2, "window_s": 60.0, "backoff_s": 0.2},
        "roles": [
            ["buffer", "run", []],
            ["rollout-0", "kill,run", []],
            ["rollout-1", "exit:0", []],
            ["learner", "exit:7,wait:rollout-0.2.json", ["--resume"]],
        ],
    }
    proc = drive(spec)
    out, _ = proc.communicate(timeout=45)
    assert proc.returncode == 0, out
    assert "restarting rollout-0 in 0.2s (it ended: killed by SIGKILL" in out
    assert "restarting learner in 0.2s (it ended: exit code 7" in out
    assert "rollout-1 exited 0: its part is done" in out
    # The first attempts' trees were gone before the second attempts started.
    for name in ("rollout-0", "learner"):
        assert (
            _tree(tmp_path, name, 1)["extra"] == [] and _tree(tmp_path, name, 2)["left_over"] == []
        )
    assert _tree(tmp_path, "learner", 2)["extra"] == ["--resume"]
    assert not (tmp_path / "rollout-1.2.json").exists()
    events = _events(tmp_path)
    restarts = [
        (e["role"], e["exit_code"], e[f"launch/restarts/{e['role']}"])
        for e in events
        if e["event"] == "restart"
    ]
    assert sorted(restarts) == [("learner", 7, 1), ("rollout-0", 137, 1)]
    assert read_restarts(tmp_path) == {"buffer": 0, "rollout-0": 1, "rollout-1": 0, "learner": 1}
    every = [
        p
        for n in ("buffer", "rollout-0", "rollout-1", "learner")
        for a in (1, 2)
        if (tmp_path / f"{n}.{a}.json").exists()
        for p in [_tree(tmp_path, n, a)["role"], *_tree(tmp_path, n, a)["tree"]]
    ]
    assert len(every) == 6 * 5 and not [p for p in every if alive(p)]
    assert not processes_of_run(tmp_path)


@pytest.mark.timeout(60)
def test_a_buffer_stopped_from_outside_mid_run_is_restarted(tmp_path, drive):
    """`kill <buffer pid>`: the buffer exits 0 on SIGTERM, as when the learner ends the
    run. A review's run hung: the launcher let it go for good and the learner waited for
    batches for ever. With the learner still running after the grace, it is a crash."""
    spec = {
        "policy": {"max_restarts": 2, "window_s": 60.0, "backoff_s": 0.2},
        "roles": [["buffer", "exit:0,run", []], ["learner", "wait:buffer.2.json", []]],
    }
    proc = drive(spec)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert re.search(r"buffer exited 0 \d+s ago while the learner still runs", out), out
    assert "restarting buffer in 0.2s (it ended: exit code 0" in out
    restarts = [(e["role"], e["exit_code"]) for e in _events(tmp_path) if e["event"] == "restart"]
    assert restarts == [("buffer", 0)]
    assert not processes_of_run(tmp_path)


@pytest.mark.timeout(60)
def test_a_buffer_stopped_by_the_ending_learner_is_not_restarted(tmp_path, drive):
    """At a run's end the learner stops the buffer, then exits 0 itself: no restart."""
    spec = {
        "policy": {"max_restarts": 2, "window_s": 60.0, "backoff_s": 0.1},
        "early_grace_s": 10.0,
        "roles": [["buffer", "exit:0", []], ["learner", "wait:buffer.1.json", []]],
    }
    proc = drive(spec)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "restarting" not in out
    assert not (tmp_path / "buffer.2.json").exists()
    assert [e["event"] for e in _events(tmp_path) if e["role"] == "buffer"] == ["start", "exit"]


@pytest.mark.timeout(60)
def test_a_buffer_let_go_while_the_learner_ends_the_run_is_not_restarted(tmp_path, drive):
    """Found by a review: the learner records the run's ending, stops the buffer, then
    closes its metrics (a W&B upload) and its process group. Past the grace, the buffer
    was restarted as after a crash; with its restarts used up, the complete run failed."""
    spec = {
        "policy": {"max_restarts": 0, "window_s": 60.0, "backoff_s": 0.1},
        "roles": [["buffer", "wait:complete.json", []], ["learner", "end:2", []]],
    }
    proc = drive(spec)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "restarting" not in out and "giving up" not in out, out
    assert [e["event"] for e in _events(tmp_path) if e["role"] == "buffer"] == ["start", "exit"]


@pytest.mark.timeout(60)
def test_a_role_out_of_restarts_fails_the_run_with_its_code_and_log(tmp_path, drive):
    spec = {
        "policy": {"max_restarts": 2, "window_s": 60.0, "backoff_s": 0.1},
        "roles": [["buffer", "exit:4", []], ["learner", "run", []]],
    }
    start = time.monotonic()
    proc = drive(spec)
    out, _ = proc.communicate(timeout=45)
    assert proc.returncode == 4, out
    assert time.monotonic() - start > 0.1 + 0.2  # the backoff doubled
    assert (
        "buffer ended (exit code 4, after 2 restarts in a row, none running 60s): giving up" in out
    )
    assert "buffer attempt 3: exit:4" in out  # its last log lines
    events = _events(tmp_path)
    assert [e["event"] for e in events if e["role"] == "buffer"] == [
        "start",
        "restart",
        "start",
        "restart",
        "start",
        "gave_up",
    ]
    assert not processes_of_run(tmp_path)
    assert not alive(_tree(tmp_path, "learner", 1)["role"])


@pytest.mark.timeout(60)
def test_a_role_with_a_config_error_is_not_restarted(tmp_path, drive):
    """Exit 2 (a bad config or a missing file) would fail again: the run ends at once."""
    spec = {
        "policy": {"max_restarts": 3, "window_s": 60.0, "backoff_s": 0.1},
        "roles": [["buffer", "run", []], ["rollout-0", "exit:2", []], ["learner", "run", []]],
    }
    proc = drive(spec)
    out, _ = proc.communicate(timeout=45)
    assert proc.returncode == 2, out
    assert (
        "rollout-0 ended (exit code 2, a bad config, a missing file, or a conflict its log names"
        in out
    )
    assert [e["event"] for e in _events(tmp_path) if e["role"] == "rollout-0"] == [
        "start",
        "gave_up",
    ]
    assert not processes_of_run(tmp_path)


@pytest.mark.timeout(60)
def test_a_learner_stopped_by_its_health_alarms_is_not_restarted(tmp_path, drive):
    """Exit 5 (trainer.health.action=stop, a checkpoint saved): a restart would resume
    into the same trouble, so the run ends with that code."""
    spec = {
        "policy": {"max_restarts": 3, "window_s": 60.0, "backoff_s": 0.1},
        "roles": [["buffer", "run", []], ["learner", "exit:5", []]],
    }
    proc = drive(spec)
    out, _ = proc.communicate(timeout=45)
    assert proc.returncode == 5, out
    assert "learner ended (exit code 5, stopped by its health alarms" in out
    assert [e["event"] for e in _events(tmp_path) if e["role"] == "learner"] == [
        "start",
        "gave_up",
    ]


@pytest.mark.timeout(60)
def test_nothing_outlives_a_launcher_killed_with_sigkill(tmp_path, drive):
    """Roles get SIGTERM when the launcher dies; the watchdog kills what is left."""
    spec = {
        "policy": {"max_restarts": 2, "window_s": 60.0, "backoff_s": 0.1},
        "grace_s": 1.0,
        "roles": [["buffer", "run", []], ["learner", "run", []]],
    }
    proc = drive(spec)
    trees = [_tree(tmp_path, name, 1) for name in ("buffer", "learner")]
    assert len(processes_of_run(tmp_path)) == 2 * 5
    time.sleep(0.5)  # the supervisor has looked at the trees (every 0.1 s here) meanwhile
    proc.kill()
    proc.wait(10)
    roles = [t["role"] for t in trees]
    wait_until(lambda: not [p for p in roles if alive(p)], "the roles to stop", 5)
    wait_until(lambda: not processes_of_run(tmp_path), "the watchdog", 15)
    hidden = [t["tree"][-1] for t in trees]  # the watchdog was told of them
    wait_until(lambda: not [p for p in hidden if alive(p)], "the hidden children", 5)


@pytest.mark.timeout(60)
def test_a_learner_under_torchrun_that_exits_final_is_not_restarted(tmp_path):
    """torchrun (``trainer.nproc > 1``) exits 1 for a rank that exited 2 (a config error,
    a taken port, a superseded learner) or 5 (stopped by its health alarms): the launcher
    restarted it, and a superseded learner took the batches back. The learner records its
    final exit in the run directory; the launcher reads it, gives up, and forgets it."""
    from asyncrl.launch.restart_policy import FINAL_EXIT_FILE, mark_final_exit
    from asyncrl.launch.role_state import QuietView

    marks = f"from pathlib import Path; Path({str(tmp_path)!r}, {FINAL_EXIT_FILE!r})"
    torchrun_like = f"{marks}.write_text('2'); raise SystemExit(1)"
    learner = Role("learner", [sys.executable, "-c", torchrun_like])
    mark_final_exit(tmp_path, 5)  # an earlier learner's: cleared when this one starts
    sup = Supervisor([learner], tmp_path, RestartPolicy(backoff_s=0.1))
    (tmp_path / "logs").mkdir()
    sup.start(learner)
    assert not (tmp_path / FINAL_EXIT_FILE).exists()
    assert sup.run(QuietView()) == 2
    assert learner.attempt == 1  # not restarted
    assert not (tmp_path / FINAL_EXIT_FILE).exists()
    events = [json.loads(line) for line in (tmp_path / "launch.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e.get("role") == "learner"][-1] == "gave_up"


# A supervisor (a subreaper: in a process of its own) with role b alive, whose helper (a
# double fork, as the sandbox's reaper) was adopted by the launcher after the supervisor's
# last look at b's tree; role a dies and is reaped. Prints whether b's helper lived.
REAP_ONE_OF_TWO = r"""
import json, os, sys, time
from pathlib import Path
from asyncrl.launch.process_tree import find_tree
from asyncrl.sandbox.proc_table import scan
from asyncrl.launch.supervise import RestartPolicy, Role, Supervisor
run = Path(sys.argv[1])
b_code = '''
import os, time
if os.fork() == 0:
    if os.fork() == 0:
        time.sleep(60); os._exit(0)
    os._exit(0)
time.sleep(60)
'''
roles = [
    Role("a", [sys.executable, "-c", "import time; time.sleep(1.0)"]),
    Role("b", [sys.executable, "-c", b_code]),
    Role("learner", [sys.executable, "-c", "import time; time.sleep(60)"]),
]
sup = Supervisor(roles, run, RestartPolicy())
sup.begin()
try:
    sup.start(roles[0])
    sup._track()  # its last look: before b starts its helper
    sup.start(roles[1])
    sup.start(roles[2])
    deadline = time.monotonic() + 20
    helper = []
    while not helper and time.monotonic() < deadline:
        time.sleep(0.1)
        procs = scan()
        helper = [p for p in find_tree(procs, [roles[1].proc.pid]) if p != roles[1].proc.pid]
        helper = [p for p in helper if procs[p].ppid == os.getpid()]
    while roles[0].proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.reap(roles[0])
    time.sleep(0.2)
    procs = scan()
    alive = [p for p in helper if p in procs and procs[p].state != "Z"]
    print(json.dumps({"helper": helper, "alive": alive}))
finally:
    sup.close()
"""


@pytest.mark.timeout(60)
def test_reaping_a_role_spares_a_live_roles_helper_the_launcher_adopted(tmp_path):
    """Found by a review: the orphans reaped with a dead role were every process the
    launcher had adopted but those other roles were known to own, so a live role's helper
    adopted since the supervisor last looked at its tree (a double fork) was killed with
    the dead role's leftovers. A live role's session and marker are its own."""
    (tmp_path / "logs").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", REAP_ONE_OF_TWO, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["helper"], "b's helper was not adopted by the launcher"
    assert seen["alive"] == seen["helper"]
