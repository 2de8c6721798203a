"""The OpenAI endpoint's groups and the external slots they hold.

A group is one slot of the admission budget (an *external slot* the coordinator deals, see
:class:`asyncrl.control.messages.SlotRequest`), so a group that is not alive must never
keep one. Its life:

=============  ==================================================  ======================
state          how it gets there                                   the slot
=============  ==================================================  ======================
opening        the first request of a new ``GROUP`` (its members   asked of the
               arriving at once share one request), held while     coordinator
               no slot is free (:mod:`rollout_servers.slot_wait`)
open           the slot was granted and the request answered       held
pushed         every member posted its reward                      acknowledged: trains
idle-closed    no request or reward for ``group_idle_s``           trains its rewarded
                                                                   members when they form
                                                                   a baseline, else given
                                                                   back
given back     its first request was refused or failed; ``POST     given back at once
               /rl/abandon``; the server stops
=============  ==================================================  ======================

A group closed with fewer rewarded members than a group-relative estimator needs for a
baseline (2 for GRPO/RLOO/Dr. GRPO) is dropped and counted, never trained on raw rewards.
A member refused from its first request may still post its reward: it counts toward the
group's completion and trains nothing, also when that request gave the group back (its
members are kept for a mate's request to open it again, see
:mod:`rollout_servers.member_rewards`). The last closed groups are kept for ``GET
/rl/status`` (:meth:`EndpointGroups.status`). The names of groups that closed pushed,
idle or abandoned are remembered for a while (:mod:`rollout_servers.closed_groups`): a
request naming one is refused rather than opening a new group under that name, and a
re-posted reward gets its first answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from asyncrl.config.policy import GROUP_ESTIMATORS
from asyncrl.rewards import ScoreResult
from rollout_servers.agent import episode_samples, episode_trajectories
from rollout_servers.closed_groups import CLOSED_IDLE_TIMES, ClosedNames
from rollout_servers.groups import filtered_out, shape_overlong, unknown_filter_metric
from rollout_servers.lanes import Lanes
from rollout_servers.member_rewards import RefusedMembers, again, join, reward_closed
from rollout_servers.sessions import Group, RequestError, Session, split_key
from rollout_servers.slot_wait import LEFT, SlotWaiter

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl.config import Config
    from asyncrl.control.messages import Task
    from rollout_servers.protocols import ControlClient, GroupPusher
    from rollout_servers.samples import Sample

log = logging.getLogger(__name__)

#: Closed groups kept for ``GET /rl/status``.
RECENT = 32
#: Open groups named one by one in a refusal (the rest are counted).
NAMED = 5


class EndpointGroups:
    """The open groups of one server's endpoint (see the module docstring).

    ``on_pushed`` (set by the server) counts a pushed group in the server's metrics;
    ``lanes`` are the threads the coordinator client's calls run in.
    """

    def __init__(
        self,
        cfg: Config,
        server_id: str,
        client: ControlClient,
        pusher: GroupPusher,
        metrics: Counter[str],
    ) -> None:
        oe = cfg.rollout.openai_endpoint
        self.cfg, self.server_id, self.client, self.pusher = cfg, server_id, client, pusher
        self.metrics = metrics
        self.size = oe.group_size or cfg.rollout.n
        self.idle_s, self.max_groups = oe.group_idle_s, oe.max_groups
        # Group-relative estimators need two rewards for a baseline: one alone would train
        # on its raw reward as its advantage.
        relative = cfg.algorithm.adv_estimator in GROUP_ESTIMATORS
        self.min_rewarded = 2 if relative and self.size >= 2 else 1
        self.filter_metric = cfg.algorithm.filter_groups.metric
        self.by_name: dict[str, Group] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.closed = ClosedNames(CLOSED_IDLE_TIMES * self.idle_s)
        self.refused = RefusedMembers(CLOSED_IDLE_TIMES * self.idle_s)
        self.on_pushed: Callable[[list[Sample], list[ScoreResult], Task], None] | None = None
        self.lanes = Lanes(scoring_threads=1)
        self._opening: dict[str, asyncio.Future[Group]] = {}
        self.slots = SlotWaiter(
            cfg, client, self.lanes, metrics, lambda: len(self.by_name), self.holders
        )
        self._pushes: set[asyncio.Task] = set()
        # Give-backs (a failure report, a filtered ack) the coordinator never answered:
        # retried by the reaper, since nothing else frees an endpoint slot the server no
        # longer holds (its group closed, no registration names it).
        self._unanswered: list[Callable[[], object]] = []
        self._reaper: asyncio.Task | None = None

    def join_server(
        self, on_pushed: Callable[[list[Sample], list[ScoreResult], Task], None], lanes: Lanes
    ) -> None:
        """Serve inside a rollout server: its pushed groups are counted by ``on_pushed``,
        and the coordinator calls, the slot waiter's too, run in the server's ``lanes``,
        which its stop closes (the ones made for an endpoint on its own are closed now)."""
        self.lanes.close()
        self.on_pushed, self.lanes, self.slots.lanes = on_pushed, lanes, lanes

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_loop())

    def begin_stop(self) -> None:
        """Held requests are refused from now on (the server stops: see :meth:`stop`)."""
        self.slots.stopping = True

    async def stop(self) -> None:
        """Open groups are given back (the coordinator gives their slots up)."""
        self.slots.stopping = True
        if self._reaper is not None:
            self._reaper.cancel()
        open_ids = self.task_ids()
        self.by_name.clear()
        if open_ids:
            await self.lanes.control(self.client.nack, open_ids, "server stopped")

    def task_ids(self) -> list[str]:
        """The external slots this server holds (said at re-registration). Read from the
        client's heartbeat thread while the loop opens and closes groups: ``list()`` copies
        the values at once (a comprehension over the live view can raise "dictionary
        changed size during iteration", which the watch thread takes for the coordinator
        gone; found by reading, not seen)."""
        return [g.task.task_id for g in list(self.by_name.values())]

    # ----------------------------------------------------------------- opening
    async def session(self, key: str, gone: Callable[[], bool] = lambda: False) -> Session:
        """The session of ``key``, opening its group (and taking a slot) when new;
        ``gone`` says the asking client has disconnected (a held request stops)."""
        name, _ = split_key(key, self.size)
        group = self.by_name.get(name)
        while group is None:
            if (closed := self.closed.get(name)) is not None:
                raise closed.refusal(name)
            try:
                opened = await self._open(name, gone)
            except RequestError as e:
                if e.status != LEFT or gone():
                    raise
                continue  # the member that was opening the group left: this one opens it
            # A member that waited on the opening may find the group given back meanwhile
            # (its first request refused): it opens the group again.
            current = self.by_name.get(name)
            group = opened if current is opened else current
        session = join(group, key, self.cfg.data.max_response_length)
        group.last_active = time.monotonic()
        return session

    def touch(self, key: str) -> None:
        """A turn of session ``key`` ended (answered or not): its group is idle from now on.
        The reaper skips groups with a turn running, so a turn longer than ``group_idle_s``
        would otherwise see its group closed right after its answer."""
        group = self.by_name.get(split_key(key, self.size)[0])
        if group is not None:
            group.last_active = time.monotonic()

    async def _open(self, name: str, gone: Callable[[], bool]) -> Group:
        """Take an external slot for group ``name`` (one request even when its members
        arrive at once); refused with 429 (budget, or too many groups) or 503."""
        pending = self._opening.get(name)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Group] = asyncio.get_running_loop().create_future()
        self._opening[name] = future
        try:
            group = self.by_name[name] = Group(name, await self.slots.take(name, gone), self.size)
            # Members refused before it was given back are back: counted dropped at the
            # give-back, they are counted at this group's close instead.
            self.metrics["rollout/openai/sessions_dropped"] -= self.refused.seed(group)
            self.metrics["rollout/openai/groups_opened"] += 1
            future.set_result(group)
            return group
        except BaseException as e:
            # Members waiting on the opening re-raise it; a cancelled opener is one that
            # left, so a member still connected opens the group itself (see session()).
            left = RequestError(LEFT, "the request opening the group was cancelled")
            future.set_exception(left if isinstance(e, asyncio.CancelledError) else e)
            future.exception()  # retrieved
            raise
        finally:
            self._opening.pop(name, None)
            self.slots.abandoned.discard(name)

    def holders(self) -> str:
        """This server's open groups, their idle times, and when the first is given back."""
        if not self.by_name:
            return "No endpoint group is open at this server."
        now = time.monotonic()
        groups = sorted(self.by_name.values(), key=lambda g: g.last_active)
        named = ", ".join(f"{g.name!r} idle {now - g.last_active:.0f} s" for g in groups[:NAMED])
        more = f" and {len(groups) - NAMED} more" if len(groups) > NAMED else ""
        due = max(0.0, self.idle_s - (now - groups[0].last_active))
        return (
            f"Open here: {named}{more}; the idlest is given back in {due:.0f} s "
            f"(rollout.openai_endpoint.group_idle_s={self.idle_s:g}), or at once with "
            "POST /rl/abandon."
        )

    def refused_request(self, key: str) -> None:
        """A request of session ``key`` was refused. Its member is kept, also when the
        refusal came before its session existed (the body's checks run first), so its
        reward counts toward its group's completion; a group the request opened unused
        gives its slot back (:meth:`give_back_if_unused`)."""
        try:
            name, _ = split_key(key, self.size)
        except RequestError:
            return  # no member is named by it
        group, max_len = self.by_name.get(name), self.cfg.data.max_response_length
        if group is not None:
            if key not in group.sessions and len(group.sessions) < group.size:
                join(group, key, max_len)
            self.give_back_if_unused(key)
        elif self.closed.get(name) is None and self.refused.keep(name, key, self.size, max_len):
            # as a given-back group's members are: uncounted when it rejoins (_open)
            self.metrics["rollout/openai/sessions_dropped"] += 1

    def give_back_if_unused(self, key: str) -> None:
        """A group takes its slot for good with its first answered request: when no session
        of ``key``'s group has a turn yet (its first request was refused or failed), the
        slot goes back at once instead of waiting for the idle timeout."""
        try:
            name, _ = split_key(key, self.size)
        except RequestError:
            return  # no group was opened for it
        group = self.by_name.get(name)
        if group is None or any(s.episode.turns or s.busy for s in group.sessions.values()):
            return
        self.metrics["rollout/openai/groups_unused"] += 1
        self.close(group, "given back: its first request was refused or failed")
        self.refused.add(group)  # its members may still post their rewards

    # ----------------------------------------------------------------- rewards
    def reward(self, key: str, value: Callable[[], float]) -> dict[str, Any]:
        """``POST /rl/reward`` of session ``key``; ``value`` reads the request's reward (a
        400 when it is not one). A reward is final: the same one posted again (a client
        that lost the answer) gets the first answer, another is a 409."""
        name, _ = split_key(key, self.size)
        group = self.by_name.get(name) or self.refused.get(name)  # open, or given back
        session = group.sessions.get(key) if group is not None else None
        if group is None or session is None:
            return reward_closed(self.closed, name, key, value, self.metrics)
        if session.busy:  # a turn started after the reward's wait for the last one
            raise RequestError(409, f"session {key!r} is sampling: reward it after", retry=True)
        if session.reward is not None:
            where = f"{group.ended()} of {group.size} in group {name!r} rewarded"
            first, answer = session.reward, session.reward_reply or {}
            return again(key, first, answer, value(), where, self.metrics)
        # A session without a turn (refused from its first request) is rewarded too: it
        # counts toward completion and, trained on nothing, in sessions_dropped at the close.
        session.reward = value()
        if session.drop_unseen():  # the agent ended from what it was shown
            self.metrics["rollout/openai/unseen_dropped"] += 1
        group.last_active = time.monotonic()
        ended = group.ended()
        session.reward_reply = {"session": key, "group": name, "rewarded": ended}
        session.reward_reply |= {"size": group.size, "group_complete": ended >= group.size}
        if ended >= group.size and group is not self.by_name.get(name):  # all refused
            self.refused.forget(name)
            self.closed.add(group, "every member was refused from its first request")
        elif ended >= group.size:
            self.close(group, "every member rewarded")
        return session.reward_reply

    # ----------------------------------------------------------------- closing
    def abandon(self, name: str) -> dict[str, Any]:
        """``POST /rl/abandon``: give group ``name`` up now (nothing of it trains)."""
        group = self.by_name.get(name)
        unused = group is None and self.refused.get(name) is not None  # given back unused
        if group is None and (name in self._opening or unused):  # holds no slot
            if name in self._opening:  # still waiting for its slot
                self.slots.abandoned.add(name)
            # Its later members are refused as a closed group's (their requests opened it
            # again on a slot of its own, and its rewarded members trained).
            self.refused.forget(name)
            self.closed.add_name(name, "abandoned by its agent")
            self.metrics["rollout/openai/groups_abandoned"] += 1
            return {"group": name, "slot": None, "abandoned": True}
        if group is None:
            closed = self.closed.get(name)
            why = f"closed: {closed.why}" if closed is not None else "closed, or never opened"
            raise RequestError(404, f"no open group {name!r} ({why})")
        self.metrics["rollout/openai/groups_abandoned"] += 1
        self.close(group, "abandoned by its agent", train=False)
        return {"group": name, "slot": group.task.task_id, "abandoned": True}

    def close(self, group: Group, why: str, train: bool = True) -> None:
        """Hand the group to the buffer (its rewarded sessions, when ``train`` and they
        form a baseline), or give its slot back."""
        self.by_name.pop(group.name, None)
        if not why.startswith("given back"):  # unused, it may open again (a client's retry)
            self.closed.add(group, why)
        members = group.rewarded() if train else []
        if members and len(members) < self.min_rewarded:
            self.metrics["rollout/openai/groups_too_few_rewarded"] += 1
            # Rewarded with no turn: refused from its first request, or its only turns
            # reached no client and were taken back (Session.drop_unseen).
            bare = group.ended() - len(members)
            also = f" ({bare} more rewarded with no turn to train)" if bare else ""
            log.warning(
                "external group %r closed with %d rewarded session(s) with turns%s: %s needs "
                "%d for a baseline, so it is dropped rather than trained on raw rewards",
                group.name,
                len(members),
                also,
                self.cfg.algorithm.adv_estimator,
                self.min_rewarded,
            )
            why = f"dropped: {len(members)} of {group.size} sessions rewarded with turns{also}"
            members = []
        elif train and not members and not why.startswith("given back"):
            why = f"{why}: no session was rewarded"
        # After the baseline check: a group too few rewarded drops its rewarded ones too.
        self.metrics["rollout/openai/sessions_dropped"] += len(group.sessions) - len(members)
        t = asyncio.create_task(self._push(group, members, why))
        self._pushes.add(t)  # held until done: the loop keeps only weak references
        t.add_done_callback(self._pushes.discard)

    def _record(self, group: Group, outcome: str, why: str, rewarded: int) -> None:
        self.recent.append(
            {
                "group": group.name,
                "slot": group.task.task_id,
                "outcome": outcome,
                "why": why,
                "rewarded": rewarded,
                "closed_at": time.time(),
            }
        )

    async def _push(self, group: Group, members: list[Session], why: str) -> None:
        task = group.task
        if not members:
            self._record(group, "given back", why, 0)
            await self._give_back(functools.partial(self.client.nack, [task.task_id], why))
            return
        episodes = [s.episode for s in members]
        try:
            scores = self._scores(task, members)
            keep = not filtered_out(task, scores, self.filter_metric)  # alike: no signal
            trajectories = (
                episode_trajectories(
                    task, episodes, scores, server_id=self.server_id, created_at=group.created
                )
                if keep
                else None
            )
        except Exception as e:  # a bug, not the agent's: the slot must not stay charged
            log.exception("external group %s: its trajectories were not built", task.task_id)
            await self._not_pushed(group, len(members), f"its trajectories were not built: {e!r}")
            return
        if trajectories is None:
            self._record(group, "filtered", f"{why}: every member scored alike", len(members))
            await self._give_back(functools.partial(self.client.ack, [task.task_id], filtered=True))
            self.metrics["rollout/openai/groups_filtered"] += 1
            return
        try:
            await self.pusher.send_async(trajectories)
        except Exception as e:
            log.warning("external group %s was not pushed: %s", task.task_id, e)
            await self._not_pushed(group, len(members), f"push failed: {e}")
            return
        await self.lanes.control(self.client.ack, [task.task_id])
        self.metrics["rollout/openai/groups_pushed"] += 1
        self._record(group, "pushed", f"{why}: trains in a coming step", len(members))
        if self.on_pushed is not None:
            self.on_pushed(episode_samples(episodes), scores, task)

    def _scores(self, task: Task, members: list[Session]) -> list[ScoreResult]:
        """The members' rewards as scores, shaped by DAPO's overlong penalty as the server's
        own groups are (training groups only)."""
        scores = [ScoreResult(score=float(s.reward or 0.0)) for s in members]
        if not task.validation:
            lengths = [s.episode.budget_len() for s in members]
            limit, overlong = self.cfg.data.max_response_length, self.cfg.reward.overlong_buffer
            scores = shape_overlong(scores, lengths, limit, overlong)
        if (note := unknown_filter_metric(task, scores, self.filter_metric)) is not None:
            self.metrics["rollout/filter_metric_unknown"] += 1  # an agent's reward has no parts
            if self.metrics["rollout/filter_metric_unknown"] == 1:
                log.warning("endpoint groups: %s", note)
        return scores

    async def _not_pushed(self, group: Group, members: int, why: str) -> None:
        """``group`` was not pushed: given back to the coordinator (a failed task, dealt
        again or given up there), so that its slot frees."""
        self._record(group, "given back", why, members)
        await self._give_back(functools.partial(self.client.nack, [group.task.task_id], why))

    async def _give_back(self, report: Callable[[], object]) -> None:
        """Send ``report`` (it answers falsy when the coordinator never answered); kept
        for the reaper to send again until answered."""
        if not await self.lanes.control(report):
            self._unanswered.append(report)

    async def _give_back_again(self) -> None:
        """Send again the give-backs never answered (:meth:`_give_back`)."""
        for report in list(self._unanswered):
            if await self.lanes.control(report):
                self._unanswered.remove(report)
                self.metrics["rollout/openai/give_backs_resent"] += 1

    async def _reap_loop(self) -> None:
        """Consumes nothing; closes groups idle past ``group_idle_s``, gives back the
        slots of slot requests left unanswered (:meth:`SlotWaiter.give_back_unanswered`)
        and sends again the give-backs never answered (:meth:`_give_back_again`).
        Wakes every quarter of ``group_idle_s`` (at most 5 s); ends when :meth:`stop`
        cancels it."""
        every = min(5.0, self.idle_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                await self.slots.give_back_unanswered(older_than_s=every)
                await self._give_back_again()
            except Exception as e:  # a defect: the reaping must go on
                log.warning("giving back unanswered slots failed (%s: %s)", type(e).__name__, e)
            now = time.monotonic()
            for group in list(self.by_name.values()):
                busy = any(s.busy for s in group.sessions.values())
                if not busy and now - group.last_active > self.idle_s:
                    self.metrics["rollout/openai/groups_timed_out"] += 1
                    log.warning(
                        "external group %r idle for %.0f s: closed with %d of %d sessions "
                        "rewarded (rollout.openai_endpoint.group_idle_s)",
                        group.name,
                        now - group.last_active,
                        len(group.rewarded()),
                        group.size,
                    )
                    self.close(group, f"idle for {now - group.last_active:.0f} s")

    # ----------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """``GET /rl/status``: the open groups and their members, the last closed ones."""
        now = time.monotonic()
        return {
            "group_size": self.size,
            "group_idle_s": self.idle_s,
            "max_groups": self.max_groups,
            "open_groups": [
                {
                    "group": g.name,
                    "slot": g.task.task_id,
                    "idle_s": round(now - g.last_active, 1),
                    "given_back_in_s": round(max(0.0, self.idle_s - (now - g.last_active)), 1),
                    "members": [
                        {"session": s.key, "turns": s.episode.turns, "reward": s.reward}
                        for s in g.sessions.values()
                    ],
                }
                for g in self.by_name.values()
            ],
            "recent_groups": list(self.recent),
        }
