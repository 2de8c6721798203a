"""What a launch claims before anything starts (:mod:`asyncrl.launch.ports`), on real
sockets on 127.0.0.1: a default port that is taken moves to a free one, a port the user
chose that is taken is refused naming its key, and a run directory is one launch's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.launch import ports
from asyncrl.net import ports as net_ports
from tests.helpers import free_ports

HOST = ["endpoints.host=127.0.0.1"]


@pytest.fixture(autouse=True)
def own_claims(tmp_path, monkeypatch):
    """Claims of this test only (the real file is shared by every launch of this user)."""
    path = tmp_path / "claims.json"
    monkeypatch.setattr(ports, "claims_file", lambda: path)
    return path


def _ports(cfg) -> list[int]:
    return [getattr(cfg.endpoints, k) for k in ports.PORT_KEYS]


def test_a_taken_default_port_moves_every_default_port_to_a_free_one():
    cfg = load_config(None, HOST)
    with socket.socket() as squatter:  # another run's buffer, say
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind(("127.0.0.1", cfg.endpoints.trajectories))
            squatter.listen()
        except OSError:
            pass  # taken already: by another run indeed
        moved = ports.claim(cfg)
        assert not ports.bindable("127.0.0.1", cfg.endpoints.trajectories)
    new = _ports(moved)
    assert len(set(new)) == len(new) and not set(new) & set(_ports(cfg)), new
    assert all(ports.bindable("127.0.0.1", p) for p in new)


def test_a_taken_port_the_user_chose_is_refused_naming_its_key():
    (port,) = free_ports(1)
    cfg = load_config(None, [*HOST, f"endpoints.batches={port}"])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(ConfigError, match=rf"endpoints.batches={port} is taken on 127.0.0.1"):
            ports.claim(cfg)


def test_ports_claimed_by_a_live_launch_are_not_taken_again(own_claims):
    """Two launches at the same instant: the first has claimed the defaults but bound
    nothing yet; the second must still move. A gone launch's claims are pruned."""
    cfg = load_config(None, HOST)
    own_claims.write_text(json.dumps({str(os.getppid()): _ports(cfg)}))
    second = ports.claim(cfg)
    assert not set(_ports(second)) & set(_ports(cfg))
    claims = json.loads(own_claims.read_text())
    assert claims[str(os.getpid())] == _ports(second)

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    chosen = free_ports(5)
    own_claims.write_text(json.dumps({gone.stdout.strip(): chosen}))
    mine = load_config(
        None, [*HOST, *(f"endpoints.{k}={p}" for k, p in zip(ports.PORT_KEYS, chosen, strict=True))]
    )
    assert _ports(ports.claim(mine)) == chosen  # the gone launch's claim did not count
    assert list(json.loads(own_claims.read_text())) == [str(os.getpid())]


def test_ipc_endpoints_claim_only_the_sync_stores_port(tmp_path):
    """A review's ``endpoints.host=ipc://...`` launch died in a traceback (the claims bound
    the ipc string as a host name), though every role serves ipc. Only the sync store
    (on 127.0.0.1 then) is TCP: its taken default moves, the ipc endpoints stay."""
    ipc = f"ipc://{tmp_path}/sockets"
    cfg = load_config(None, [f"endpoints.host={ipc}"])
    store = cfg.endpoints.sync_store
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind(("127.0.0.1", store))
            squatter.listen()
        except OSError:
            pass  # taken already: by another run indeed
        moved = ports.claim(cfg).endpoints
    assert moved.sync_store != store and ports.bindable("127.0.0.1", moved.sync_store)
    assert moved.model_copy(update={"sync_store": store}) == cfg.endpoints  # ipc kept


def test_a_run_directory_is_held_by_one_launch(tmp_path):
    held = ports.hold_run_dir(tmp_path / "run")
    try:
        with pytest.raises(
            ConfigError, match=rf"in use by another asyncrl-launch \(pid {os.getpid()}\)"
        ):
            ports.hold_run_dir(tmp_path / "run")
    finally:
        held.close()
    ports.hold_run_dir(tmp_path / "run").close()  # let go with its launcher
    (tmp_path / "a_file").write_text("")  # a run directory that cannot be made: one line
    with pytest.raises(ConfigError, match=r"cannot be made or written .*default_local_dir"):
        ports.hold_run_dir(tmp_path / "a_file" / "run")


def test_chosen_ports_are_outside_the_range_the_kernel_hands_out():
    """A port from the ephemeral range may be given to any outgoing connection before its
    role binds it (a CI run lost a learner so: "address already in use" on the sync store)."""
    low, high = net_ports.ephemeral_range()
    busy = net_ports.free_ports("127.0.0.1", 4)
    chosen = net_ports.free_ports("127.0.0.1", 8, avoid=busy)
    assert len(set(chosen)) == 8 and not set(chosen) & set(busy), chosen
    assert all(not low <= p <= high and p >= net_ports.LOWEST for p in chosen), (low, high, chosen)
    assert all(net_ports.bindable("127.0.0.1", p) for p in chosen)


def test_a_port_bound_by_another_process_is_not_chosen(monkeypatch):
    """With one candidate left and it bound elsewhere, the choice falls back to the ports the
    kernel offers rather than returning the bound one."""
    (port,) = net_ports.free_ports("127.0.0.1", 1)
    monkeypatch.setattr(net_ports, "LOWEST", port)
    monkeypatch.setattr(net_ports, "ephemeral_range", lambda: (port + 1, 65535))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        (chosen,) = net_ports.free_ports("127.0.0.1", 1)
    assert chosen != port


FOREIGN = "203.0.113.7"  # TEST-NET-3 (RFC 5737): no machine's address


@pytest.mark.parametrize("host", [FOREIGN, "no-such-host.invalid"])
@pytest.mark.parametrize("chosen", [False, True])
def test_a_host_that_is_not_this_machines_is_refused_in_one_line(host, chosen):
    """A review's ``endpoints.host=10.0.0.5`` (the README's address for roles started by
    hand) crashed the launcher in a traceback: every port read as taken, and the free ones
    were looked for on an address nothing here can bind. A port the user chose was refused
    blaming "another run"."""
    (port,) = free_ports(1)
    overrides = [f"endpoints.host={host}", "endpoints.insecure=true"]
    cfg = load_config(None, [*overrides, *([f"endpoints.tasks={port}"] * chosen)])
    with pytest.raises(ports.Refusal) as refused:
        ports.claim(cfg)
    assert str(refused.value) == _not_here(host)


def _not_here(host: str) -> str:
    return (
        f"endpoints.host={host} is not an address of this machine; asyncrl-launch runs every "
        "role here: use 127.0.0.1 (or this machine's address), or start the roles by hand on "
        "their machines, or use the Ray launcher (--ray)"
    )


def test_the_launcher_refuses_a_host_of_another_machine_with_exit_2(tmp_path, capsys):
    from asyncrl.launch.local import main
    from tests.helpers import launch_inputs

    args = [
        *launch_inputs(tmp_path),
        f"endpoints.host={FOREIGN}",
        "endpoints.insecure=true",
    ]
    assert main(args) == 2
    assert capsys.readouterr().err == f"asyncrl-launch: {_not_here(FOREIGN)}\n"
