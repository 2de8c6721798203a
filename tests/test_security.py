"""Authenticated transport: CURVE on real sockets on 127.0.0.1, keys from
``asyncrl-prepare keys``; the run's own roles get through, a stranger's key or no key does
not (refused, counted), and a network address without authentication is refused at start."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import zmq

from asyncrl.config import ConfigError, load_config
from asyncrl.net import security
from asyncrl.net.transport import bind, connect
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def keys(tmp_path):
    security.write_keys(tmp_path / "keys")
    yield tmp_path / "keys"
    security.reset()


def _cfg(*overrides: str):
    return load_config("configs/cpu_demo.yaml", list(overrides))


@contextlib.contextmanager
def _serving(keys):
    """The buffer's CURVE-served PULL socket on 127.0.0.1 with the run's ``keys``: yields
    (context, address, the sockets to close: the PULL first); ends the context after."""
    security.configure(
        _cfg("endpoints.auth=curve", f"endpoints.keys_dir={keys}").endpoints, "buffer"
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    socks = [pull]
    try:
        yield ctx, bind(pull, "tcp://127.0.0.1:*"), socks
    finally:
        # Each socket closed by its owner, then term(): the ZAP handler and the handshake
        # watcher close theirs when the context ends (destroy() would close them under
        # their threads' feet).
        for sock in socks:
            sock.close(0)
        ctx.term()


def _received(pull: zmq.Socket, within_s: float) -> list[bytes]:
    out, deadline = [], time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pull.poll(50):
            out.append(pull.recv())
    return out


def test_only_the_runs_keys_get_through(keys):
    with _serving(keys) as (ctx, addr, socks):
        pull = socks[0]
        before = security.metrics().get("security/rejected_connections", 0.0)
        # A role of the run: its key is one of the run's.
        good = ctx.socket(zmq.PUSH)
        socks.append(good)
        connect(good, addr)
        good.send(b"from the run")
        # A stranger with a CURVE key of its own, and a plain-TCP peer.
        rogue = ctx.socket(zmq.PUSH)
        socks.append(rogue)
        public, secret = zmq.curve_keypair()
        rogue.curve_serverkey = security._SETTINGS.keys.server_public  # type: ignore[union-attr]
        rogue.curve_publickey, rogue.curve_secretkey = public, secret
        rogue.connect(addr)
        plain = ctx.socket(zmq.PUSH)
        socks.append(plain)
        plain.connect(addr)
        for sock in (rogue, plain):  # queued on their side: the handshake never completes
            # Again: refused already, and the pipe dropped: nothing to queue the frame on.
            with contextlib.suppress(zmq.Again):
                sock.send(b"poison", flags=zmq.NOBLOCK)
        got = _received(pull, 1.5)
        assert got == [b"from the run"]
        wait_until(
            lambda: security.metrics()["security/rejected_connections"] >= before + 2,
            "both strangers to be refused and counted",
            10,
        )
        assert security.metrics()["security/accepted_connections"] >= 1


def test_a_network_address_without_authentication_is_refused_with_both_fixes():
    with pytest.raises(ConfigError) as e:
        _cfg("endpoints.host=10.1.2.3")
    text = str(e.value)
    assert "endpoints.host=10.1.2.3" in text
    assert "asyncrl-prepare keys" in text and "endpoints.auth=curve" in text
    assert "endpoints.insecure=true" in text
    # Either way out is accepted; loopback needs neither.
    assert _cfg("endpoints.host=10.1.2.3", "endpoints.insecure=true").endpoints.insecure
    _cfg("endpoints.host=10.1.2.3", "endpoints.auth=curve", "endpoints.keys_dir=k")
    _cfg("endpoints.host=127.0.0.1")
    with pytest.raises(ConfigError, match="needs endpoints.keys_dir"):
        _cfg("endpoints.auth=curve")


def test_a_wildcard_or_ipv6_host_is_refused_in_one_line():
    """``endpoints.host`` is also what every role dials and the servers sync from: a review
    set 0.0.0.0 (accepted with insecure=true), and the servers were told to sync from
    their own machine; ::1 passed the check and failed at the bind ("No such device")."""
    for host in ("0.0.0.0", "*"):
        with pytest.raises(ConfigError, match="every role dials") as e:
            _cfg(f"endpoints.host={host}", "endpoints.insecure=true")
        assert f"endpoints.host={host} " in str(e.value) and "e.g. 10.0.0.5" in str(e.value)
    for host in ("::1", "fe80::1"):
        with pytest.raises(ConfigError, match="IPv6 address"):
            _cfg(f"endpoints.host={host}", "endpoints.insecure=true")
    assert _cfg("endpoints.host=learner.cluster", "endpoints.insecure=true").endpoints.insecure


def test_prepare_keys_does_not_replace_keys_without_force(tmp_path, capsys):
    """A second ``asyncrl-prepare keys`` on the same folder replaced the keys without a
    word, and every node holding the old ones was refused."""
    from asyncrl.prepare.main import main

    assert main(["keys", "--out", str(tmp_path)]) == 0
    first = (tmp_path / "server.key_secret").read_bytes()
    assert main(["keys", "--out", str(tmp_path)]) == 2
    assert "holds keys already" in capsys.readouterr().err
    assert (tmp_path / "server.key_secret").read_bytes() == first
    assert main(["keys", "--out", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "server.key_secret").read_bytes() != first


def test_missing_keys_name_the_command_that_makes_them(tmp_path):
    endpoints = _cfg("endpoints.auth=curve", f"endpoints.keys_dir={tmp_path}").endpoints
    with pytest.raises(SystemExit) as e:
        security.configure(endpoints, "rollout")
    assert e.value.code == 2


@pytest.mark.parametrize("damage", ["public over secret", "empty", "cut", "cut in its key"])
def test_a_key_file_that_is_no_key_is_named_in_one_line(keys, damage, capsys):
    """A secret key file that is there but unusable (a public key copied over it, an
    empty or cut one) raised a traceback and exit 1, which a launcher restarts; it is a
    config problem like a missing file: one line naming it, exit 2."""
    secret = keys / "buffer" / "buffer.key_secret"
    whole = secret.read_bytes()
    cut_key = whole[: whole.index(b'secret-key = "') + 34]  # 20 of its 40 characters
    damaged = {
        "public over secret": (keys / "buffer.key").read_bytes(),
        "empty": b"",
        "cut": whole[:60],
        "cut in its key": cut_key + b'"\n',
    }
    secret.write_bytes(damaged[damage])
    endpoints = _cfg("endpoints.auth=curve", f"endpoints.keys_dir={keys / 'buffer'}").endpoints
    line = security.keys_problem(endpoints, ("buffer",))
    assert line is not None and str(secret) in line and "asyncrl-prepare keys" in line
    assert "\n" not in line
    with pytest.raises(SystemExit) as e:
        security.configure(endpoints, "buffer")
    assert e.value.code == 2 and str(secret) in capsys.readouterr().err


def test_no_secret_key_is_ever_readable_by_others(tmp_path, monkeypatch):
    """Each secret is written into a folder only its owner may enter and made 0600 before
    it moves into the keys folder: written there under a umask of 022, it was readable by
    anyone on the machine until its chmod (a reader who opened it then keeps it)."""
    import stat

    import zmq.auth

    create = zmq.auth.create_certificates
    folders: list[int] = []

    def recorded(folder: str, name: str):
        folders.append(stat.S_IMODE(os.stat(folder).st_mode))
        return create(folder, name)

    monkeypatch.setattr(zmq.auth, "create_certificates", recorded)
    umask = os.umask(0o022)
    try:
        written = security.write_keys(tmp_path / "keys")
    finally:
        os.umask(umask)
    assert folders and all(mode == 0o700 for mode in folders)
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o600 if path.name.endswith("_secret") else 0o644), (path, oct(mode))
    assert sorted(p.name for p in (tmp_path / "keys").iterdir() if p.is_dir()) == [
        "buffer",
        "learner",
        "rollout",
    ]  # fmt: skip  (no staging folder left)


def test_keys_made_in_the_repository_are_never_committed():
    """The README's ``asyncrl-prepare keys --out keys/`` in a checkout: git ignores them."""
    for path in ("keys/server.key_secret", "keys/rollout/rollout.key_secret", "x.key_secret"):
        check = subprocess.run(
            ["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, check=False
        )
        assert check.returncode == 0, path


def test_a_frame_over_the_limit_is_never_read_and_the_service_goes_on():
    """``max_message_bytes`` on a served socket: zmq drops a peer that sends a larger frame
    before reading it; the next client is served as usual."""
    from collections import Counter

    from asyncrl import wire
    from asyncrl.net.serving import RouterService
    from asyncrl.net.transport import ReqClient
    from asyncrl.wire.base import encode

    ctx = zmq.Context()
    counts: Counter[str] = Counter()
    rejected: list[wire.WireError] = []
    service = RouterService(
        ctx,
        "tcp://127.0.0.1:*",
        wire.decode_request,
        on_reject=rejected.append,
        counts=counts,
        max_message_bytes=4096,
    )
    big, small = (
        ReqClient(service.endpoint, timeout_s=1.0),
        ReqClient(service.endpoint, timeout_s=5.0),
    )
    try:
        with pytest.raises(TimeoutError):
            big.request_frames([b"x" * 100_000])
        assert list(service.receive()) == [] and not rejected  # never read, never decoded
        small._sock.send_multipart([encode(wire.StatsRequest())])
        wait_until(lambda: service.sock.poll(0), "the small request to arrive", 5)
        [(envelope, request)] = list(service.receive())
        assert isinstance(request, wire.StatsRequest)
    finally:
        big.close()
        small.close()
        service.close()
        ctx.term()


def test_a_control_message_holds_a_bounded_number_of_items():
    import msgspec

    from asyncrl.control import messages as m

    ok = m.Register(server_id="s", task_ids=["t"] * 10)
    back = m.decode_request(msgspec.msgpack.encode(ok))
    assert isinstance(back, m.Register) and back.task_ids == ["t"] * 10
    huge = msgspec.msgpack.encode(m.Register(server_id="s", task_ids=["t"] * 70_000))
    with pytest.raises(Exception, match="65536"):
        m.decode_request(huge)


def test_message_limits_come_from_the_config_and_senders_check_their_own(tmp_path):
    """``buffer.max_message_mb`` and ``control.max_message_mb`` reach the buffer's limits
    (and its sockets' cut-off); a role's own message over them is refused before it is sent,
    with the key to raise, since the receiving socket would drop it without a word."""
    from asyncrl import wire
    from asyncrl.net.transport import ReqClient, TrajectoryPusher, mebibytes
    from buffer.service import BufferService
    from tests.standins.trajgen import make_traj

    cfg = _cfg("buffer.max_message_mb=0.01", "control.max_message_mb=0.001")
    limits = BufferService.from_config(cfg, tmp_path).limits
    assert limits.max_message_bytes == 10485 and limits.max_request_bytes == 1048

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = bind(pull, "tcp://127.0.0.1:*")
    pusher = TrajectoryPusher(addr, max_message_bytes=mebibytes(cfg.buffer.max_message_mb))
    client = ReqClient(addr, timeout_s=1.0, max_message_bytes=limits.max_request_bytes)
    try:
        with pytest.raises(wire.WireError, match="buffer.max_message_mb") as e:
            pusher.send([make_traj("big", response_len=2000)])  # 2000 x 8 bytes and more
        assert e.value.kind == "oversize"
        with pytest.raises(wire.WireError, match="raise control.max_message_mb"):
            client.request_frames([b"x" * 2000])
        pusher.send([make_traj("small")])
        frames = pull.recv_multipart()  # the small one, and nothing of the two refused
        assert wire.decode_trajectories(frames)[0].task_id == "small"
        assert not pull.poll(200)
    finally:
        pusher.close()
        client.close()
        pull.close(0)
        ctx.term()


def test_a_node_with_another_runs_keys_is_told_so(tmp_path, keys, caplog):
    """A node given the keys of another ``asyncrl-prepare keys`` run is refused by the
    run's servers. To it, the refusal was silence: its requests timed out, its pushes
    queued, and nothing mentioned keys. It now logs one line naming the keys and the fix."""
    import logging

    with _serving(keys) as (ctx, addr, socks):
        pull = socks[0]
        other = tmp_path / "other_keys"  # another run's keys on this node
        security.write_keys(other)
        security.configure(
            _cfg("endpoints.auth=curve", f"endpoints.keys_dir={other}").endpoints, "rollout"
        )
        with caplog.at_level(logging.ERROR, logger=security.__name__):
            push = ctx.socket(zmq.PUSH)
            socks.append(push)
            connect(push, addr)
            with contextlib.suppress(zmq.Again):
                push.send(b"never read", flags=zmq.NOBLOCK)
            wait_until(
                lambda: security.metrics().get("security/client_handshakes_failed", 0) >= 1,
                "the refused handshake to be seen by the client",
                10,
            )
        assert "this node's keys are not the run's" in caplog.text, caplog.text
        assert _received(pull, 0.5) == []


def test_closed_curve_sockets_end_their_handshake_watchers(keys):
    """Found by a review: each CURVE socket's handshake watcher waited for a stop event its
    monitor was never asked for, so the thread and its monitor socket lived as long as
    the context. The launcher opens a fresh socket for each try of a Leave, in one
    context: under a learner's outage its context ran out of sockets, and the error ended
    the launcher. Now each closed socket's watcher ends with it."""
    import threading

    security.configure(
        _cfg("endpoints.auth=curve", f"endpoints.keys_dir={keys}").endpoints, "rollout"
    )
    ctx = zmq.Context()
    ctx.MAX_SOCKETS = 32  # the limit is 1023 sockets: reached in a few hundred tries
    watchers = lambda: [t for t in threading.enumerate() if t.name == "client-handshakes"]  # noqa: E731
    try:
        for _ in range(48):  # half as many again as the context holds
            sock = ctx.socket(zmq.REQ)
            try:  # closed whatever happens: an open socket would hold the term() below
                security.secure_client(sock)
                sock.connect("tcp://127.0.0.1:9")  # nothing listens: a learner down
            finally:
                sock.close(0)
            # A Leave is tried every few seconds: its watcher ends meanwhile (on a loaded
            # machine not at once: opening the next at once ran out of sockets).
            wait_until(lambda: not watchers(), "the closed socket's watcher to end", 10)
    finally:
        ctx.term()


def test_a_curve_node_dialling_a_plain_server_is_told_auth_may_differ(keys, caplog):
    """Found by a review: a node with ``endpoints.auth=curve`` dialling a server without it
    was told only that its keys were not the run's, and sent to copy keys that were right.
    The line now names ``endpoints.auth`` too. Its keys' secrets never show in a repr."""
    import logging

    security.reset()  # the server: plain TCP
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = bind(pull, "tcp://127.0.0.1:*")
    security.configure(
        _cfg("endpoints.auth=curve", f"endpoints.keys_dir={keys}").endpoints, "rollout"
    )
    push = ctx.socket(zmq.PUSH)
    try:
        with caplog.at_level(logging.ERROR, logger=security.__name__):
            connect(push, addr)
            with contextlib.suppress(zmq.Again):
                push.send(b"never read", flags=zmq.NOBLOCK)
            wait_until(
                lambda: "endpoints.auth must be the same on every node" in caplog.text,
                "the client to say auth may differ",
                10,
            )
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
    loaded = security.Keys.load(keys, "buffer")
    assert loaded.server_secret is not None
    shown = repr(loaded)
    assert loaded.server_secret.decode() not in shown and loaded.client_secret.decode() not in shown
    assert loaded.server_public.decode() in shown
