"""The OpenAI-compatible endpoint of a rollout server (``rollout.openai_endpoint``).

An agent framework that runs outside the run points its OpenAI client at the server
(``base_url = http://HOST:PORT/v1``, API key ``GROUP/MEMBER``: the session key, see
:mod:`rollout_servers.sessions`) and trains by changing nothing else:

``POST /v1/chat/completions``
    One assistant turn of the session, sampled by the server's engine from token ids:
    the server records the sampled tokens, their behaviour logprobs and policy versions.
    A group's first request takes an *external slot* from the coordinator (charged to the
    staleness budget like a dataset task); while the budget is spent the request is held
    (``slot_wait_s``), then refused with a 429 and ``Retry-After``. A group whose first
    request is refused or fails gives its slot back at once.
``POST /v1/completions``
    A raw prompt, no chat template: a new sample of the session
    (:mod:`rollout_servers.openai_completions`).
``POST /rl/reward`` (``{"reward": r}``, same key)
    Ends the session with its reward (finite, within ``reward_range`` when set; final: a
    different second reward or a later chat is a 409, the same reward posted again gets the
    first answer). When ``group_size`` members have one, the group goes
    to the buffer as one group of episodes (each may have several samples), exactly as the
    server's own multi-turn episodes do, and the slot is acknowledged.
``POST /rl/abandon`` (same key, or ``{"group": name}``)
    Gives the group up at once: its slot goes back to the budget, nothing of it trains.
``GET /rl/status``
    The weights version this server samples with, its open groups with their members and
    idle times, and its last closed groups (pushed, or given back and why).
``GET /v1/models``
    The served model.

Sampling follows the run, not the request: training needs the full distribution at
``rollout.temperature`` (the learner recomputes exactly it), so only ``max_tokens`` and
``stop`` (applied after sampling: :mod:`rollout_servers.stops`) are taken from a request,
and what would constrain sampling (a forced ``tool_choice``, a JSON
``response_format``) is refused. A resent request gets the turn it asked for once
(:meth:`~rollout_servers.endpoint_turns.EndpointTurns.once`). ``stream=true`` gets the
finished turn as chunks. This module serves the routes; a turn is sampled and recorded by
:mod:`rollout_servers.endpoint_turns`, and a group's slot, held only while the group is
alive, follows the lifecycle of :mod:`rollout_servers.endpoint_groups`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rollout_servers.endpoint_groups import EndpointGroups
from rollout_servers.endpoint_turns import EndpointTurns
from rollout_servers.openai_completions import raw_max_tokens, raw_prompt
from rollout_servers.openai_http import (
    MAX_BODY,
    advertised_host,
    api_errors,
    client_left,
    earlier_port,
    failed,
    read_json,
    refused,
    session_key,
    stream_reply,
    write_url,
)
from rollout_servers.request_fields import (
    asked_tokens,
    chat_messages,
    reward_of,
    stop_strings,
    wants_logprobs,
)
from rollout_servers.sessions import RequestError, check_conversation

if TYPE_CHECKING:
    from asyncrl.config import Config
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.protocols import ControlClient, GenerationEngine, GroupPusher, Tokenizer

log = logging.getLogger(__name__)
STOP_S = 2.0  # how long requests in flight may finish once the endpoint stops


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
    ) -> None:
        oe = cfg.rollout.openai_endpoint
        self.cfg, self.server_id, self.tok = cfg, server_id, tok
        self.reward_range = oe.reward_range
        self.model = cfg.model.path
        self.created = int(time.time())  # the model card's ``created``
        self.metrics: Counter[str] = Counter()
        self.groups = EndpointGroups(cfg, server_id, client, pusher, self.metrics)
        self.turns = EndpointTurns(
            cfg, engine, tok, sampling, self.metrics, on_end=self.groups.touch
        )
        self.url = ""
        self._runner: web.AppRunner | None = None

    # ----------------------------------------------------------------- serving
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[api_errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/rl/reward", self._reward)
        app.router.add_post("/rl/abandon", self._abandon)
        app.router.add_get("/rl/status", self._status)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._models)
        return app

    async def start(self) -> str:
        """Listen on ``rollout.openai_endpoint.host``/``port``; returns the base URL (also
        written to ``<run dir>/openai_endpoints/<server id>.json``)."""
        oe = self.cfg.rollout.openai_endpoint
        # At stop, requests still in flight get STOP_S, then are cancelled (and given as
        # long again to end): the server's leave comes after, and aiohttp's default 60 s
        # outlasted the launcher's wait (the server was killed at the run's end, unleft).
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=STOP_S)
        await self._runner.setup()
        # port 0: a restarted server serves where its earlier life did, so an agent's URL
        # (and its client's retries) reach it again; a free port when that one is taken.
        earlier = 0 if oe.port else earlier_port(self._url_file())
        try:
            await web.TCPSite(self._runner, oe.host, oe.port or earlier).start()
        except OSError as e:
            if not earlier:
                raise RuntimeError(
                    f"the OpenAI endpoint cannot listen on {oe.host}:{oe.port} ({e}); set "
                    "rollout.openai_endpoint.port=0 to take a free port"
                ) from e
            await web.TCPSite(self._runner, oe.host, 0).start()
            log.warning(
                "%s: port %d, where it served before its restart, is taken (%s): serving at "
                "a new port; agents must read %s again",
                self.server_id,
                earlier,
                e,
                self._url_file(),
            )
        port = self._runner.addresses[0][1]
        host = advertised_host(oe.host, self.cfg.endpoints.host)
        self.url = f"http://{host}:{port}/v1"
        write_url(self._url_file(), self.server_id, self.url)
        self.groups.start()
        log.info("%s serves the OpenAI API at %s", self.server_id, self.url)
        return self.url

    def _url_file(self) -> Path:
        from asyncrl.config import run_dir

        return Path(run_dir(self.cfg)) / "openai_endpoints" / f"{self.server_id}.json"

    async def stop(self) -> None:
        """Stop serving (the URL file goes: agents waiting for one wait for the next
        server's); open groups are given back (the coordinator gives them up)."""
        self.groups.begin_stop()  # held requests answer now, not after their wait
        if self._runner is not None:
            await self._runner.cleanup()
            self._url_file().unlink(missing_ok=True)
        await self.groups.stop()
        self.turns.close()

    def task_ids(self) -> list[str]:
        """The external slots this server holds (said at re-registration)."""
        return self.groups.task_ids()

    # ----------------------------------------------------------------- handlers
    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "asyncrl"}
        if "model" in request.match_info:  # GET /v1/models/{model}
            if request.match_info["model"] != self.model:
                name = request.match_info["model"]
                error = RequestError(
                    404, f"model {name!r} is not served here (served: {self.model!r})", "not_found"
                )
                return web.json_response(error.body(), status=404)
            return web.json_response(card)
        return web.json_response({"object": "list", "data": [card]})

    async def _status(self, request: web.Request) -> web.Response:
        head = {"server_id": self.server_id, "policy_version": self.turns.engine.version}
        counts = {
            k.removeprefix("rollout/openai/"): v
            for k, v in sorted(self.metrics.items())
            if k.startswith("rollout/openai/")
        }
        return web.json_response(head | self.groups.status() | {"counts": counts})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, raw=False)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` (see :mod:`rollout_servers.openai_completions`)."""
        return await self._serve(request, raw=True)

    async def _serve(self, request: web.Request, raw: bool) -> web.StreamResponse:
        """One request of a session: its turn (chat) or its new sample (``raw``)."""
        self.metrics["rollout/openai/requests"] += 1
        # First, from the headers: a body that cannot be read still names its member, which
        # its refusal keeps (the member's reward then counts toward its group).
        key = session_key(request, {})
        try:
            body = await read_json(request)
            key = session_key(request, body)  # the body's ``session`` comes before the key
            if body.get("n") is not None and (body["n"] != 1 or isinstance(body["n"], bool)):
                raise RequestError(400, "n must be 1: open one session per sample")
            if raw:  # a text prompt is tokenized in its turn, off the loop
                inputs: Any = raw_prompt(body, self.tok)
                body, make = raw_max_tokens(body), self.turns.raw
            else:
                inputs, make = chat_messages(body), self.turns.chat
                check_conversation(inputs, body.get("tools"))
                wants_logprobs(body)
            # Every check of the body before a slot is taken: a malformed request waiting
            # for a full budget was answered 429 (retry) instead of its 400.
            asked_tokens(body)
            stop_strings(body)
            session = await self.groups.session(key, lambda: _left(request))
            if session.reward is not None:
                raise RequestError(
                    409,
                    f"session {session.key!r} ended with its reward ({session.reward:g}): "
                    "start the next episode with another GROUP/MEMBER key",
                )
            turn = functools.partial(make, session, inputs, body)
            try:
                reply = await self.turns.once(session, body, turn, _resent(request))
            finally:
                self.groups.touch(key)  # idle from the turn's end, not from its request
            if _left(request):  # aiohttp drops the reply quietly: the turn stays unseen
                client_left(self.metrics)
                return web.json_response(reply)
            seen = functools.partial(self.turns.seen, session)
            if body.get("stream"):  # seen once written whole: a client may leave during it
                return await stream_reply(request, reply, body, self.metrics, seen)
            seen()
            return web.json_response(reply)
        except RequestError as e:
            self.groups.refused_request(key)
            return refused(self.metrics, e)
        except Exception as e:  # the engine failed: say so in the API's shape, serve on
            self.groups.give_back_if_unused(key)
            return failed(self.metrics, e)

    async def _reward(self, request: web.Request) -> web.Response:
        """``POST /rl/reward`` (:meth:`~rollout_servers.endpoint_groups.EndpointGroups.reward`)."""
        try:
            body = await read_json(request)
            key = session_key(request, body)
            # An agent that gave up on a turn may post its reward while the turn still
            # samples: the reward waits for it (an unseen turn is then taken back).
            await self.turns.settled(key)
            reply = self.groups.reward(key, lambda: reward_of(body, self.reward_range))
            return web.json_response(reply)
        except RequestError as e:
            return refused(self.metrics, e)
        except Exception as e:
            return failed(self.metrics, e)

    async def _abandon(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request) if request.can_read_body else {}
            name = body.get("group")
            if not isinstance(name, str) or not name:
                key = session_key(request, body)
                if not key:
                    raise RequestError(
                        400, 'name the group: {"group": NAME}, or a GROUP/MEMBER API key'
                    )
                name = key.rpartition("/")[0] or key
            return web.json_response(self.groups.abandon(name))
        except RequestError as e:
            return refused(self.metrics, e)
        except Exception as e:
            return failed(self.metrics, e)


def _left(request: web.Request) -> bool:
    """The client of ``request`` has disconnected."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _resent(request: web.Request) -> bool:
    """``request`` is a client's retry of one it sent before (openai-python marks it)."""
    return request.headers.get("x-stainless-retry-count", "0").strip() not in ("", "0")
