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
waiting; :meth:`Departures.poll` (called once per supervisor loop) collects the replies. A
try unanswered after ``timeout_s`` is closed with nothing left to send (linger 0) and the
``Leave`` goes out again on a fresh socket, until it is answered or ``give_up_s`` has passed
since the first try. The coordinator cannot answer while the learner (whose it is) restarts,
and the resumed one deals nothing until every server of its saved registry registered again
or left, or ``control.dead_after_s`` passed: a ``Leave`` dropped after one try made a server
that died during the restart hold the resume that long. Sending it late is safe (the
coordinator ignores a ``Leave`` naming an earlier incarnation than the registered one), and
so is sending it twice (a try that reached the coordinator but whose reply came after the
try was closed: the second finds the server gone). Every outcome is logged and counted
(``launch/leaves/sent``, ``launch/leaves/failed`` in ``launch.jsonl``, with the ``tries`` it
took); none is fatal. With ``endpoints.auth: curve`` the launcher presents the learner's key
(the coordinator is the learner's; a ``Leave`` on behalf of a dead server is the learner
side's word).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq

    from asyncrl.config import Config

log = logging.getLogger("asyncrl.launch")

LEAVE_TIMEOUT_S = 3.0  # how long one try of a Leave waits for the coordinator's reply
# How long an unanswered Leave is sent again: a learner restart (the coordinator's) and then
# its resume's wait for silent servers (control.dead_after_s) are both over by then.
LEAVE_GIVE_UP_S = 300.0
KEY_ROLE = "learner"  # whose CURVE key the launcher presents


@dataclass
class _Pending:
    server_id: str
    pid: int
    payload: bytes  # the encoded Leave, sent again as it is
    first: float  # when its first try went out
    tries: int = 0
    sock: zmq.Socket = field(init=False)  # the current try's
    deadline: float = field(init=False)  # the current try's


class Departures:
    """Sends ``Leave(server_id, pid, reason)`` for reaped rollout servers and collects the
    replies without ever waiting on them (see the module docstring)."""

    def __init__(
        self,
        control_addr: str,
        timeout_s: float = LEAVE_TIMEOUT_S,
        give_up_s: float = LEAVE_GIVE_UP_S,
    ):
        import zmq

        self.addr = control_addr
        self.timeout_s = timeout_s  # one try's wait for the reply
        self.give_up_s = give_up_s  # no try starts this long after the first
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
        give_up_s = max(LEAVE_GIVE_UP_S, cfg.control.dead_after_s)
        return cls(config_endpoint(cfg.endpoints, "control"), give_up_s=give_up_s)

    def send(self, server_id: str, pid: int, reason: str) -> None:
        """Queue the ``Leave`` of ``server_id`` (process ``pid``) and return at once."""
        from asyncrl.control import messages as m
        from asyncrl.wire.base import encode

        msg = m.Leave(server_id=server_id, reason=reason, pid=pid)
        self._try(_Pending(server_id, pid, encode(msg), time.monotonic()))

    def _try(self, p: _Pending) -> None:
        """Send ``p`` (again) on a fresh socket and keep it pending; when it cannot be sent,
        record that outcome instead."""
        import zmq

        from asyncrl.net.transport import connect, make_socket

        p.tries += 1
        sock = None
        try:
            sock = make_socket(self._ctx, zmq.REQ)  # linger 0: closing drops what is unsent
            connect(sock, self.addr)
            sock.send(p.payload, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a failed socket, too, is this Leave's failure only
            if sock is not None:
                sock.close()
            self._done(p, ok=False, why=f"cannot send: {e}")
            return
        p.sock, p.deadline = sock, time.monotonic() + self.timeout_s
        self._pending.append(p)

    def poll(self) -> list[dict[str, Any]]:
        """Collect the replies that came, send again the ones whose try is past its time
        (give up on those past ``give_up_s``); returns the outcomes since the last call,
        each the fields of a ``launch.jsonl`` event."""
        import zmq

        from asyncrl.control import messages as m

        now, pending, self._pending = time.monotonic(), self._pending, []
        for p in pending:
            if p.sock.poll(0, zmq.POLLIN):
                try:
                    reply: Any = m.decode_reply(p.sock.recv(zmq.NOBLOCK))
                except Exception as e:  # a malformed reply: logged, never fatal
                    reply = e
                p.sock.close()
                ok = isinstance(reply, m.Ok)
                self._done(p, ok, "" if ok else f"refused: {reply}")
            elif now < p.deadline:
                self._pending.append(p)
            else:
                p.sock.close()  # this try's Leave, if still unsent, is dropped
                if now - p.first >= self.give_up_s:
                    why = f"no reply from {self.addr} to {p.tries} tries over {now - p.first:.0f}s"
                    self._done(p, ok=False, why=why)
                    continue
                if p.tries == 1:
                    log.warning(
                        "no reply from the coordinator to the Leave of %s (pid %d) within "
                        "%gs (restarting?): sending it again every %gs for up to %gs",
                        p.server_id,
                        p.pid,
                        self.timeout_s,
                        self.timeout_s,
                        self.give_up_s,
                    )
                self._try(p)
        finished, self._finished = self._finished, []
        return finished

    def _done(self, p: _Pending, ok: bool, why: str = "") -> None:
        server_id, pid = p.server_id, p.pid
        self.counts["sent" if ok else "failed"] += 1
        if ok:
            log.info(
                "told the coordinator that %s (pid %d) is gone (try %d)", server_id, pid, p.tries
            )
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
                "tries": p.tries,
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
