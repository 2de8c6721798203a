"""The names of the OpenAI endpoint's groups that closed lately (pushed, idle or
abandoned), with why and their rewarded sessions' answers: a request naming one is a final
409 rather than a new group opened under that name (its sessions would start over), and a
reward posted again gets its first answer."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rollout_servers.sessions import Group, RequestError

#: A closed group's name is remembered for this many ``group_idle_s`` ...
CLOSED_IDLE_TIMES = 5
#: ... and at most this many names (the oldest go first).
CLOSED_MAX = 4096


@dataclass
class Closed:
    """What a closed group's name still answers: why and when it closed, and its rewarded
    sessions' rewards with their answers (a re-posted reward gets its answer again)."""

    why: str
    at: float  # time.monotonic() of the close
    rewards: dict[str, tuple[float, dict[str, Any]]]  # session key -> (reward, answer)

    def refusal(self, name: str) -> RequestError:
        """A final 409 for a request naming the group: it would otherwise open a new group
        under the name, and its sessions would start over."""
        return RequestError(
            409,
            f"group {name!r} closed {time.monotonic() - self.at:.0f} s ago ({self.why}) and "
            "takes no more requests: use a new GROUP name for the next episode",
        )


class ClosedNames:
    """Groups closed lately, by name, kept ``keep_s`` and at most ``most`` of them. A
    server's restart forgets them."""

    def __init__(self, keep_s: float, most: int = CLOSED_MAX) -> None:
        self.keep_s, self.most = keep_s, most
        self._by_name: OrderedDict[str, Closed] = OrderedDict()  # in order of closing

    def add(self, group: Group, why: str) -> None:
        rewards = {
            s.key: (s.reward, s.reward_reply)
            for s in group.sessions.values()
            if s.reward is not None and s.reward_reply is not None
        }
        self.add_name(group.name, why, rewards)

    def add_name(
        self, name: str, why: str, rewards: dict[str, tuple[float, dict[str, Any]]] | None = None
    ) -> None:
        """Group ``name`` closed (``rewards``: its members' rewards and replies, by key);
        also a name that never held a slot (abandoned before it had one)."""
        self._by_name[name] = Closed(why, time.monotonic(), rewards or {})
        self._by_name.move_to_end(name)
        while len(self._by_name) > self.most:
            self._by_name.popitem(last=False)

    def get(self, name: str) -> Closed | None:
        """Group ``name``'s close, while it is remembered."""
        now = time.monotonic()
        while self._by_name and now - next(iter(self._by_name.values())).at > self.keep_s:
            self._by_name.popitem(last=False)
        return self._by_name.get(name)
