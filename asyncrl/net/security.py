"""Who may connect: ZeroMQ CURVE on every asyncrl socket, and the rule that keeps a run
from listening on a network unauthenticated.

With ``endpoints.auth: curve`` every socket a role binds (the coordinator's task and
control sockets, the buffer's trajectory and batch sockets) is a CURVE server with the
run's server key, and every socket a role connects presents its role's client key. A ZAP
handler in each serving process accepts only the client keys found in
``endpoints.keys_dir`` (written by ``asyncrl-prepare keys``); any other peer (no key, a
key of another run) is refused before a single message of it is read, counted
(``security/rejected_connections``) and logged once per peer address with the fix.

The setting is per process: each role's ``main`` calls :func:`configure` once, and
:func:`asyncrl.net.transport.bind` / :func:`asyncrl.net.transport.connect` apply it to every
socket. A process that never calls it (a test, a tool) uses plain TCP.

The handler records the key's role as the connection's ``User-Id``; what each role may
ask of each service is :mod:`asyncrl.net.authority`'s, checked by
:class:`asyncrl.net.serving.RouterService` (refusals counted as ``security/refused/<role>``).

Key files are ZeroMQ's own certificates: ``server.key`` / ``server.key_secret`` and one
pair per role (``learner``, ``buffer``, ``rollout``); ``*.key`` files hold only public
keys. A node needs the public keys and its own role's secret; the serving roles (learner,
buffer) also ``server.key_secret``. :func:`write_keys` writes the full set and, under one
folder per role, exactly what a node of that role needs: a rollout node, which runs
model-driven tools and user reward code, never holds another role's secret.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import sys
import tempfile
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

from asyncrl.net import handshakes

if TYPE_CHECKING:
    from asyncrl.config.schema import EndpointsConfig

log = logging.getLogger(__name__)

KEY_ROLES = ("learner", "buffer", "rollout")  # client key pairs: one per role
SERVING_ROLES = ("learner", "buffer")  # they bind sockets: they hold the server's secret
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"asyncrl"
Z85_KEY_CHARS = 40  # a CURVE key is 32 bytes, 40 characters in z85


def node_files(role: str) -> list[str]:
    """The key files a node running ``role`` needs: every public key, its own secret, and
    the server's secret when the role serves."""
    files = ["server.key", *(f"{r}.key" for r in KEY_ROLES), f"{role}.key_secret"]
    if role in SERVING_ROLES:
        files.append("server.key_secret")
    return files


def write_keys(out: Path) -> list[Path]:
    """Create the run's key pairs in ``out`` (the server's and one per role), and in
    ``out/<role>/`` the files a node of that role needs (:func:`node_files`); returns the
    files written. Existing keys are replaced (``asyncrl-prepare keys`` asks for --force)."""
    import zmq.auth

    out.mkdir(parents=True, exist_ok=True)
    written = []
    # Made in a folder only we may enter (mkdtemp: 0700), made 0600 there, then moved in:
    # written straight into ``out`` under the umask, a secret was readable by anyone on
    # the machine until its chmod, and a reader who opened it then keeps it.
    staging = Path(tempfile.mkdtemp(prefix=".keys-", dir=out))
    try:
        for name in ("server", *KEY_ROLES):
            public, secret = map(Path, zmq.auth.create_certificates(str(staging), name))
            secret.chmod(0o600)
            public.chmod(0o644)
            written += [public.replace(out / public.name), secret.replace(out / secret.name)]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for role in KEY_ROLES:
        node = out / role
        node.mkdir(exist_ok=True)
        node.chmod(0o700)
        for name in node_files(role):
            written.append(Path(shutil.copy2(out / name, node / name)))
    return written


@dataclass
class Keys:
    """The keys one process uses (z85 bytes): the server pair (a serving role holds its
    secret), its own client pair, and the client public keys the run accepts."""

    server_public: bytes
    server_secret: bytes | None = field(repr=False)  # never in a log line or a traceback
    client_public: bytes
    client_secret: bytes = field(repr=False)
    allowed: dict[bytes, str]  # client public key -> role name

    @classmethod
    def load(cls, keys_dir: str | Path, role: str) -> Keys:
        """Read ``role``'s keys from ``keys_dir``: the full set or a node's folder. Needs
        the server's public key and the role's own pair; a serving role also the server's
        secret and every role's public key (whom to let in)."""
        d = Path(keys_dir)
        needed = ["server.key", f"{role}.key_secret"]
        if role in SERVING_ROLES:
            needed = node_files(role)
        missing = [str(d / name) for name in needed if not (d / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"endpoints.keys_dir={keys_dir}: missing {', '.join(missing)} (create them "
                f"with: asyncrl-prepare keys --out DIR, then give this node DIR/{role}/)"
            )
        server_public, _ = _read_key(d / "server.key")
        server_secret = None
        if (d / "server.key_secret").is_file():
            _, server_secret = _read_key(d / "server.key_secret", secret=True)
        client_public, client_secret = _read_key(d / f"{role}.key_secret", secret=True)
        assert client_secret is not None  # _read_key(secret=True) refuses a file without it
        allowed = {_read_key(d / f"{r}.key")[0]: r for r in KEY_ROLES if (d / f"{r}.key").is_file()}
        return cls(server_public, server_secret, client_public, client_secret, allowed)


class KeyFileError(ValueError):
    """A key file is there but is no key of the kind its name says."""


def _read_key(path: Path, secret: bool = False) -> tuple[bytes, bytes | None]:
    """``(public, secret)`` z85 keys of a certificate file; a file that is not one (empty,
    cut, a public key copied over a secret one) is a :class:`KeyFileError` in one line."""
    import zmq.auth

    try:
        public, private = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as e:
        public, private, why = b"", None, str(e)
    else:
        why = "it holds no secret key (a public key file?)" if secret and private is None else ""
        if any(k is not None and len(k) != Z85_KEY_CHARS for k in (public, private)):
            why = f"a key in it is not {Z85_KEY_CHARS} z85 characters (a cut copy?)"
    if why:
        raise KeyFileError(
            f"endpoints.keys_dir: {path} is not a usable key file ({why}); copy it again from "
            "the folder asyncrl-prepare keys wrote, or make the run's keys anew with "
            "asyncrl-prepare keys --out DIR --force and give every node its folder"
        )
    return public, private


def keys_problem(endpoints: EndpointsConfig, roles: tuple[str, ...] = KEY_ROLES) -> str | None:
    """Why ``roles`` could not all start from ``endpoints.keys_dir`` here (a launch on one
    machine runs them all), in one line; None without CURVE or with every key there."""
    if endpoints.auth != "curve" or endpoints.keys_dir is None:
        return None
    for role in roles:
        try:
            Keys.load(endpoints.keys_dir, role)
        except (FileNotFoundError, KeyFileError) as e:
            return str(e)
    return None


@dataclass
class _Settings:
    keys: Keys | None = None  # None: plain TCP
    counts: Counter[str] = field(default_factory=Counter)
    # One ZAP handler per context, gone with it (a new context gets its own).
    handlers: weakref.WeakKeyDictionary[zmq.Context, ZapHandler] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    lock: threading.Lock = field(default_factory=threading.Lock)


_SETTINGS = _Settings()


def configure(endpoints: EndpointsConfig, role: str) -> None:
    """This process is ``role``; with ``endpoints.auth: curve`` its sockets use CURVE."""
    if endpoints.auth == "curve":
        assert endpoints.keys_dir is not None  # the config rules require it
        try:
            keys = Keys.load(endpoints.keys_dir, role)
        except (FileNotFoundError, KeyFileError) as e:  # a config problem: exit 2, not restarted
            sys.stderr.write(f"{e}\n")
            raise SystemExit(2) from None
        _SETTINGS.keys = keys
        log.info("transport: CURVE, %s's key, accepting %d role keys", role, len(keys.allowed))
    else:
        _SETTINGS.keys = None


def reset() -> None:
    """Back to plain TCP (tests)."""
    _SETTINGS.keys = None


def count(name: str) -> None:
    """Add one to this process's ``security/<name>`` counter (a refusal, say)."""
    with _SETTINGS.lock:
        _SETTINGS.counts[name] += 1


def metrics() -> dict[str, float]:
    """``security/...`` counters of this process."""
    counts = dict(_SETTINGS.counts)  # one copy: other threads count while we read
    return {f"security/{k}": float(v) for k, v in sorted(counts.items())}


def secure_server(sock: zmq.Socket) -> None:
    """Before ``bind``: make ``sock`` a CURVE server checked by this context's ZAP handler."""
    keys = _SETTINGS.keys
    if keys is None:
        return
    if keys.server_secret is None:
        raise FileNotFoundError("server.key_secret is missing: this role cannot serve")
    with _SETTINGS.lock:
        ctx = sock.context
        if ctx not in _SETTINGS.handlers:
            _SETTINGS.handlers[ctx] = ZapHandler(ctx, keys.allowed)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    handshakes.watch_server(sock, count)


def secure_client(sock: zmq.Socket) -> None:
    """Before ``connect``: present this role's client key and expect the run's server."""
    keys = _SETTINGS.keys
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
    handshakes.watch_client(sock, count)


class ZapHandler:
    """ZeroMQ's authentication hook for one context (RFC 27): a thread answering the
    library's questions on ``inproc://zeromq.zap.01``. Accepts a CURVE peer whose public
    key is one of the run's; refuses anything else, counted and logged once per address."""

    def __init__(self, ctx: zmq.Context, allowed: dict[bytes, str]):
        self.allowed = allowed
        self.warned: set[str] = set()
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        """Consumes ZAP requests; produces one reply each. Waits on its socket; unblocked
        by each connection attempt, ended by the context's termination."""
        while True:
            try:
                frames = self.sock.recv_multipart()
            except zmq.ZMQError:  # the context is terminated: let its term() finish
                self.sock.close(0)
                return
            self.sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        version, request_id = frames[0], frames[1]
        address = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
        mechanism = frames[5] if len(frames) > 5 else b""
        role = None
        if mechanism == b"CURVE" and len(frames) > 6:
            role = self.allowed.get(z85.encode(frames[6]))
        if role is not None:
            count("accepted_connections")  # under the lock: other threads count too
            return [version, request_id, b"200", b"OK", role.encode(), b""]
        count("rejected_connections")
        if address not in self.warned:
            self.warned.add(address)
            log.warning(
                "refused a connection from %s (%s): its key is not one of this run's; give "
                "it the run's keys (endpoints.keys_dir, from asyncrl-prepare keys)",
                address,
                "no CURVE key" if mechanism != b"CURVE" else "unknown CURVE key",
            )
        return [version, request_id, b"400", b"unknown key", b"", b""]


def loopback(host: str) -> bool:
    """Whether ``host`` (``endpoints.host``) reaches this machine only."""
    if host.startswith("ipc://") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(endpoints: EndpointsConfig) -> str | None:
    """Why these endpoints may not be used as configured (None: fine): a network address
    without authentication needs one of two explicit choices."""
    if endpoints.auth == "curve" or endpoints.insecure or loopback(endpoints.host):
        return None
    return (
        f"endpoints.host={endpoints.host} listens on a network without authentication: "
        "anyone who reaches it could push training data or take tasks. Either create keys "
        "(asyncrl-prepare keys --out DIR) and set endpoints.auth=curve endpoints.keys_dir=DIR, "
        "or, on a private network you trust, set endpoints.insecure=true"
    )
