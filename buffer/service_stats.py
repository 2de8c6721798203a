"""The buffer service's own bookkeeping, apart from its contents: rejected messages (each
kind logged once, then only counted), bytes and messages in, trajectories/s and MB/s over
a window, and how long reading was paused for backpressure. No sockets; callers pass
``now`` (monotonic seconds)."""

from __future__ import annotations

import logging
from collections import Counter

from asyncrl.wire import NamedTask, WireError

log = logging.getLogger(__name__)

RATE_WINDOW_S = 2.0
#: A single pause this long is logged as a warning, then again at each doubling.
PAUSE_WARN_S = 60.0


class ServiceStats:
    def __init__(self) -> None:
        self.rejects: Counter[str] = Counter()  # "<socket>/<kind>"
        self.io: Counter[str] = Counter()  # bytes_in, messages_in, replies_undeliverable
        self.rates = {"buffer/trajectories_per_s": 0.0, "buffer/mb_per_s": 0.0}
        self.started = 0.0
        self._logged: set[str] = set()
        self._paused_since: float | None = None
        self._resumed_at: float | None = None  # when the last pause ended
        self._paused_s = 0.0
        self._pause_warn_at = PAUSE_WARN_S  # the next warning, in seconds of one pause
        self.gc_runs, self.gc_s = 0, 0.0  # scheduled garbage collections, their seconds
        self._window = (0.0, 0.0, 0.0)  # (time, trajectories, MB) at the last rate update

    def start(self, now: float) -> None:
        self.started = now
        self._window = (now, 0.0, 0.0)

    def reject(
        self, socket: str, err: WireError, named: list[NamedTask] | None = None, dropped: int = 0
    ) -> None:
        """Count a rejected message; the first of each kind is logged with its reason, the
        server and a task its header ``named`` (if it could be read), the config key to
        change, and how many of its groups were reported ``dropped``."""
        key = f"{socket}/{err.kind}"
        self.rejects[key] += 1
        if key in self._logged:
            return
        self._logged.add(key)
        sender = ""
        if named:
            servers = sorted({t.server_id for t in named if t.server_id})[:3]  # a line
            more = f" and {len(named) - 1} more" if len(named) > 1 else ""
            by = f"server {', '.join(servers)}" if servers else "a server (no server_id)"
            sender = f" from {by}, task {named[0].task_id}{more}"
        fix = f"; raise {err.key} in the config every role reads" if err.key else ""
        told = f"; groups reported dropped to the coordinator: {dropped}" if dropped else ""
        log.warning(
            "rejected a %s message%s (%s)%s%s; further ones are only counted in buffer/rejects/%s",
            socket,
            sender,
            err,
            fix,
            told,
            key,
        )

    def collected(self, seconds: float) -> None:
        """Count a scheduled garbage collection and its seconds (``buffer/gc_runs``,
        ``buffer/gc_s``)."""
        self.gc_runs += 1
        self.gc_s += seconds

    def set_paused(self, paused: bool, now: float) -> None:
        if paused:
            self._paused_since = now
            # Debug only: under steady backpressure this flips at every batch; the periodic
            # summary, buffer/paused_s and a long pause's warnings (check_pause) say more.
            log.debug("buffer full: not reading trajectories")
        elif self._paused_since is not None:
            self._paused_s += now - self._paused_since
            self._paused_since = None
            self._resumed_at = now
            self._pause_warn_at = PAUSE_WARN_S

    def check_pause(self, now: float) -> None:
        """Warn when one pause has lasted :data:`PAUSE_WARN_S`, and again each time its
        length doubles: a full buffer that nobody empties (a learner that stopped pulling or
        acknowledging) must not look like an idle one."""
        if self._paused_since is None or now - self._paused_since < self._pause_warn_at:
            return
        log.warning(
            "buffer full for %.0fs: trajectories wait in the rollout servers' queues until "
            "the learner takes a batch (is the learner pulling and acknowledging? "
            "buffer.capacity_groups bounds what the buffer holds)",
            now - self._paused_since,
        )
        self._pause_warn_at *= 2

    @property
    def paused(self) -> bool:
        """Whether reading is paused now."""
        return self._paused_since is not None

    @property
    def resumed_at(self) -> float | None:
        """When the last pause ended (None: none has)."""
        return self._resumed_at

    def paused_s(self, now: float) -> float:
        """Seconds reading has been paused in all, the pause under way included."""
        current = now - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_s + current

    def reading_clock(self, now: float) -> float:
        """``now`` less the time reading was paused: the clock incomplete groups age by. A
        member waiting in the socket while the buffer is full cannot arrive, so the pause
        must not count against its group's ``group_timeout_s``."""
        return now - self.paused_s(now)

    def update_rates(self, now: float, trajectories: float) -> None:
        """Rates over the last :data:`RATE_WINDOW_S` or more; ``trajectories`` read so far."""
        t0, b0, m0 = self._window
        if now - t0 < RATE_WINDOW_S:
            return
        mb = self.io["bytes_in"] / 1e6
        self.rates["buffer/trajectories_per_s"] = (trajectories - b0) / (now - t0)
        self.rates["buffer/mb_per_s"] = (mb - m0) / (now - t0)
        self._window = (now, trajectories, mb)

    def metrics(self, now: float) -> dict[str, float]:
        out = {f"buffer/rejects/{k}": float(v) for k, v in self.rejects.items()}
        out["buffer/rejects/total"] = float(sum(self.rejects.values()))
        out |= {f"buffer/{k}": float(v) for k, v in self.io.items()}
        out |= self.rates
        out["buffer/paused_s"] = self.paused_s(now)
        if self.gc_runs:
            out["buffer/gc_runs"], out["buffer/gc_s"] = float(self.gc_runs), self.gc_s
        out["buffer/uptime_s"] = now - self.started if self.started else 0.0
        return out


def summary(m: dict[str, float]) -> str:
    """One log line from the buffer's metrics."""
    keys = ("size", "ready", "incomplete", "unacked_batches", "groups_in", "groups_out")
    drops = {k.split("/")[-1]: int(v) for k, v in m.items() if "/drops/" in k and v}
    text = " ".join(f"{k}={int(m.get(f'buffer/{k}', 0))}" for k in keys)
    paused = m.get("buffer/paused_s", 0.0)
    text += f" drops={drops} rejects={int(m.get('buffer/rejects/total', 0))}"
    return text + (f" paused={paused:.0f}s" if paused >= 1 else "")
