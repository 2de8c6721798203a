"""The README's "starting roles by hand": the buffer, two rollout servers and the learner as
separate processes, started one by one in a shuffled order; a role started before the peer
it needs says that it waits for it (the next role starts only once it has), the run
completes, and every process exits 0."""

from __future__ import annotations

import functools
import random
import subprocess
import sys

import pytest

from asyncrl.metrics import read_metrics
from tests.e2e_helpers import RUN, run_overrides, trained_steps
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

STEPS = 4
ROLES = {
    "buffer": ["-m", "buffer.main"],
    "rollout-0": ["-m", "rollout_servers.main", "--server-id", "rollout-0"],
    "rollout-1": ["-m", "rollout_servers.main", "--server-id", "rollout-1"],
    "learner": ["-m", "learner.main"],
}
# The line a role logs once it is up, or, while the peer it needs is missing, that it waits.
UP = {
    "buffer": "buffer: trajectories on",
    "learner": "coordinator: tasks on",
    "rollout-0": "rollout-0 registered",
    "rollout-1": "rollout-1 registered",
}
WAITS = {
    "learner": ("buffer", "waiting for the buffer"),
    "rollout-0": ("learner", "waiting for the coordinator"),
    "rollout-1": ("learner", "waiting for the coordinator"),
}


def _expected_line(name: str, started: set[str]) -> str | None:
    peer, line = WAITS.get(name, ("", ""))
    if peer and peer not in started:
        return line
    return UP.get(name)


def _logged(path, line: str, proc: subprocess.Popen) -> bool:
    """Whether the role logged ``line``; fails at once when it has exited."""
    if line in path.read_text():
        return True
    assert proc.poll() is None, f"{path.name} exited {proc.returncode}:\n{path.read_text()[-2000:]}"
    return False


def _all_exited(procs: dict, logs: dict) -> bool:
    """Whether every role has exited; fails at once when one exits non-zero (the others would
    wait for it until their own timeouts)."""
    for name, p in procs.items():
        assert p.poll() in (None, 0), (
            f"{name} exited {p.returncode}:\n{logs[name].read_text()[-2000:]}"
        )
    return all(p.poll() is not None for p in procs.values())


@pytest.mark.timeout(600)
def test_roles_started_by_hand_in_any_order(tmp_path, demo_model, arithmetic_data):
    seed = random.randrange(1000)
    order = list(ROLES)
    random.Random(seed).shuffle(order)
    overrides = [
        *run_overrides(tmp_path, demo_model, arithmetic_data, STEPS),
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        "control.min_servers_to_start=2",
    ]
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ROLES}
    try:
        for name in order:
            module, *args = ROLES[name][1:]
            cmd = [sys.executable, "-m", module, "configs/cpu_demo.yaml", *args, *overrides]
            expected = _expected_line(name, set(procs))
            with logs[name].open("w") as f:
                procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
            if expected:  # it is up, or visibly waiting for the peer it needs
                logged = functools.partial(_logged, logs[name], expected, procs[name])
                wait_until(logged, f"{name} to log {expected!r}", 180, every_s=0.5)
        wait_until(lambda: _all_exited(procs, logs), "the run to finish", 420, every_s=0.5)
        codes = {name: p.returncode for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    text = {name: path.read_text() for name, path in logs.items()}
    tails = "\n".join(f"--- {n} (order {order}, seed {seed})\n{t[-1500:]}" for n, t in text.items())
    assert codes == dict.fromkeys(ROLES, 0), tails
    steps = trained_steps(read_metrics(tmp_path / RUN))
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
