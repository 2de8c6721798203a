"""Rewards of the OpenAI endpoint's members that no open group has: members of a group
given back unused, and members of a group closed lately posting their reward again.

A group whose first request was refused or failed gives its slot back at once
(:meth:`~rollout_servers.endpoint_groups.EndpointGroups.give_back_if_unused`). That must not
cost such a member what the endpoint promises it: it may still post its reward, and it
counts toward its group's completion. So the given-back group is remembered with its
members (no turns, a reward or none yet) by :class:`RefusedMembers`: a reward posted
meanwhile is kept there, and when a mate's request opens the group again the new group
starts with these members in it, already ended where they posted a reward. They are kept
``keep_s`` and at most ``most`` groups (the oldest go first): a member whose group nobody
opens again within that gets the 404 of a session no group has. A server's restart
forgets them.

A member refused before its session existed (its body's checks, a slot it did not get) is
kept the same way (:meth:`RefusedMembers.keep`): in a group that no request opened, which a
mate's request opens later.

A reward is final: the same one posted again (a client that lost the answer) gets the
first answer (:func:`again`), also once its group closed (:func:`reward_closed`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from asyncrl.control.task_states import external_task
from rollout_servers.closed_groups import CLOSED_MAX
from rollout_servers.episodes import Episode
from rollout_servers.sessions import Group, RequestError, Session

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Callable

    from rollout_servers.closed_groups import ClosedNames


class RefusedMembers:
    """Groups given back unused, by name, with their members (see the module docstring)."""

    def __init__(self, keep_s: float, most: int = CLOSED_MAX) -> None:
        self.keep_s, self.most = keep_s, most
        # name -> (time.monotonic() of the give-back, the group), in order of giving back
        self._by_name: OrderedDict[str, tuple[float, Group]] = OrderedDict()

    def add(self, group: Group) -> None:
        """``group`` was given back unused: its members are kept for their rewards."""
        self._by_name[group.name] = (time.monotonic(), group)
        self._by_name.move_to_end(group.name)
        while len(self._by_name) > self.most:
            self._by_name.popitem(last=False)

    def get(self, name: str) -> Group | None:
        """The given-back group ``name`` with its members, while it is remembered."""
        now = time.monotonic()
        while self._by_name and now - next(iter(self._by_name.values()))[0] > self.keep_s:
            self._by_name.popitem(last=False)
        kept = self._by_name.get(name)
        return kept[1] if kept is not None else None

    def keep(self, name: str, key: str, size: int, max_response_len: int) -> bool:
        """Member ``key`` of group ``name``, which no open group holds, was refused: kept as
        a given-back group's members are. False when it was kept already, or its group
        (``size`` members) has its members."""
        group = self.get(name)
        if group is None:  # no slot was taken: the group that opens later lends it its own
            group = Group(name, external_task(f"{name}/refused", 0), size)
        if key in group.sessions or len(group.sessions) >= size:
            return False
        join(group, key, max_response_len)
        self.add(group)
        return True

    def forget(self, name: str) -> None:
        self._by_name.pop(name, None)

    def seed(self, group: Group) -> int:
        """``group`` opens again under a remembered name: it starts with the members the
        given-back one had (in their order, rewards kept), now in its slot. Returns how
        many it took."""
        kept = self.get(group.name)
        self.forget(group.name)
        if kept is None:
            return 0
        for key, session in kept.sessions.items():
            session.task = group.task  # a later turn of a member not rewarded samples here
            group.sessions[key] = session
        return len(kept.sessions)


def join(group: Group, key: str, max_response_len: int) -> Session:
    """Session ``key`` of ``group``, added as its next member when new; a 409 when the group
    has its members already."""
    session = group.sessions.get(key)
    if session is None:
        if len(group.sessions) >= group.size:
            raise RequestError(
                409,
                f"group {group.name!r} has its {group.size} members already: use another GROUP",
            )
        episode = Episode([], [], max_response_len=max_response_len)
        session = group.sessions[key] = Session(key, len(group.sessions), group.task, episode)
    return session


def reward_closed(
    closed: ClosedNames, name: str, key: str, value: Callable[[], float], metrics: Counter[str]
) -> dict[str, Any]:
    """The reward of a session no open or given-back group has: its first answer again
    when its group closed lately with the same reward, else a 409 (closed) or a 404."""
    was = closed.get(name)
    if was is None:
        raise RequestError(404, f"no open session {key!r} (closed, or never started)")
    first = was.rewards.get(key)
    if first is None:
        raise was.refusal(name)
    return again(key, *first, value(), f"group {name!r} closed ({was.why})", metrics)


def again(
    key: str, first: float, answer: dict[str, Any], value: float, where: str, metrics: Counter
) -> dict[str, Any]:
    """A reward posted again: the first ``answer`` when it is the ``first`` reward, else a
    409 (a reward is final)."""
    if value != first:
        raise RequestError(
            409, f"session {key!r} has its reward already ({first:g}; {where}): a reward is final"
        )
    metrics["rollout/openai/retries_replayed"] += 1  # a client's retry answered again
    return answer
