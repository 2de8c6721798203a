"""``benchmarks/fuzz_services.py --quick`` runs in ``make test``: 2,000 generated frames per
socket kind (buffer trajectories and batches, coordinator tasks and control), valid and
hostile mixed; every frame processed or rejected and counted, every request answered, the
services alive at the end."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_fuzz_accounts_for_every_frame(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/fuzz_services.py", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "fuzz_services.json").read_text())
    figures = record["figures"]
    assert figures["problems"] == [] and figures["crashes"] == 0
    for kind in ("trajectories", "batches", "coordinator_tasks", "coordinator_control"):
        r = figures[kind]
        assert r["sent"] == 2000 and r["processed"] + r["rejected"] == 2000, r
        assert r["rejected"] == r["hostile"] > 0 and r["processed"] > 0, r
    assert "crashes: 0" in proc.stdout
