"""The launcher tells the coordinator at once that a rollout server it reaped is gone.

Without this, a server killed with SIGKILL (or crashed) is noticed only when its heartbeats
stop for ``control.dead_after_s``; meanwhile the tasks it held count against the staleness
budget and the learner waits for groups nobody generates (measured on the CPU demo: ~16 s
for one batch). The launcher sees the death within its poll interval, so it sends the
control socket's ``Leave`` for the server, which re-deals its tasks at once.

The ``Leave`` carries the pid of the process that died (the role's own process, which is the
server: ``python -m rollout_servers.main`` registers with its ``os.getpid()``), so the
coordinator ignores it once a restarted incarnation has registered under the same id.

Never blocking the supervisor: each ``Leave`` goes out on a REQ socket of its own without
waiting; :meth:`Departures.poll` (called once per supervisor loop) collects the replies, and
a socket unanswered after ``timeout_s`` is closed with nothing left to send (linger 0), so a
``Leave`` never reaches a coordinator that comes back later. Every outcome is logged and
counted (``launch/leaves/sent``, ``launch/leaves/failed`` in ``launch.jsonl``); none is
fatal. With ``endpoints.auth: curve`` the launcher presents the learner's key (the
coordinator is the learner's; a ``Leave`` on behalf of a dead server is the learner side's
word).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq

    from asyncrl.config import Config

log = logging.getLogger("asyncrl.launch")

LEAVE_TIMEOUT_S = 3.0  # how long a Leave waits for the coordinator's reply
KEY_ROLE = "learner"  # whose CURVE key the launcher presents


@dataclass
class _Pending:
    server_id: str
    pid: int
    sock: zmq.Socket
    deadline: float


class Departures:
    """Sends ``Leave(server_id, pid, reason)`` for reaped rollout servers and collects the
    replies without ever waiting on them (see the module docstring)."""

    def __init__(self, control_addr: str, timeout_s: float = LEAVE_TIMEOUT_S):
        import zmq

        self.addr = control_addr
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter()
        self._ctx = zmq.Context()  # its own: closed with this object
        self._pending: list[_Pending] = []
        self._finished: list[dict[str, Any]] = []  # outcomes not yet collected by poll()

    @classmethod
    def from_config(cls, cfg: Config) -> Departures | None:
        """Dial ``endpoints.control`` with the learner's key when the run uses CURVE; None
        (with a warning) when that key cannot be read here."""
        from asyncrl.net import security
        from asyncrl.net.transport import config_endpoint

        try:
            security.configure(cfg.endpoints, KEY_ROLE)
        except SystemExit:  # the key is missing (configure said which file)
            log.warning(
                "no %s key in endpoints.keys_dir here: dead rollout servers are noticed "
                "after control.dead_after_s only",
                KEY_ROLE,
            )
            return None
        return cls(config_endpoint(cfg.endpoints, "control"))

    def send(self, server_id: str, pid: int, reason: str) -> None:
        """Queue the ``Leave`` of ``server_id`` (process ``pid``) and return at once."""
        import zmq

        from asyncrl.control import messages as m
        from asyncrl.net.transport import connect, make_socket
        from asyncrl.wire.base import encode

        msg = m.Leave(server_id=server_id, reason=reason, pid=pid)
        sock = make_socket(self._ctx, zmq.REQ)  # linger 0: closing drops what is unsent
        try:
            connect(sock, self.addr)
            sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            sock.close()
            self._done(server_id, pid, ok=False, why=f"cannot send: {e}")
            return
        self._pending.append(_Pending(server_id, pid, sock, time.monotonic() + self.timeout_s))

    def poll(self) -> list[dict[str, Any]]:
        """Collect the replies that came, and give up on the ones past their time; returns
        the outcomes since the last call, each the fields of a ``launch.jsonl`` event."""
        import zmq

        from asyncrl.control import messages as m

        now, waiting = time.monotonic(), []
        for p in self._pending:
            if p.sock.poll(0, zmq.POLLIN):
                try:
                    reply: Any = m.decode_reply(p.sock.recv(zmq.NOBLOCK))
                except Exception as e:  # a malformed reply: logged, never fatal
                    reply = e
                p.sock.close()
                ok = isinstance(reply, m.Ok)
                self._done(p.server_id, p.pid, ok, "" if ok else f"refused: {reply}")
            elif now >= p.deadline:
                p.sock.close()
                why = f"no reply from {self.addr} within {self.timeout_s:g}s"
                self._done(p.server_id, p.pid, ok=False, why=why)
            else:
                waiting.append(p)
        self._pending = waiting
        finished, self._finished = self._finished, []
        return finished

    def _done(self, server_id: str, pid: int, ok: bool, why: str = "") -> None:
        self.counts["sent" if ok else "failed"] += 1
        if ok:
            log.info("told the coordinator that %s (pid %d) is gone", server_id, pid)
        else:
            log.warning(
                "could not tell the coordinator that %s (pid %d) is gone (%s): it finds out "
                "after control.dead_after_s of silence",
                server_id,
                pid,
                why,
            )
        self._finished.append(
            {
                "server_id": server_id,
                "pid": pid,
                "ok": ok,
                **({"why": why} if why else {}),
                **{f"launch/leaves/{k}": float(v) for k, v in sorted(self.counts.items())},
            }
        )

    def close(self) -> None:
        """Drop what is still waiting (nothing is sent after this)."""
        for p in self._pending:
            p.sock.close()
        self._pending = []
        self._ctx.term()
