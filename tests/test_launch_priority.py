"""launch.nice: a role's CPU priority, from the config to the launched process, what it
starts, and its session's scheduling group."""

from __future__ import annotations

import sys
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.launch.process_tree import spawn
from asyncrl.launch.roles import plan_roles


def test_a_role_runs_at_its_niceness_and_its_session_group_too(tmp_path):
    """launch.nice reaches the role's process (and what it starts), and, where the kernel
    groups sessions (autogroup), the role's group: the group's share is what a niceness
    changes between sessions."""
    cfg = load_config("configs/cpu_demo.yaml", ["launch.nice={rollout: [7, 0], buffer: 3}"])
    nice = {r.name: r.nice for r in plan_roles(cfg, Path("c.yaml"))}
    assert nice == {"buffer": 3, "rollout-0": 7, "rollout-1": 0, "learner": 0}
    probe = (
        "import os, subprocess, sys\n"
        "group = open('/proc/self/autogroup').read().split()[-1] "
        "if os.path.exists('/proc/self/autogroup') else 'none'\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'], "
        "capture_output=True, text=True).stdout.strip()\n"
        "print(os.nice(0), group, child)\n"
    )
    log_path = tmp_path / "role.log"
    proc = spawn([sys.executable, "-c", probe], {}, log_path, None, "test-nice", nice=7)
    assert proc.wait(60) == 0
    own, group, child = log_path.read_text().split()
    assert own == "7" and child == "7"
    assert group in ("7", "none")  # 'none': a kernel without autogroups
