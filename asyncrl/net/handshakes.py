"""The CURVE handshakes a socket's peers failed, told as they happen: libzmq's monitor of
the socket, read by a thread of its own that ends when the socket closes. A server counts
the peers refused before any key was checked (the ZAP handler explains the rest); a client
says, once per socket, that the peer refused its keys, which to it is otherwise silence.
``count`` is :func:`asyncrl.net.security.count` (``security/<name>`` counters)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import zmq

log = logging.getLogger("asyncrl.net.security")  # its lines are the security module's

_MONITORS = itertools.count()

HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _on_handshake_failures(
    sock: zmq.Socket, name: str, handle: Callable[[Mapping[str, Any]], None]
) -> None:
    """Call ``handle`` with each of ``sock``'s failed-handshake events (libzmq's monitor),
    in a thread of its own that ends when the socket closes."""
    from zmq.utils.monitor import recv_monitor_message

    # STOPPED in the mask, or libzmq says nothing at the close and the thread and its
    # socket lived as long as the context: a launcher's fresh socket per Leave try ran its
    # context out of sockets. A name of its own: pyzmq's default reuses closed fds' names.
    events = HANDSHAKE_FAILURES | zmq.EVENT_MONITOR_STOPPED
    monitor = sock.get_monitor_socket(events, f"inproc://asyncrl-monitor-{next(_MONITORS)}")

    def watch() -> None:
        """Consumes the socket's handshake-failure events until the socket closes."""
        while True:
            try:
                event = recv_monitor_message(monitor)
            except zmq.ZMQError:  # the context is terminated
                monitor.close(0)
                return
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                monitor.close(0)
                return
            handle(event)

    threading.Thread(target=watch, name=name, daemon=True).start()


def _endpoint(event: Mapping[str, Any]) -> str:
    return event.get("endpoint", b"?").decode(errors="replace")


def watch_server(sock: zmq.Socket, count: Callable[[str], None]) -> None:
    """Count the peers whose handshake failed before any key was checked (a plain-TCP
    client, a garbled greeting): libzmq refuses them without asking the ZAP handler."""
    warned = False

    def refused(event: Mapping[str, Any]) -> None:
        nonlocal warned
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # the ZAP handler counted and explained it
        count("rejected_connections")
        if not warned:
            warned = True
            log.warning(
                "refused a connection to %s: no CURVE handshake from the peer (a client "
                "without the run's keys, one with another run's server key, or not an "
                "asyncrl role); give it the run's keys (endpoints.auth=curve, "
                "endpoints.keys_dir)",
                _endpoint(event),
            )

    _on_handshake_failures(sock, "handshakes", refused)


def watch_client(sock: zmq.Socket, count: Callable[[str], None]) -> None:
    """Say, once per socket, when the peer refuses this node's handshake: to the client
    the refusal is otherwise only silence (its requests time out, its pushes queue)."""
    said = False

    def refused(event: Mapping[str, Any]) -> None:
        nonlocal said
        count("client_handshakes_failed")
        if said:
            return
        said = True
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = "it does not know this node's key: this node's keys are not the run's"
        else:  # no detail: a wrong server key looks the same as a peer gone mid-handshake
            why = (
                "its key is not the server key this node has, it does not use CURVE "
                "(endpoints.auth must be the same on every node), or it went away "
                "mid-handshake (restarting, stopped): if this repeats while it runs, this "
                "node's keys are not the run's"
            )
        log.error(
            "the CURVE handshake with %s failed (%s); copy endpoints.keys_dir from the node "
            "that made them (asyncrl-prepare keys), then start this role again",
            _endpoint(event),
            why,
        )

    _on_handshake_failures(sock, "client-handshakes", refused)
