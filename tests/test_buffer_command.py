"""The ``asyncrl-buffer`` command as its own process: it serves on the configured ports,
logs rollouts, and exits 0 on SIGTERM or a ``shutdown`` request; the buffer role imports
no torch, vLLM or other role. The service in-process: ``tests/test_buffer_service.py``."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from asyncrl.net.buffer_client import BufferClient
from asyncrl.net.transport import TrajectoryPusher
from tests.helpers import free_port
from tests.standins.trajgen import make_group

pytestmark = pytest.mark.timeout(90)

BIN = Path(sys.executable).parent


def write_config(tmp_path: Path, **buffer: object) -> tuple[Path, dict]:
    cfg = {
        "data": {"train_batch_size": 2, "max_response_length": 16, "max_prompt_length": 16},
        "actor": {"ppo_mini_batch_size": 2},
        "trainer": {"default_local_dir": str(tmp_path / "runs"), "save_freq": 1},
        "buffer": {"log_rollouts": True, **buffer},
        "endpoints": {name: free_port() for name in ("trajectories", "batches")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def start_cli(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "asyncrl-buffer"), str(config), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("how", ["sigterm", "shutdown_request"])
def test_the_command_serves_logs_rollouts_and_exits_cleanly(tmp_path, how: str) -> None:
    config, cfg = write_config(tmp_path)
    proc = start_cli(config)
    ports = cfg["endpoints"]
    try:
        with BufferClient(f"tcp://127.0.0.1:{ports['batches']}", "learner") as client:
            try:
                client.wait_ready(wait_s=30)
            except TimeoutError:
                proc.kill()
                raise AssertionError(proc.communicate()[1][-3000:]) from None
            client.hello()
            with TrajectoryPusher(f"tcp://127.0.0.1:{ports['trajectories']}") as pusher:
                pusher.send(make_group("a", 2))
                pusher.send(make_group("b", 3))
            batch = client.request_batch(0, wait_s=10)
            assert batch is not None and batch.task_ids == ["a", "b"]
            if how == "shutdown_request":
                client.shutdown()
            else:
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    table = pq.read_table(tmp_path / "runs" / "asyncrl" / "demo" / "rollouts").to_pylist()
    assert sorted((r["task_id"], r["group_index"]) for r in table) == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("b", 1),
        ("b", 2),
    ]
    assert {r["outcome"] for r in table} == {"completed"}


def test_buffer_role_imports_no_torch_vllm_or_other_roles() -> None:
    code = (
        "import sys, buffer.main, buffer.service, buffer.core, buffer.rollout_log; "
        "bad = [m for m in ('torch', 'vllm', 'learner', 'rollout_servers') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
