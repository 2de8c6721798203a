"""Chaos: ``kill -9`` one role of a real run under ``asyncrl-launch`` mid-training (a rollout
server, the buffer, the learner: each in its own run) and check that the run survives it.

Each run (the demo's config and model, two CPU vLLM rollout servers, checkpoints every 5
steps) must reach its last step with exit 0, every step trained exactly once by the final
weights' lineage, the accounting identity holding exactly at the end (``dealt = in flight +
in buffer + trained + dropped + given up``, with ``trained`` equal to what the learner
consumed), few groups dropped for lag after the restart, and no process of the run left
once the launcher is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from asyncrl.metrics import read_metrics
from asyncrl.progress import accounting_lines
from tests.e2e_helpers import RUN, launch_cmd, role_logs, run_overrides, trained_steps
from tests.helpers import alive, wait_until

pytestmark = pytest.mark.slow

STEPS, BATCH = 30, 16  # the demo's data.train_batch_size
# role -> (command-line marker of its process, step after which it is killed)
TARGETS = {
    "rollout-0": ("--server-id rollout-0", 8),
    "buffer": ("buffer.main", 8),
    "learner": ("learner.main", 13),  # checkpoint at 10: steps 11-13 are trained again
}


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process on the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out[int(entry.name)] = (ppid, cmd)
    return out


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    procs = _procs()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmd) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = (ppid, cmd)
                frontier.append(pid)
    return found


def _run_and_kill(tmp_path: Path, overrides: list[str], marker: str, kill_after: int):
    """Launch, kill -9 the role matching ``marker`` after step ``kill_after``, wait for the
    end; returns (exit code, launcher output, every pid the run ever had, the killed pid)."""
    run = tmp_path / RUN
    out_path = tmp_path / "launch.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(launch_cmd(overrides), stdout=out, stderr=subprocess.STDOUT)
    seen: set[int] = set()
    killed = None

    def watch() -> bool:
        """Note the run's processes, kill the target once; true when the run has ended."""
        nonlocal killed
        tree = _descendants(proc.pid)
        seen.update(tree)
        steps = [r["step"] for r in trained_steps(read_metrics(run))] if run.exists() else []
        if killed is None and steps and max(steps) >= kill_after:
            targets = [p for p, (pp, cmd) in tree.items() if pp == proc.pid and marker in cmd]
            assert len(targets) == 1, tree
            killed = targets[0]
            os.kill(killed, signal.SIGKILL)
        return proc.poll() is not None

    try:
        wait_until(watch, "the run to end", 780, every_s=0.5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return proc.returncode, out_path.read_text(), seen, killed


@pytest.mark.timeout(900)
@pytest.mark.parametrize("role", list(TARGETS))
def test_a_run_survives_kill_9_of_a_role(tmp_path, demo_model, arithmetic_data, role):
    marker, kill_after = TARGETS[role]
    overrides = [
        *run_overrides(tmp_path, demo_model, arithmetic_data, STEPS),
        "trainer.save_freq=5",
        "trainer.test_freq=-1",
        f"trainer.val_before_train={'true' if role == 'rollout-0' else 'false'}",
        "staleness.max_policy_lag=1",
        "control.heartbeat_s=0.5",
        "control.dead_after_s=8",
        "launch.restart_backoff_s=1",
    ]
    code, out, seen, killed = _run_and_kill(tmp_path, overrides, marker, kill_after)
    run = tmp_path / RUN
    assert killed is not None, "the run ended before the kill: " + out[-3000:]
    assert code == 0, out[-4000:] + role_logs(run)
    assert "restart" in out and role in out, out[-3000:]

    records = read_metrics(run)
    steps = [r["step"] for r in trained_steps(records)]
    assert set(steps) == set(range(1, STEPS + 1)), steps

    acct = [r for r in records if "accounting/train/dealt" in r][-1]
    print(f"\n{role} killed after step {kill_after}: " + "; ".join(accounting_lines([acct])))
    for kind in ("train", "val"):
        assert acct[f"accounting/{kind}/unaccounted"] == 0, acct
    # Trained, as the coordinator counts it, is what the learner consumed: each step's
    # batch of fresh groups, once (the steps retrained after a learner restart included).
    trained = acct["accounting/train/trained"]
    assert trained == STEPS * BATCH, acct
    # After a learner restart the servers keep the weights they hold (the replay reproduces
    # them) and what they generated meanwhile is trained, not dropped for lag: 0 of 480 in
    # the README's run, against the bound of 5%. A buffer restart ages what was
    # generated while it was down (15 of 480 in the same runs): held under 10%.
    bound = 0.05 if role == "learner" else 0.10
    assert acct["accounting/train/dropped/lag"] < bound * trained, acct

    def left() -> dict[int, str]:
        return {pid: cmd for pid, (_, cmd) in _procs().items() if pid in seen and alive(pid)}

    wait_until(lambda: not left(), "the run's processes to be reaped", 5, details=left)
