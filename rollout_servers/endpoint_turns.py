"""The OpenAI endpoint's turns: one request of a session sampled on the engine, recorded,
and answered in the API's shape.

A chat request becomes one assistant turn (:meth:`EndpointTurns.chat`), a raw
``/v1/completions`` prompt a new sample of the session
(:meth:`EndpointTurns.raw`, see :mod:`rollout_servers.openai_completions`). Either is
prepared on a :class:`~rollout_servers.sessions.Draft` and committed only once the engine
answered, and sampled once however often the client sends it (:meth:`EndpointTurns.once`).
A prompt is rendered and tokenized in a thread of the turns' own (:data:`TOKEN_THREADS`): a
body of a few MB takes seconds, which the server's loop (its syncs, its other sessions) must
not wait. It happens within the turn, so a session's turns keep their order.
Which request is served, and how it travels, is :mod:`rollout_servers.openai_api`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rollout_servers.agent import turn_params
from rollout_servers.chat_bodies import assistant_reply, completion_body, token_logprobs
from rollout_servers.deadlines import REACH_S
from rollout_servers.openai_completions import (
    prompt_ids,
    raw_draft,
    text_completion_body,
    text_logprobs,
)
from rollout_servers.request_fields import (
    asked_tokens,
    fingerprint,
    max_tokens_of,
    stop_strings,
    wants_logprobs,
)
from rollout_servers.sessions import Draft, RequestError, Session, prepare
from rollout_servers.stops import before_stop, cut, first_stop

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Awaitable, Callable, Iterator

    from asyncrl.config import Config
    from asyncrl.control.messages import Task
    from rollout_servers.groups import SamplingSettings
    from rollout_servers.protocols import GenerationEngine, Tokenizer
    from rollout_servers.samples import Sample

#: Threads that render and tokenize prompts. Not asyncio's default executor, which the
#: server's pushes wait in (:mod:`rollout_servers.lanes`): a burst of large bodies queues
#: here, behind each other, not ahead of a push.
TOKEN_THREADS = 2
#: What the session was before a request took back its unseen turn: episode, shown, tools,
#: before and last (restored when that request is refused or fails).
Held = tuple[Any, Any, Any, Any, Any]


class EndpointTurns:
    """Samples and records the turns of the endpoint's sessions (see the module docstring);
    counts into the endpoint's ``metrics``."""

    def __init__(
        self,
        cfg: Config,
        engine: GenerationEngine,
        tok: Tokenizer,
        sampling: SamplingSettings,
        metrics: Counter[str],
        on_end: Callable[[str], None] = lambda key: None,
    ) -> None:
        """``on_end(session key)``: called as each turn ends, in the same callback that
        clears the session's ``busy`` (the groups' idle clock starts there: a reaper that
        ran between the two would see a turn longer than ``group_idle_s`` as idle)."""
        self.engine, self.tok, self.sampling = engine, tok, sampling
        self.on_end = on_end
        self.max_prompt_len = cfg.data.max_prompt_length
        self.max_response_len = cfg.data.max_response_length
        self.model = cfg.model.path
        self.metrics = metrics
        # session key -> (request fingerprint, its running turn): a resent request joins it
        self._running: dict[str, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._tokens = ThreadPoolExecutor(TOKEN_THREADS, thread_name_prefix="endpoint-tokens")

    def close(self) -> None:
        """Take no more prompts to tokenize (the endpoint stops)."""
        self._tokens.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a tokenizing thread (see the module docstring)."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokens, call)

    async def once(
        self,
        session: Session,
        body: dict[str, Any],
        turn: Callable[[], Awaitable[dict[str, Any]]],
        resent: bool,
    ) -> dict[str, Any]:
        """The reply to one chat request, sampled once however often the client sends it.

        OpenAI clients resend a request whose reply did not come in time (openai-python:
        twice, by default). Sampled again, the retry would add a turn the agent never saw
        to the episode, trained with its reward. So the same request (same messages, tools
        and limits) sent while its turn runs waits for that turn, and one sent again after
        it, marked as a retry (``resent``: ``x-stainless-retry-count``), gets the same
        reply. A new request to a busy session is a 409 the client retries.

        A turn whose reply reached no client (each request for it left first) is the agent's
        only once a reply is handed out (:meth:`seen`): the same request then replays it,
        marked or not, and another request takes it back first, for good once it is answered:
        refused or failed, it leaves the session as it was, the unseen turn kept."""
        fp = fingerprint(body)
        running = self._running.get(session.key)
        if session.busy:
            if running is None or running[0] != fp:
                raise RequestError(
                    409, "a completion of this session is running already", retry=True
                )
            self.metrics["rollout/openai/retries_joined"] += 1
            return await asyncio.shield(running[1])
        # Replayed: a marked resend of the last request, or the same request again while
        # no client has its reply (an agent cannot re-ask about a reply it never read).
        if (resent or session.unseen) and session.last is not None and session.last[0] == fp:
            self.metrics["rollout/openai/retries_replayed"] += 1
            return session.last[1]
        held: Held | None = None
        if session.unseen:  # the agent moved on from what it was shown
            held = (session.episode, session.shown, session.tools, session.before, session.last)
            session.drop_unseen()
        # A new turn: a marked resend now replays only this request's reply, never an
        # older one (a re-ask whose first attempt failed would get the reply it re-asks).
        session.last = None
        session.busy = True
        running = asyncio.ensure_future(turn())
        self._running[session.key] = (fp, running)
        # The turn ends on its own even when the request awaiting it is cancelled (aiohttp
        # cancels the handler of a client that left, with handler_cancellation): the session
        # is busy until then, so a resend joins the turn instead of sampling it again.
        running.add_done_callback(functools.partial(self._ended, session, fp, held))
        return await asyncio.shield(running)

    async def settled(self, key: str) -> None:
        """Wait for the running turn of session ``key`` to end, if one runs (its own
        outcome is its request's)."""
        running = self._running.get(key)
        if running is not None:
            await asyncio.wait({running[1]})

    @staticmethod
    def seen(session: Session) -> None:
        """The session's last reply was handed to a client that is still connected."""
        session.before = None

    def _ended(
        self,
        session: Session,
        fp: str,
        held: Held | None,
        running: asyncio.Future[dict[str, Any]],
    ) -> None:
        """The turn ``running`` of ``session`` (request fingerprint ``fp``) ended: its reply
        is the one a resend marked as a retry gets. ``held``: the session before the turn
        took back an unseen one, restored when the turn was refused or failed (its request
        changed nothing: the same request as the unseen turn's still replays it)."""
        session.busy = False
        self.on_end(session.key)  # idle from now: also when no request awaits the turn
        if self._running.get(session.key, (None, None))[1] is running:
            self._running.pop(session.key)
        if not running.cancelled() and running.exception() is None:  # retrieved, too
            session.last = (fp, running.result())
            if held is not None:
                self.metrics["rollout/openai/unseen_dropped"] += 1
        elif held is not None:
            session.episode, session.shown, session.tools, session.before, session.last = held

    async def chat(
        self, session: Session, messages: list[Any], body: dict[str, Any]
    ) -> dict[str, Any]:
        """Sample one assistant turn and record it. The turn is prepared on a draft and
        committed only once the engine answered (see
        :class:`~rollout_servers.sessions.Draft`)."""
        asked_tokens(body)  # a bad request is refused before any work
        stops, logprobs = stop_strings(body), wants_logprobs(body)
        with ran_out_of_room(session):
            draft = await self._off_loop(
                prepare,
                session,
                messages,
                body.get("tools"),
                self.tok,
                max_prompt_len=self.max_prompt_len,
                max_response_len=self.max_response_len,
                version=self.engine.version,
            )
        piece = draft.episode.pieces[-1]
        # What the session has left: its samples together, as an agent episode's budget.
        left = self.max_response_len - draft.episode.response_len()
        budget = max_tokens_of(body, left, self.max_response_len)
        sample, raw, n = await self._sample(session, draft, budget, stops)
        draft.episode.messages.append({"role": "assistant", "content": raw})  # as written
        text = before_stop(raw, stops) if n else raw
        reply, finish = assistant_reply(text, tools=body.get("tool_choice") != "none")
        draft.shown.append(reply)
        ids = self._commit(session, draft, sample)
        if sample.finish_reason == "length":
            finish = "length"
        prompt_len = len(piece.prompt_ids) + len(piece.token_ids) - len(ids)
        out = completion_body(reply, finish, self.model, prompt_len, len(ids))
        if logprobs:  # the behaviour logprobs the turn is trained with
            out["choices"][0]["logprobs"] = token_logprobs(ids, sample.logprobs, self.tok)
        return out

    async def raw(
        self, session: Session, prompt: str | list[int], body: dict[str, Any]
    ) -> dict[str, Any]:
        """Sample a new piece of the session from a raw prompt (a checked text or token
        ids, :func:`~rollout_servers.openai_completions.raw_prompt`) and record it
        (committed only once the engine answered, as a chat turn)."""
        asked_tokens(body)  # a bad request is refused before any work
        stops = stop_strings(body)
        tokens: list[int] = await self._off_loop(prompt_ids, prompt, self.tok)
        limits = (self.max_prompt_len, self.max_response_len)
        with ran_out_of_room(session):
            draft = raw_draft(session, tokens, *limits, self.engine.version)
        left = self.max_response_len - draft.episode.response_len()  # the session's, too
        budget = max_tokens_of(body, left, self.max_response_len)
        sample, raw, n = await self._sample(session, draft, budget, stops)
        draft.episode.messages.append({"role": "completion", "content": raw})
        ids = self._commit(session, draft, sample)
        finish = "length" if sample.finish_reason == "length" else "stop"
        text = before_stop(raw, stops) if n else raw
        out = text_completion_body(text, finish, self.model, len(tokens), len(ids))
        if body.get("logprobs") is not None:  # 0: the behaviour logprobs of the sample
            out["choices"][0]["logprobs"] = text_logprobs(ids, sample.logprobs, self.tok)
        return out

    async def _sample(
        self, session: Session, draft: Draft, budget: int, stops: list[str]
    ) -> tuple[Sample, str, int]:
        """Sample the draft's current piece on (from its prompt and the tokens it holds),
        cut after the token that completes the first stop string, and add it to the piece.
        Returns the sample, its text as the model wrote it (without the end-of-turn
        token), and how many tokens a stop kept (0: no stop)."""
        ep, task = draft.episode, session.task
        piece = ep.pieces[-1]
        params = turn_params(self.sampling, task, session.index, ep.turns, budget)
        rid = f"{task.task_id}/{session.index}/t{ep.turns}"
        if not ep.turns:
            await self._reach(task)
        sample = await self.engine.generate(piece.prompt_ids + piece.token_ids, params, rid)
        if n := first_stop(sample.token_ids, self.tok.decode, stops):
            sample = cut(sample, n)  # the draw a stop would have ended (see stops.py)
            self.metrics["rollout/openai/stopped"] += 1
        piece.add_sampled(sample)
        ep.turns += 1
        ids = sample.token_ids
        eos = getattr(self.tok, "eos_token_id", None)
        return sample, str(self.tok.decode(ids[:-1] if ids and ids[-1] == eos else ids)), n

    async def _reach(self, task: Task) -> None:
        """A member's first turn waits, as a dealt task does, for the weights its group was
        dealt under (the admission window may open at the learner's send, before this
        engine loaded them): started under the weights before, the group would come out a
        version staler than it was admitted as. Counted; past :data:`REACH_S` it starts
        under what is loaded and the buffer's lag rule judges it."""
        waited = await self.engine.reach(task.dealt_version, REACH_S)
        self.metrics["rollout/openai/version_wait_ms"] += round(1000 * waited)
        if self.engine.version < task.dealt_version:
            self.metrics["rollout/openai/version_wait_missed"] += 1

    def _commit(self, session: Session, draft: Draft, sample: Sample) -> list[int]:
        """The session takes the drafted turn, counted; the sampled ids."""
        draft.commit(session)
        if draft.counted:
            self.metrics[f"rollout/openai/{draft.counted}"] += 1
        self.metrics["rollout/openai/completions"] += 1
        self.metrics["rollout/openai/tokens"] += len(sample.token_ids)
        return sample.token_ids


@contextlib.contextmanager
def ran_out_of_room(session: Session) -> Iterator[None]:
    """A turn refused for want of room (its context or the response budget) ends the
    session's episode as such (``ended``), as an agent episode of the server's own ends:
    the overlong penalty then measures it at the whole budget, as a response cut there."""
    try:
        yield
    except RequestError as e:
        if e.ended:
            session.episode.ended = e.ended
        raise
