"""A role whose configured port is taken, on real sockets on 127.0.0.1: it says which
``endpoints.*`` key and address in one line and exits 2, which no launcher restarts (a
review's buffer under the Ray launcher, which claims no ports, died in a ZMQError traceback
with exit 1 and was restarted three times before the run failed). A port in use that is no
configured one (a library's own) is no config problem: its error goes on as it was."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import zmq

from asyncrl.net.taken import exit_if_taken, taken_line
from asyncrl.tasks import prepare_task_data
from tests.e2e_helpers import run_overrides
from tests.helpers import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def squatter() -> Iterator[socket.socket]:
    """Another process's listening socket, as far as the roles can tell. A port free when
    chosen may be taken before the bind (another run on the machine): choose again."""
    with socket.socket() as s:
        for attempt in range(20):
            try:
                s.bind(("127.0.0.1", free_port()))
                break
            except OSError:
                if attempt == 19:
                    raise
        s.listen()
        yield s


def _line(role: str, key: str, port: int) -> str:
    return (
        f"{role}: cannot listen at {key}={port} on 127.0.0.1: address already in use "
        "(another run, or a process left of an earlier one?): stop it, or choose a free port"
    )


def _with_port(overrides: list[str], key: str, port: int) -> list[str]:
    return [o for o in overrides if not o.startswith(f"{key}=")] + [f"{key}={port}"]


@pytest.mark.parametrize(
    ("module", "key"),
    [
        ("buffer.main", "endpoints.trajectories"),
        ("buffer.main", "endpoints.batches"),
        ("learner.main", "endpoints.control"),
    ],
)
def test_a_role_whose_port_is_taken_exits_2_in_one_line(tmp_path, squatter, module, key):
    """The learner finds it before its model loads: this one is files that only look so."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    prepare_task_data("arithmetic", tmp_path / "data", seed=0, n_train=8, n_val=2)
    port = squatter.getsockname()[1]
    overrides = _with_port(
        run_overrides(tmp_path, tmp_path / "model", tmp_path / "data", 2), key, port
    )
    cmd = [sys.executable, "-m", module, "configs/cpu_demo.yaml", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.endswith(_line(module.split(".")[0], key, port)), out[-3000:]


def test_a_port_in_use_that_no_key_names_goes_on_as_it_was(squatter):
    """vLLM or torch binding a port of their own choice that another process took: a
    restart may find it free, so the role exits as before (restartable)."""
    port = squatter.getsockname()[1]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        with pytest.raises(zmq.ZMQError) as raised:
            sock.bind(f"tcp://127.0.0.1:{port}")
        assert taken_line("buffer", raised.value, {"endpoints.batches": ("127.0.0.1", 1)}) is None
        with pytest.raises(SystemExit) as ended, exit_if_taken("x", {"k": ("127.0.0.1", port)}):
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
            except zmq.ZMQError as e:  # wrapped, as the coordinator's start does
                raise RuntimeError("coordinator failed to start") from e
        assert ended.value.code == 2
    finally:
        sock.close(0)
        ctx.term()
