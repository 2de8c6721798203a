"""Choosing free ports that stay free until a role binds them.

A port found by binding port 0 comes from the kernel's ephemeral range, the same range it
hands out as the local port of every outgoing connection on the machine. Between choosing
such a port and binding it (a role's start-up takes seconds to minutes), any connection made
meanwhile (a role's ZeroMQ connect, vLLM's own sockets) may be given it, and the role then
fails with "address already in use". :func:`free_ports` chooses from outside that range, so
only another process that binds the very port by number can take it.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

#: Where Linux says which ports it hands out on its own.
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Below this are the registered services (databases, web servers); not chosen.
LOWEST = 20000


def ephemeral_range() -> tuple[int, int]:
    """The ports (low, high, inclusive) the kernel gives to port-0 binds and outgoing
    connections; Linux's default where the system does not say."""
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` now (as the roles' sockets bind it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def local_address(host: str) -> bool:
    """Whether ``host`` is an address (or a name of an address) of this machine: one a
    socket can bind. On any other every port looks taken, and binding fails whatever the
    port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, 0))
        except OSError:  # socket.gaierror (a name that does not resolve) among them
            return False
    return True


def free_ports(host: str, n: int, avoid: Collection[int] = ()) -> list[int]:
    """``n`` different ports bindable on ``host`` now, none in ``avoid``, outside the
    kernel's ephemeral range where it leaves room (see the module docstring); ports the
    kernel offers otherwise (a machine whose ephemeral range covers every port)."""
    low, high = ephemeral_range()
    pool = [p for p in (*range(LOWEST, low), *range(high + 1, 65536)) if p not in avoid]
    rng = random.Random()  # seeded from the OS: two runs started at once choose apart
    chosen: list[int] = []
    for port in rng.sample(pool, min(len(pool), 64 * n)):
        if len(chosen) == n:
            return chosen
        if bindable(host, port):
            chosen.append(port)
    return chosen + _offered(host, n - len(chosen), set(avoid) | set(chosen))


def _offered(host: str, n: int, avoid: set[int]) -> list[int]:
    """``n`` different ports the kernel offers free on ``host`` (held open together while
    chosen, so no two are the same), none in ``avoid``."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            socks.append(s)
            s.bind((host, 0))
            if (port := s.getsockname()[1]) not in avoid:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports
