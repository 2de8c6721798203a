"""End to end with ``endpoints.auth: curve`` on loopback: the demo config under
``asyncrl-launch`` with the run's keys runs to its last step, while strangers try the
run's sockets: a trajectory pusher without a key and one with a key of its own get nothing
into the buffer, and a rollout server that registers without the run's keys is refused.
The run goes on, and both services count the refused connections."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from asyncrl.config import load_config
from asyncrl.control.client import CoordinatorClient, CoordinatorGone
from asyncrl.metrics import read_metrics
from asyncrl.net import security
from asyncrl.net.transport import config_endpoint
from tests.e2e_helpers import (
    RUN,
    launch_cmd,
    role_logs,
    run_overrides,
    trained_steps,
    wait_for_step,
)

pytestmark = pytest.mark.slow

# Long enough that the strangers' tries (about 5 s after step 3) fall inside the run: at
# 20 steps a fast run (0.3 s a step) ended meanwhile, and nothing was left to refuse them.
STEPS = 60


def _strangers_push(addr: str, keys: Path) -> None:
    """Two pushers the run does not know: plain TCP, and CURVE with a key of their own
    (they know the server's public key: public keys are no secret)."""
    server_public = zmq.auth.load_certificate(str(keys / "server.key"))[0]
    ctx = zmq.Context()
    socks = []
    try:
        for with_key in (False, True):
            sock = ctx.socket(zmq.PUSH)
            socks.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            if with_key:
                sock.curve_serverkey = server_public
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.connect(addr)
            for _ in range(10):  # well-formed frames would not matter: none gets through
                try:
                    sock.send_multipart([b"\x81\xa4kind\xa4traj", b"x" * 64], flags=zmq.NOBLOCK)
                except zmq.Again:
                    # The server refused the handshake before this frame, and the socket
                    # dropped its pipe: there is nowhere left to queue (seen on a slow CI).
                    break
        time.sleep(2.0)  # they keep trying to hand their frames over
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()


@pytest.mark.timeout(600)
def test_a_curve_run_ends_and_keeps_strangers_out(tmp_path, demo_model, arithmetic_data):
    keys = tmp_path / "keys"
    security.write_keys(keys)
    overrides = [
        *run_overrides(tmp_path, demo_model, arithmetic_data, STEPS),
        "endpoints.auth=curve",
        f"endpoints.keys_dir={keys}",
        "trainer.test_freq=-1",
    ]
    cfg = load_config("configs/cpu_demo.yaml", overrides)
    run = tmp_path / RUN
    out_path = tmp_path / "launch.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(launch_cmd(overrides), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_step(proc, run, out_path, 3, 300)
        _strangers_push(config_endpoint(cfg.endpoints, "trajectories"), keys)
        rogue = CoordinatorClient(
            config_endpoint(cfg.endpoints, "tasks"),
            config_endpoint(cfg.endpoints, "control"),
            "rogue-0",
            timeout_s=1.0,
            patience_s=3.0,
        )
        with pytest.raises(CoordinatorGone):
            rogue.register()  # no key: the coordinator never sees the request
        rogue.close()
        proc.wait(400)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    text = out_path.read_text()
    assert proc.returncode == 0, text[-3000:] + role_logs(run)
    records = read_metrics(run)
    assert [r["step"] for r in trained_steps(records)] == list(range(1, STEPS + 1))
    last = [r for r in records if "accounting/train/dealt" in r][-1]
    assert last["accounting/train/unaccounted"] == 0, last

    # Nothing of the strangers was even decoded by the buffer, and both services counted
    # refusals (the pushers at the buffer, the registration at the coordinator).
    def most(key: str) -> float:
        return max(r.get(key, 0.0) for r in records)

    assert most("buffer/rejects/total") == 0
    assert most("buffer/security/rejected_connections") >= 2
    assert most("security/rejected_connections") >= 1  # the coordinator's
    assert most("coordinator/registrations") == 2  # the run's two servers, no rogue
    # Every role's own requests were within its key's authority: nothing was refused.
    refused = {k for r in records for k in r if "security/refused/" in k}
    assert not refused, refused
    buffer_log = (run / "logs" / "buffer.log").read_text()
    assert "unknown CURVE key" in buffer_log and "no CURVE handshake" in buffer_log, buffer_log
