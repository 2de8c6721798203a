"""The ports and the run directory of a run launched on one machine, claimed before any role
starts: a second run must neither crash-loop on the first one's ports nor write into its
run directory.

The coordinator's and the buffer's ports (``endpoints.*``) have fixed defaults, so that
roles started by hand on several machines find each other. ``asyncrl-launch`` runs every
role on this machine, so it claims them first (:func:`claim`):

- a port left at its default that is taken (bound by another process, or claimed by
  another live launch that has not bound it yet) moves, with every other default port, to
  free ones; the resolved config in the run directory, which every role reads, says which;
- a taken port the user chose is refused in one line naming its key;
- a run directory in use by another live launch is refused in one line naming
  ``trainer.experiment_name``;
- an ``endpoints.host`` that is not an address of this machine is refused in one line
  (every role runs here, and binds it);
- with ``endpoints.host=ipc://<dir>`` only the weight-sync store's port is TCP (on
  127.0.0.1), so only it is claimed; the ipc sockets stay as configured.

Claims live in a small file in the system's temporary directory, changed under a file lock
(launches started at the same instant are served one after the other; a lock held past
``CLAIMS_LOCK_TIMEOUT_S``, by a launcher stopped with Ctrl-Z say, is refused in one line
naming the lock and its holder) and pruned of launches that are gone; the run directory
is held with a lock on ``launch.lock`` that the kernel lets go when the launcher exits,
however it exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from asyncrl.config import Config, ConfigError
from asyncrl.config.schema import EndpointsConfig
from asyncrl.net.ports import bindable, free_ports, local_address

log = logging.getLogger(__name__)

#: The ``endpoints.*`` keys that are ports.
PORT_KEYS = ("tasks", "trajectories", "batches", "control", "sync_store")
#: How long a launch waits for the port-claims lock. A launch holds it for milliseconds
#: (read, check a few ports, write), so this is far past any queue of launches started at
#: once; only a launcher stopped (Ctrl-Z) or hung while holding it takes longer.
CLAIMS_LOCK_TIMEOUT_S = 30.0
#: How often the wait for the port-claims lock is logged.
CLAIMS_LOCK_REPORT_S = 5.0


class Refusal(ConfigError):
    """A launch this machine cannot serve, not a bad key: a :class:`ConfigError` so that
    the launcher refuses before anything starts, and ``str`` is its one line (not
    "invalid config")."""

    def __str__(self) -> str:
        return self.problems[0]


class ClaimsLockTimeout(Refusal):
    """The port-claims lock stayed held past :data:`CLAIMS_LOCK_TIMEOUT_S`."""


def claims_file() -> Path:
    return Path(tempfile.gettempdir()) / f"asyncrl-launch-ports-{os.getuid()}.json"


@contextlib.contextmanager
def _locked_claims() -> Iterator[dict[str, list[int]]]:
    """The live launches' claimed ports (pid -> ports), read and written under a lock."""
    path = claims_file()
    with open(path, "a+") as f:
        _lock(f, path)
        f.seek(0)
        try:
            claims = json.loads(f.read() or "{}")
        except json.JSONDecodeError:
            claims = {}
        live = {pid: ports for pid, ports in claims.items() if _alive(int(pid))}
        yield live
        f.seek(0)
        f.truncate()
        f.write(json.dumps(live))


def _lock(f: IO[str], path: Path) -> None:
    """Take the claims lock on ``f``, waiting at most :data:`CLAIMS_LOCK_TIMEOUT_S` and
    saying so every :data:`CLAIMS_LOCK_REPORT_S`: a launcher stopped while it held the lock
    would otherwise block every later launch on this machine without a word."""
    start = time.monotonic()
    report_at = start + CLAIMS_LOCK_REPORT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now - start >= CLAIMS_LOCK_TIMEOUT_S:
            raise ClaimsLockTimeout([_lock_timeout_line(path, _lock_holder(f), now - start)])
        if now >= report_at:
            log.warning(
                "waiting for the port-claims lock at %s (held by another launch) for %.0fs",
                path,
                now - start,
            )
            report_at += CLAIMS_LOCK_REPORT_S
        time.sleep(0.05)


def _lock_holder(f: IO[str]) -> int | None:
    """The pid holding the flock on ``f``'s file, from ``/proc/locks``; None where it
    cannot be seen (no ``/proc``, a holder in another pid namespace)."""
    st = os.fstat(f.fileno())
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; a waiter's line has "->" second
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == ident:
            return int(fields[4]) if fields[4].isdigit() and fields[4] != "0" else None
    return None


def _lock_timeout_line(path: Path, holder: int | None, waited_s: float) -> str:
    """The one line a launch refuses with when the claims lock stays held."""
    who = "another process"
    if holder is not None:
        who = f"pid {holder}"
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{holder}/stat").read_bytes()
            if stat[stat.rindex(b")") + 2 :].split()[0] in (b"T", b"t"):
                who += " (stopped)"
    pid = holder if holder is not None else "PID"
    return (
        f"the port-claims lock at {path} was held by {who} for {waited_s:.0f}s, longer than "
        f"any launch needs to claim its ports: a launcher stopped with Ctrl-Z must be "
        f"resumed (fg, or kill -CONT {pid}) or ended (kill {pid}); if no asyncrl-launch "
        f"runs on this machine, remove {path}"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(cfg: Config) -> Config:
    """Claim the run's ports for this process (see the module docstring); returns the
    config with the ports it will use. Raises :class:`ConfigError` naming the key to change
    when a port the user chose is taken, :class:`Refusal` when ``endpoints.host`` is not
    this machine's."""
    ep = cfg.endpoints
    defaults = EndpointsConfig()
    host, keys = tcp_ports(ep)
    if not local_address(host):  # else every port reads as taken, and none is free
        raise Refusal(
            [
                f"endpoints.host={host} is not an address of this machine; asyncrl-launch "
                "runs every role here: use 127.0.0.1 (or this machine's address), or start "
                "the roles by hand on their machines, or use the Ray launcher (--ray)"
            ]
        )
    with _locked_claims() as claims:
        others = {p for ports in claims.values() for p in ports}
        taken = [k for k in keys if getattr(ep, k) in others or not bindable(host, getattr(ep, k))]
        chosen = [k for k in taken if getattr(ep, k) != getattr(defaults, k)]
        if chosen:
            raise ConfigError(
                [
                    f"endpoints.{k}={getattr(ep, k)} is taken on {host} (another run?): "
                    "choose a free port, or leave it at its default to have one chosen"
                    for k in chosen
                ]
            )
        if taken:
            movable = [k for k in keys if getattr(ep, k) == getattr(defaults, k)]
            keep = {getattr(ep, k) for k in keys if k not in movable}
            ports = free_ports(host, len(movable), others | keep)
            moved = dict(zip(movable, ports, strict=True))
            log.warning(
                "endpoints %s taken on %s (another run on this machine?): this run uses %s",
                ", ".join(f"{k}={getattr(ep, k)}" for k in taken),
                host,
                " ".join(f"endpoints.{k}={p}" for k, p in moved.items()),
            )
            ep = ep.model_copy(update=moved)
            cfg = cfg.model_copy(update={"endpoints": ep})
        claims[str(os.getpid())] = [getattr(ep, k) for k in keys]
    return cfg


def tcp_ports(ep: EndpointsConfig) -> tuple[str, tuple[str, ...]]:
    """The host the run's TCP ports bind on and their ``endpoints.*`` keys. With
    ``endpoints.host=ipc://<dir>`` the sockets are files named after their keys, and only
    the weight-sync store is TCP, on loopback (``asyncrl.control.setup.store_host``)."""
    if ep.host.startswith("ipc://"):
        return "127.0.0.1", ("sync_store",)
    return ep.host, PORT_KEYS


def hold_run_dir(run_dir: Path) -> IO[str]:
    """Lock ``run_dir`` for this launch (keep the returned file open while the run lasts)
    and clear what an earlier launch left that would mislead this one; raises
    :class:`ConfigError` when another live launch holds it, or it cannot be made."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(run_dir / "launch.lock", "a+")  # noqa: SIM115 - held for the run's life
    except OSError as e:
        raise ConfigError(
            [
                f"run directory {run_dir} cannot be made or written ({e.strerror or e}): set "
                "trainer.default_local_dir to a writable folder"
            ]
        ) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise ConfigError(
            [
                f"run directory {run_dir} is in use by another asyncrl-launch (pid {holder}): "
                "give this run its own trainer.experiment_name (or stop that run)"
            ]
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    # The run directory is this launch's now: endpoint URLs an earlier launch's servers
    # wrote point at servers that are gone (each server writes its own as it serves).
    shutil.rmtree(run_dir / "openai_endpoints", ignore_errors=True)
    return f
