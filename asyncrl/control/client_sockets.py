"""The coordinator client's three REQ sockets, each used by one caller at a time.

``tasks`` carries the long-polled task requests, ``control`` the requests answered at once
(registration, sync reports, acks, slots, leave), ``watch`` the heartbeat long-poll: a
long sync or a held task request never delays a heartbeat, an ack or a report. A REQ
socket takes one request at a time, so each has a lock; a caller that must not queue
behind another's timeout (a server stopping while the coordinator goes too) waits for the
lock only so long, and closing leaves a socket still in use to the process's exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal, TypeVar

import zmq

from asyncrl.control import messages as m
from asyncrl.net.transport import ReqClient

R = TypeVar("R")
Socket = Literal["tasks", "control", "watch"]


class ClientSockets:
    """``tasks``/``control``/``watch`` REQ sockets (see the module docstring)."""

    def __init__(
        self,
        tasks_addr: str,
        control_addr: str,
        *,
        timeout_s: float,
        context: zmq.Context,
        max_message_bytes: int = 0,
    ):
        def req(addr: str) -> ReqClient:
            return ReqClient(
                addr, timeout_s=timeout_s, context=context, max_message_bytes=max_message_bytes
            )

        self.by_name: dict[Socket, ReqClient] = {
            "tasks": req(tasks_addr),
            "control": req(control_addr),
            "watch": req(control_addr),
        }
        self._locks = {name: threading.Lock() for name in self.by_name}

    def call(
        self,
        sock: Socket,
        msg: m.Request,
        decode: Callable[[list[zmq.Frame]], R],
        timeout_s: float | None = None,
        lock_wait_s: float = -1.0,
    ) -> R:
        """One request/reply on ``sock``; raises TimeoutError when unanswered (or, with
        ``lock_wait_s`` >= 0, when the socket stays busy that long),
        :class:`~asyncrl.net.transport.RequestRefused` when refused."""
        lock = self._locks[sock]
        if not lock.acquire(timeout=lock_wait_s):
            raise TimeoutError(f"the {sock} socket stayed busy for {lock_wait_s:g}s")
        try:
            return self.by_name[sock].call(msg, decode, timeout_s)
        finally:
            lock.release()

    def close(self, wait_s: float | None, watch_in_use: bool) -> None:
        """Close the sockets, waiting for a call still out up to ``wait_s`` (None: as long
        as it takes); one still in use then, and ``watch`` while ``watch_in_use``, are left
        to the process's exit."""
        for name in ("tasks", "control", "watch"):
            if name == "watch" and watch_in_use:
                continue
            lock = self._locks[name]
            if lock.acquire(timeout=-1 if wait_s is None else wait_s):
                try:
                    self.by_name[name].close()
                finally:
                    lock.release()
