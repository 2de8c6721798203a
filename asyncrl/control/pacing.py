"""Per-server pacing (``staleness.pace_servers``): a rollout server whose groups go stale
before the learner takes them is dealt fewer at once. Pure: no I/O, no clock.

Why: the admission rule (:mod:`asyncrl.control.admission`) bounds lag on the assumption
that groups are trained roughly in the order they were dealt. Servers of unequal speed
break it. A slow server (a smaller device, a shared core, a low CPU priority) holds as many
groups as a fast one, each of them generating at a fraction of the speed: the fast server's
later groups are trained first, the learner's version moves on, and the slow server's
groups arrive too old and are dropped for lag. Their generation is wasted, and while they
generate they hold admission budget the fast server waits for. On the CPU benchmark's long
responses (``benchmarks/vs_trl.py``: one of two servers at the lowest CPU priority) about
11% of the groups dealt were dropped so; capping the slow server at 4 groups by hand left
1-3 drops in a run, against 58-75 uncapped.

The rule, per server, in groups (additive increase, multiplicative-like decrease):

- a server starts at the ceiling, ``rollout.max_inflight // rollout.n`` (what it holds
  without pacing);
- each of its groups the buffer drops for lag lowers its cap by one (at least one group),
  if its share of stale groups is an outlier: more than twice the other servers' share,
  and more than :data:`MIN_STALE_SHARE`. A wave of stale groups lowers it by the size of
  the wave;
- each time it has had ``cap`` groups trained since its last change, its cap rises by one,
  up to the ceiling.

The outlier test keeps pacing to what it can fix. Groups dropped on every server alike (long
answers overtaken by short ones, a lag limit too tight for the responses) come back no
sooner from a server that holds fewer: narrowing would only cost throughput, so a run with
one server, or with servers of equal speed, is never paced. Shares are over a server's
recent groups (tallies halve past :data:`WINDOW` groups).

So a slow server settles near the most groups it can hold and still deliver them within
``staleness.max_policy_lag`` versions, and a server fast enough for its share never
changes. A server that restarts starts again at the ceiling. Endpoint (external) slots are
not paced: their agents ask for them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

#: A server is narrowed only while more than this share of its recent groups went stale.
MIN_STALE_SHARE = 0.1
#: Groups (stale or trained) a server's tallies cover before they halve.
WINDOW = 64


class Pacer:
    """Per-server caps on the training groups a server may hold at once."""

    def __init__(self, ceiling: int):
        if ceiling < 1:
            raise ValueError(f"a server must be able to hold one group (ceiling {ceiling})")
        self.ceiling = ceiling
        self.caps: dict[str, int] = {}  # server id -> cap; absent: the ceiling
        self.credit: Counter[str] = Counter()  # groups trained since the last change
        # server id -> [stale, trained]: its recent groups dropped for lag and trained
        self.recent: dict[str, list[float]] = {}
        self.counts: Counter[str] = Counter()

    def cap(self, server_id: str) -> int:
        """The training groups ``server_id`` may hold at once."""
        return self.caps.get(server_id, self.ceiling)

    def room(self, server_id: str, holding: int) -> int:
        """How many more training groups ``server_id`` may be dealt while it holds
        ``holding`` (never negative)."""
        return max(0, self.cap(server_id) - holding)

    def stale(self, server_id: str) -> None:
        """A group of ``server_id`` was dropped for lag: one fewer from now, if its share of
        stale groups stands out (see the module docstring)."""
        self._tally(server_id, stale=True)
        cap = self.cap(server_id)
        if cap > 1 and self.outlier(server_id):
            self.caps[server_id] = cap - 1
            self.credit[server_id] = 0
            self.counts["narrowed"] += 1

    def fresh(self, server_id: str) -> None:
        """A group of ``server_id`` was trained: after ``cap`` of them, one more."""
        self._tally(server_id, stale=False)
        cap = self.cap(server_id)
        if cap >= self.ceiling:
            return
        self.credit[server_id] += 1
        if self.credit[server_id] >= cap:
            self.caps[server_id] = cap + 1
            self.credit[server_id] = 0
            self.counts["widened"] += 1

    def outlier(self, server_id: str) -> bool:
        """Whether ``server_id``'s share of stale groups is over :data:`MIN_STALE_SHARE`
        and over twice the other servers' (False while no other server has any)."""
        mine = self.recent.get(server_id, [0.0, 0.0])
        others = [t for s, t in self.recent.items() if s != server_id]
        others_stale = sum(t[0] for t in others)
        others_all = others_stale + sum(t[1] for t in others)
        if others_all == 0 or sum(mine) == 0:
            return False
        share = mine[0] / sum(mine)
        return share > MIN_STALE_SHARE and share > 2 * others_stale / others_all

    def _tally(self, server_id: str, stale: bool) -> None:
        t = self.recent.setdefault(server_id, [0.0, 0.0])
        t[0 if stale else 1] += 1
        if sum(t) > WINDOW:
            t[0], t[1] = t[0] / 2, t[1] / 2

    def state_dict(self) -> dict[str, Any]:
        """Caps, credits and recent tallies per server, and the change counts: a learner
        restart keeps what pacing learned of the servers that outlive it."""
        return {
            "caps": dict(self.caps),
            "credit": dict(self.credit),
            "recent": {s: list(t) for s, t in self.recent.items()},
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.caps = {s: min(int(c), self.ceiling) for s, c in state.get("caps", {}).items()}
        self.credit = Counter({s: int(c) for s, c in state.get("credit", {}).items()})
        self.recent = {s: [float(x) for x in t] for s, t in state.get("recent", {}).items()}
        self.counts = Counter({k: int(v) for k, v in state.get("counts", {}).items()})

    def forget(self, server_id: str) -> None:
        """``server_id`` left or restarted: its next incarnation starts at the ceiling."""
        for table in (self.caps, self.credit, self.recent):
            table.pop(server_id, None)

    def metrics(self) -> dict[str, float]:
        """``pace/narrowed`` and ``pace/widened`` (changes so far), ``pace/cap_min`` (the
        smallest cap now, the ceiling when no server is paced)."""
        return {
            "pace/narrowed": float(self.counts["narrowed"]),
            "pace/widened": float(self.counts["widened"]),
            "pace/cap_min": float(min(self.caps.values(), default=self.ceiling)),
        }
