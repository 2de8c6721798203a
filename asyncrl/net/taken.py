"""A role whose listening port is taken ends in one line, not restarted.

``asyncrl-launch`` claims the run's ports before any role starts (:mod:`asyncrl.launch.ports`);
the Ray launcher and a role started by hand claim none, so there a port taken by another
process (another run, a leftover of an earlier one) is found when the role binds it. The
bind fails the same way on every restart: the role says which ``endpoints.*`` key and
address, and exits with the code the launchers never restart
(:data:`asyncrl.launch.restart_policy.CONFIG_ERROR`) rather than crash-loop with a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import time
from collections.abc import Iterator, Mapping

from asyncrl.config.schema import EndpointsConfig
from asyncrl.launch.restart_policy import CONFIG_ERROR
from asyncrl.net.ports import bindable

log = logging.getLogger(__name__)

#: How long a role waits for a taken port before it refuses: a restarted role's predecessor
#: (killed, its process tree still ending) may hold the port for a moment.
TAKEN_GRACE_S = 10.0
#: A listening address as the role configured it: key (``endpoints.batches``) -> host, port.
Listens = Mapping[str, tuple[str, int]]


def address_in_use(exc: BaseException) -> BaseException | None:
    """The "address already in use" error behind ``exc`` (itself, or its cause or context:
    a bind failure is often wrapped, as by the coordinator's start), else None. Both
    ``OSError`` and ``zmq.ZMQError`` carry the system's ``errno``."""
    return next((e for e in _chain(exc) if getattr(e, "errno", None) == errno.EADDRINUSE), None)


def taken_line(role: str, exc: BaseException, listens: Listens) -> str | None:
    """The one line for a bind of ``role`` that failed as ``exc``; None when ``exc`` is not
    an address in use at one of ``listens``. The key is the one whose port the error chain
    names (zmq names its address, the weight-sync store its host:port, asyncio its (host,
    port)); a port in use that is none of them (one a library chose, say) is no config
    problem, and a restart may well find it free."""
    if address_in_use(exc) is None:
        return None
    text = " ".join(str(e) for e in _chain(exc))
    named = {int(p) for p in re.findall(r"(?::|', )(\d+)\b", text)}
    keys = [k for k, (_, port) in listens.items() if port in named]
    if not keys:
        return None
    return _line(role, ", ".join(f"{k}={listens[k][1]} on {listens[k][0]}" for k in keys))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


@contextlib.contextmanager
def exit_if_taken(role: str, listens: Listens) -> Iterator[None]:
    """Around a role's start-up: a bind that fails with "address already in use" logs
    :func:`taken_line` and exits with ``CONFIG_ERROR``; anything else propagates."""
    try:
        yield
    except Exception as e:
        line = taken_line(role, e, listens)
        if line is None:
            raise
        log.error("%s", line)
        raise SystemExit(CONFIG_ERROR) from None


def exit_unless_free(role: str, listens: Listens) -> None:
    """Before a role binds ``listens`` (and before it loads a model): exit as
    :func:`exit_if_taken` does when one is taken now. For a bind whose failure does not
    reach the role's main with its cause (the coordinator's start gives up waiting for a
    thread that failed to bind, in a ``TimeoutError``)."""
    taken = {k: v for k, v in listens.items() if not bindable(*v)}
    deadline = time.monotonic() + TAKEN_GRACE_S
    if taken:  # a predecessor killed a moment ago may hold it still: not a config problem
        log.info(
            "%s: %s in use; waiting up to %gs for it to be freed", role, list(taken), TAKEN_GRACE_S
        )
    while taken and time.monotonic() < deadline:
        time.sleep(0.5)
        taken = {k: v for k, v in taken.items() if not bindable(*v)}
    if taken:
        where = ", ".join(f"{k}={port} on {host}" for k, (host, port) in taken.items())
        log.error("%s", _line(role, where))
        raise SystemExit(CONFIG_ERROR)


def _line(role: str, where: str) -> str:
    return (
        f"{role}: cannot listen at {where}: address already in use (another run, or a "
        "process left of an earlier one?): stop it, or choose a free port"
    )


def endpoint_listens(endpoints: EndpointsConfig, *keys: str) -> dict[str, tuple[str, int]]:
    """``endpoints.<key>`` -> (host, port) for those of the sockets ``keys`` that are TCP
    (with ``endpoints.host=ipc://`` only the weight-sync store, on loopback)."""
    from asyncrl.launch.ports import tcp_ports

    host, tcp = tcp_ports(endpoints)
    return {f"endpoints.{k}": (host, getattr(endpoints, k)) for k in keys if k in tcp}
