"""The OpenAI-compatible endpoint of a rollout server (``rollout.openai_endpoint``).

An agent framework that runs outside the run points its OpenAI client at the server
(``base_url = http://HOST:PORT/v1``, API key ``GROUP/MEMBER``: the session key, see
:mod:`rollout_servers.sessions`) and trains by changing nothing else:

``POST /v1/chat/completions``
    One assistant turn of the session, sampled by the server's engine from token ids:
    the server records the sampled tokens, their behaviour logprobs and policy versions.
    A group's first request takes an *external slot* from the coordinator (charged to the
    staleness budget like a dataset task); when the budget is exhausted the answer is 429
    with ``Retry-After`` (OpenAI clients retry it by themselves). A group whose first
    request is refused or fails gives its slot back at once.
``POST /rl/reward`` (``{"reward": r}``, same key)
    Ends the session with its reward (finite, within ``reward_range`` when set; final: a
    second reward or a later chat is a 409). When ``group_size`` members have one, the group goes
    to the buffer as one group of episodes (each may have several samples), exactly as the
    server's own multi-turn episodes do, and the slot is acknowledged.
``GET /v1/models``
    The served model.

Sampling follows the run, not the request: training needs the full distribution at
``rollout.temperature`` (the learner recomputes exactly it), so only ``max_tokens`` is taken
from a request. Groups idle past ``session_timeout_s`` are closed by :meth:`_reap_loop`:
their rewarded sessions train, the others are dropped and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncrl.rewards import ScoreResult
from rollout_servers.agent import Episode, episode_samples, episode_trajectories, turn_params
from rollout_servers.lanes import Lanes
from rollout_servers.sessions import (
    Group,
    RequestError,
    Session,
    asked_tokens,
    assistant_reply,
    completion_body,
    max_tokens_of,
    prepare,
    reward_of,
    split_key,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl.config import Config
    from asyncrl.control.messages import Task
    from rollout_servers.engine import Sample
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.protocols import ControlClient, GenerationEngine, GroupPusher, Tokenizer

log = logging.getLogger(__name__)

#: Seconds a refused agent is told to wait (429 and 503 are retried by OpenAI clients).
RETRY_AFTER_S = 1


class OpenAIEndpoint:
    """Serves one rollout server's engine to outside agents (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        server_id: str,
        engine: GenerationEngine,
        tok: Tokenizer,
        client: ControlClient,
        pusher: GroupPusher,
        sampling: SamplingSettings,
        on_pushed: Callable[[list[Sample], list[ScoreResult], Task], None] | None = None,
    ) -> None:
        oe = cfg.rollout.openai_endpoint
        self.cfg, self.server_id = cfg, server_id
        self.engine, self.tok, self.client, self.pusher = engine, tok, client, pusher
        self.sampling, self.on_pushed = sampling, on_pushed
        self.group_size = oe.group_size or cfg.rollout.n
        self.timeout_s, self.max_groups = oe.session_timeout_s, oe.max_groups
        self.reward_range = oe.reward_range
        # Group-relative estimators need two rewards for a baseline: one alone would train
        # on its raw reward as its advantage.
        relative = cfg.algorithm.adv_estimator in ("grpo", "rloo", "dr_grpo")
        self.min_rewarded = 2 if relative and self.group_size >= 2 else 1
        self.max_prompt_len = cfg.data.max_prompt_length
        self.max_response_len = cfg.data.max_response_length
        self.model = cfg.model.path
        self.groups: dict[str, Group] = {}
        self._opening: dict[str, asyncio.Future[Group]] = {}
        self.metrics: Counter[str] = Counter()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task | None = None
        self._pushes: set[asyncio.Task] = set()
        # Threads for the coordinator client's calls (the server gives its own).
        self.lanes = Lanes(scoring_threads=1)

    # ----------------------------------------------------------------- serving
    def app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/rl/reward", self._reward)
        app.router.add_get("/v1/models", self._models)
        return app

    async def start(self) -> str:
        """Listen on ``rollout.openai_endpoint.host``/``port``; returns the base URL (also
        written to ``<run dir>/openai_endpoints/<server id>.json``)."""
        oe = self.cfg.rollout.openai_endpoint
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, oe.host, oe.port)
        try:
            await site.start()
        except OSError as e:
            raise RuntimeError(
                f"the OpenAI endpoint cannot listen on {oe.host}:{oe.port} ({e}); set "
                "rollout.openai_endpoint.port=0 to take a free port"
            ) from e
        port = self._runner.addresses[0][1]
        self.url = f"http://{oe.host}:{port}/v1"
        self._write_url()
        self._reaper = asyncio.create_task(self._reap_loop())
        log.info("%s serves the OpenAI API at %s", self.server_id, self.url)
        return self.url

    def _write_url(self) -> None:
        from asyncrl.config import run_dir

        folder = Path(run_dir(self.cfg)) / "openai_endpoints"
        folder.mkdir(parents=True, exist_ok=True)
        doc = {"server_id": self.server_id, "base_url": self.url}
        (folder / f"{self.server_id}.json").write_text(json.dumps(doc) + "\n")

    async def stop(self) -> None:
        """Stop serving; open groups are reported failed (the coordinator gives them up)."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        open_ids = [g.task.task_id for g in self.groups.values()]
        self.groups.clear()
        if open_ids:
            await self.lanes.control(self.client.nack, open_ids, "server stopped")

    def task_ids(self) -> list[str]:
        """The external slots this server holds (said at re-registration)."""
        return [g.task.task_id for g in self.groups.values()]

    # ----------------------------------------------------------------- handlers
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _chat(self, request: web.Request) -> web.Response:
        self.metrics["rollout/openai/requests"] += 1
        key = ""
        try:
            body = await _json(request)
            if body.get("stream"):
                raise RequestError(400, "stream=true is not supported: ask without streaming")
            if (body.get("n") or 1) != 1:
                raise RequestError(400, "n must be 1: open one session per sample")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError(400, "messages must be a non-empty list")
            key = _key(request, body)
            session = await self._session(key)
            if session.reward is not None:
                raise RequestError(
                    409,
                    f"session {session.key!r} ended with its reward ({session.reward:g}): "
                    "start the next episode with another GROUP/MEMBER key",
                )
            if session.busy:
                raise RequestError(409, "a completion of this session is running already")
            session.busy = True
            try:
                return web.json_response(await self._turn(session, messages, body))
            finally:
                session.busy = False
        except RequestError as e:
            self._give_back_if_unused(key)
            return self._refused(e)
        except Exception as e:  # the engine failed: say so in the API's shape, serve on
            log.exception("OpenAI endpoint: a completion failed")
            self._give_back_if_unused(key)
            return self._refused(RequestError(500, f"{type(e).__name__}: {e}", "server_error"))

    def _give_back_if_unused(self, key: str) -> None:
        """A group takes its slot for good with its first answered request: when no session
        of ``key``'s group has a turn yet (its first request was refused or failed), the
        slot goes back at once instead of waiting for the idle timeout."""
        try:
            name, _ = split_key(key, self.group_size)
        except RequestError:
            return  # no group was opened for it
        group = self.groups.get(name)
        if group is None or any(s.episode.turns or s.busy for s in group.sessions.values()):
            return
        self.metrics["rollout/openai/groups_unused"] += 1
        self._close(group)  # nothing rewarded: the slot is given back

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            key = _key(request, body)
            group_name, _ = split_key(key, self.group_size)
            group = self.groups.get(group_name)
            session = group.sessions.get(key) if group is not None else None
            if group is None or session is None:
                raise RequestError(404, f"no open session {key!r} (closed, or never started)")
            if not session.episode.turns:
                raise RequestError(400, f"session {key!r} has no completion to reward")
            if session.busy:
                raise RequestError(409, f"session {key!r} is sampling: reward it after")
            if session.reward is not None:
                raise RequestError(
                    409,
                    f"session {key!r} has its reward already ({session.reward:g}; "
                    f"{len(group.rewarded())} of {group.size} in group {group.name!r} "
                    "rewarded): a reward is final",
                )
            session.reward = reward_of(body, self.reward_range)
            group.last_active = time.monotonic()
            rewarded = len(group.rewarded())
            if rewarded >= group.size:
                self._close(group)
            reply = {"session": key, "group": group.name, "rewarded": rewarded}
            done = {"size": group.size, "group_complete": rewarded >= group.size}
            return web.json_response(reply | done)
        except RequestError as e:
            return self._refused(e)

    def _refused(self, e: RequestError) -> web.Response:
        self.metrics[f"rollout/openai/refused/{e.status}"] += 1
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
        return web.json_response(e.body(), status=e.status, headers=headers)

    # ----------------------------------------------------------------- sessions
    async def _session(self, key: str) -> Session:
        """The session of ``key``, opening its group (and taking a slot) when new."""
        name, _ = split_key(key, self.group_size)
        group = self.groups.get(name)
        while group is None:
            opened = await self._open(name)
            # A member that waited on the opening may find the group given back meanwhile
            # (its first request refused): it opens the group again.
            current = self.groups.get(name)
            group = opened if current is opened else current
        session = group.sessions.get(key)
        if session is None:
            if len(group.sessions) >= group.size:
                raise RequestError(
                    409,
                    f"group {name!r} has its {group.size} members already: use another GROUP",
                )
            episode = Episode(pieces=[], messages=[])
            session = Session(key, len(group.sessions), group.task, episode)
            group.sessions[key] = session
        group.last_active = time.monotonic()
        return session

    async def _open(self, name: str) -> Group:
        """Take an external slot for group ``name`` (one request even when its members
        arrive at once); refused with 429 (budget) or 503 (anything else)."""
        pending = self._opening.get(name)
        if pending is not None:
            return await asyncio.shield(pending)
        if len(self.groups) >= self.max_groups:
            raise RequestError(
                429,
                f"{self.max_groups} groups are open on this server: finish some, or raise "
                "rollout.openai_endpoint.max_groups",
                "rate_limit",
            )
        future: asyncio.Future[Group] = asyncio.get_running_loop().create_future()
        self._opening[name] = future
        try:
            grant = await self.lanes.control(self.client.request_slot)
            if not grant.tasks:
                self.metrics[f"rollout/openai/slots_refused/{grant.reason}"] += 1
                if grant.reason == "budget":
                    raise RequestError(
                        429,
                        "no training slot now: the staleness budget "
                        "(staleness.max_policy_lag) waits for the learner; retry shortly",
                        "rate_limit",
                    )
                raise RequestError(
                    503, f"no training slot now ({grant.reason}); retry shortly", "unavailable"
                )
            group = self.groups[name] = Group(name, grant.tasks[0], self.group_size)
            self.metrics["rollout/openai/groups_opened"] += 1
            future.set_result(group)
            return group
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: members waiting on it re-raise it themselves
            raise
        finally:
            self._opening.pop(name, None)

    async def _turn(
        self, session: Session, messages: list[Any], body: dict[str, Any]
    ) -> dict[str, Any]:
        """Sample one assistant turn and record it. The turn is prepared on a draft and
        committed only once the engine answered (see
        :class:`~rollout_servers.sessions.Draft`)."""
        asked_tokens(body)  # a bad request is refused before any work
        draft = prepare(
            session,
            messages,
            body.get("tools"),
            self.tok,
            max_prompt_len=self.max_prompt_len,
            max_response_len=self.max_response_len,
            version=self.engine.version,
        )
        ep, task = draft.episode, session.task
        piece = ep.pieces[-1]
        budget = max_tokens_of(body, self.max_response_len - len(piece.token_ids))
        params = turn_params(self.sampling, task, session.index, ep.turns, budget)
        rid = f"{task.task_id}/{session.index}/t{ep.turns}"
        sample = await self.engine.generate(piece.prompt_ids + piece.token_ids, params, rid)
        piece.add_sampled(sample)
        ep.turns += 1
        ids = sample.token_ids
        eos = getattr(self.tok, "eos_token_id", None)
        raw = self.tok.decode(ids[:-1] if ids and ids[-1] == eos else ids)
        ep.messages.append({"role": "assistant", "content": raw})
        reply, finish = assistant_reply(raw)
        draft.shown.append(reply)
        draft.commit(session)
        if draft.counted:
            self.metrics[f"rollout/openai/{draft.counted}"] += 1
        if sample.finish_reason == "length":
            finish = "length"
        self.metrics["rollout/openai/completions"] += 1
        self.metrics["rollout/openai/tokens"] += len(ids)
        prompt_len = len(piece.prompt_ids) + len(piece.token_ids) - len(ids)
        return completion_body(reply, finish, self.model, prompt_len, len(ids))

    # ----------------------------------------------------------------- groups
    def _close(self, group: Group) -> None:
        """Hand the group to the buffer (its rewarded sessions), or give its slot back."""
        self.groups.pop(group.name, None)
        members = group.rewarded()
        self.metrics["rollout/openai/sessions_dropped"] += len(group.sessions) - len(members)
        t = asyncio.create_task(self._push(group, members))
        self._pushes.add(t)  # held until done: the loop keeps only weak references
        t.add_done_callback(self._pushes.discard)

    async def _push(self, group: Group, members: list[Session]) -> None:
        task = group.task
        if not members:
            await self.lanes.control(self.client.nack, [task.task_id], "no session was rewarded")
            return
        if len(members) < self.min_rewarded:
            self.metrics["rollout/openai/groups_too_few_rewarded"] += 1
            log.warning(
                "external group %r closed with %d rewarded session(s): %s needs %d for a "
                "baseline, so it is dropped rather than trained on raw rewards",
                group.name,
                len(members),
                self.cfg.algorithm.adv_estimator,
                self.min_rewarded,
            )
            why = f"{len(members)} of {group.size} sessions rewarded"
            await self.lanes.control(self.client.nack, [task.task_id], why)
            return
        scores = [ScoreResult(score=float(s.reward or 0.0)) for s in members]
        episodes = [s.episode for s in members]
        trajectories = episode_trajectories(
            task, episodes, scores, server_id=self.server_id, created_at=group.created
        )
        try:
            await self.pusher.send_async(trajectories)
        except Exception as e:
            log.warning("external group %s was not pushed: %s", task.task_id, e)
            await self.lanes.control(self.client.nack, [task.task_id], f"push failed: {e}")
            return
        await self.lanes.control(self.client.ack, [task.task_id])
        self.metrics["rollout/openai/groups_pushed"] += 1
        if self.on_pushed is not None:
            self.on_pushed(episode_samples(episodes), scores, task)

    async def _reap_loop(self) -> None:
        """Consumes nothing; closes groups idle past ``session_timeout_s``. Wakes every
        quarter of the timeout (at most 5 s); ends when :meth:`stop` cancels it."""
        every = min(5.0, self.timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for group in list(self.groups.values()):
                busy = any(s.busy for s in group.sessions.values())
                if not busy and now - group.last_active > self.timeout_s:
                    self.metrics["rollout/openai/groups_timed_out"] += 1
                    log.warning(
                        "external group %r idle for %.0f s: closed with %d of %d sessions "
                        "rewarded (rollout.openai_endpoint.session_timeout_s)",
                        group.name,
                        now - group.last_active,
                        len(group.rewarded()),
                        group.size,
                    )
                    self._close(group)


def _key(request: web.Request, body: dict[str, Any]) -> str:
    """The session key: the bearer token (the OpenAI client's API key), or ``session``."""
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return str(body.get("session") or "")


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not JSON ({e})") from e
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    return body
