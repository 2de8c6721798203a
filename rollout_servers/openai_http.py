"""How the OpenAI endpoint reads a request and writes its answer over HTTP: the JSON body,
the session key, a refusal in the API's error shape (with the retry headers OpenAI clients
obey), the answer to an unserved route, and a finished turn as a stream. The endpoint's
handlers (:mod:`rollout_servers.openai_api`) decide; these only carry.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout_servers.chat_bodies import completion_chunks
from rollout_servers.openai_completions import text_chunks
from rollout_servers.sessions import RequestError

log = logging.getLogger(__name__)

#: Seconds a refused agent is told to wait (429 and 503 are retried by OpenAI clients).
RETRY_AFTER_S = 1
#: Bytes a request body may have.
MAX_BODY = 4 << 20


async def stream_reply(
    request: web.Request,
    reply: dict[str, Any],
    body: dict[str, Any],
    metrics: Counter[str],
    delivered: Callable[[], None] = lambda: None,
) -> web.StreamResponse:
    """``stream=true``: the finished turn as server-sent events, then ``[DONE]``;
    ``delivered`` is called once the whole stream is written (not when the client left
    during it)."""
    options = body.get("stream_options")
    usage = isinstance(options, dict) and bool(options.get("include_usage"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    chunks = text_chunks if reply["object"] == "text_completion" else completion_chunks
    try:
        await response.prepare(request)
        for chunk in chunks(reply, usage):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        delivered()
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
        client_left(metrics)
    return response  # aiohttp ends it, and takes a closed connection in its stride


def client_left(metrics: Counter[str]) -> None:
    """The client left before its reply was written: it gave up waiting (its timeout),
    and its resend gets the same turn (``EndpointTurns.once``). Not the server's failure:
    counted, not a 500 with a traceback."""
    metrics["rollout/openai/client_left"] += 1
    log.info("OpenAI endpoint: a client left before its reply was written")


def failed(metrics: Counter[str], e: Exception) -> web.Response:
    """A request that failed on the server's side (called while handling ``e``, whose
    traceback is logged): a 500 in the API's shape, which clients may resend."""
    log.exception("OpenAI endpoint: a request failed")
    error = RequestError(500, f"{type(e).__name__}: {e}", "server_error", retry=True)
    return refused(metrics, error)


def refused(metrics: Counter[str], e: RequestError) -> web.Response:
    metrics[f"rollout/openai/refused/{e.status}"] += 1
    headers = {"x-should-retry": "true" if e.retry else "false"}
    if e.retry:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return web.json_response(e.body(), status=e.status, headers=headers)


@web.middleware
async def api_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A path or method the endpoint does not serve answers in the API's error shape
    (OpenAI clients read ``error.message``), naming what it does serve."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status not in (404, 405):
            raise
        served = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, " + (
            "POST /rl/reward, POST /rl/abandon, GET /rl/status"
        )
        message = f"{request.method} {request.path} is not served here (served: {served})"
        body = RequestError(e.status, message, "not_found").body()
        return web.json_response(body, status=e.status)


def session_key(request: web.Request, body: dict[str, Any]) -> str:
    """The session key: an ``X-Session-Id`` header, else the body's ``session`` (the
    OpenAI client's ``extra_body``), else the bearer token (its API key). A framework that
    shares one client across episodes names each episode with the first two."""
    named = request.headers.get("X-Session-Id", "").strip() or body.get("session")
    if named:
        return str(named)
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return ""


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; what cannot be read as one is the client's to fix (a
    400, never a 500 that clients would resend unchanged)."""
    try:
        body = await request.json()
    except ValueError as e:  # not JSON, or bytes its charset does not decode
        raise RequestError(400, f"the body is not JSON ({e})") from e
    except LookupError as e:
        raise RequestError(400, f"the body's charset is unknown ({e}): send UTF-8 JSON") from e
    except RecursionError as e:
        raise RequestError(400, "the body is JSON nested too deeply to read") from e
    except web.HTTPRequestEntityTooLarge as e:  # not a 500 that clients would resend
        raise RequestError(413, f"the body is over {MAX_BODY >> 20} MiB ({e.text})") from e
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    return body


def earlier_port(path: Path) -> int:
    """The port an earlier life of this server served at in this launch (its URL file,
    left behind by a kill), or 0 (none, or unreadable)."""
    from urllib.parse import urlsplit

    try:
        return urlsplit(json.loads(path.read_text())["base_url"]).port or 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def write_url(path: Path, server_id: str, url: str) -> None:
    """The served base URL, in the file agents poll for it (written whole, atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"server_id": server_id, "base_url": url}) + "\n")
    tmp.replace(path)  # an agent polling for the file never reads half of it


def advertised_host(bind_host: str, peer_host: str) -> str:
    """The host an agent's URL names for an endpoint bound at ``bind_host``: that address,
    or for a wildcard (``0.0.0.0``, ``::``) this machine's address on the route to
    ``peer_host`` (``endpoints.host``, the learner's machine), which a wildcard URL
    (``http://0.0.0.0:PORT``) does not name. A UDP socket's connect sends nothing."""
    import ipaddress
    import socket

    try:
        wildcard = ipaddress.ip_address(bind_host).is_unspecified
    except ValueError:  # a host name: it names itself
        return bind_host
    if not wildcard:
        return bind_host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((peer_host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
