"""Sessions of the OpenAI-compatible endpoint: what a chat request becomes in tokens (what
the endpoint answers is :mod:`rollout_servers.chat_bodies`). Pure: no sockets, no engine.

A *session* is one agent episode, named by its key (the API key the agent's client sends):
``GROUP/MEMBER``. The members of a group answer the same prompt and are compared with each
other (GRPO's group), so a group is complete when ``group_size`` members have a reward. A
key without ``/`` is a group of one, allowed only when ``group_size`` is 1.

A session keeps two views of its conversation: the one the model saw (assistant turns as
sampled, tool calls written inline, as the chat template renders them) in its
:class:`~rollout_servers.episodes.Episode`, and the one the agent was shown (tool calls as
OpenAI ``tool_calls``). A request whose messages extend the shown view by new messages
appends only their tokens (:func:`rollout_servers.episode_tokens.extend`); a request that rewrites
earlier messages starts a new sample from its own rendering, whose prompt may pass
``data.max_prompt_length`` as an agent episode's split may (:func:`next_piece`).

A turn is prepared on a :class:`Draft` (copies of what it changes) and committed only once
the engine answered: a refused or failed completion leaves the session exactly as it was,
so the agent's retry (OpenAI clients retry a 500 by themselves) continues the same sample.
What the agent got wrong (a malformed ``tools`` list or ``tool_calls``, a conversation the
chat template refuses) is a 400 naming the fix, never a 500 that clients would retry.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from asyncrl.control.messages import Task
from asyncrl.tools.tokens import render
from rollout_servers.episode_tokens import added_len, extend, new_sample
from rollout_servers.episodes import Episode, Piece

if TYPE_CHECKING:
    from rollout_servers.protocols import Tokenizer

#: Roles an agent may add between assistant turns (``developer``: OpenAI's newer
#: ``system``, rendered as one).
INPUT_ROLES = ("system", "developer", "user", "tool")
#: Characters a session key may have.
MAX_KEY = 256


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and one line naming the fix.
    ``retry`` says whether the same request may succeed later (429, 503 and a busy session
    may; a refused request as such, or a run that is ending, may not): OpenAI clients obey
    it (the ``x-should-retry`` header) before their own rule, which retries every 409."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request_error",
        retry: bool | None = None,
        api_code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.retry = status in (429, 503) if retry is None else retry
        self.api_code = api_code or str(status)  # the API's error.code is a string
        self.ended = ""  # a key of ENDED: the session ran out of room (see out_of_room)

    def body(self) -> dict[str, Any]:
        """The error body, shaped as the OpenAI API shapes its errors (``type``, and a
        string ``code`` such as ``context_length_exceeded`` that clients match on)."""
        return {"error": {"message": self.message, "type": self.code, "code": self.api_code}}


@dataclass
class Session:
    """One agent episode: its tokens (``episode``), the conversation as the agent was
    shown it, and its reward once the agent sends one."""

    key: str
    index: int  # member number within its group, in order of arrival
    task: Task  # its group's external slot
    episode: Episode
    shown: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict] | None = None  # the tool schemas of its first request
    reward: float | None = None
    busy: bool = False  # a completion is running (a session is sequential)
    # (fingerprint, reply) of its last turn: a client's retry of it gets the same reply
    last: tuple[str, dict[str, Any]] | None = None
    # What the session was before its last turn, while that turn's reply has reached no
    # client (each request for it left first): the turn is the agent's only once one has.
    before: tuple[Episode, list[dict[str, Any]], list[dict] | None] | None = None
    # the answer to its reward: a client's re-post of the same reward gets it again
    reward_reply: dict[str, Any] | None = None

    @property
    def unseen(self) -> bool:
        """The last turn's reply has reached no client yet."""
        return self.before is not None

    def drop_unseen(self) -> bool:
        """Take back the last turn if its reply reached no client: the agent goes on (or
        ends) from the conversation it was shown, so a turn it never read is not trained
        with its reward. True when a turn was taken back."""
        if self.before is None:
            return False
        self.episode, self.shown, self.tools = self.before
        self.before, self.last = None, None
        return True


@dataclass
class Group:
    """Sessions that answer the same prompt; one external slot of the admission budget."""

    name: str
    task: Task
    size: int
    sessions: dict[str, Session] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)

    def rewarded(self) -> list[Session]:
        """Members with a reward and at least one turn, in order of arrival."""
        done = [s for s in self.sessions.values() if s.reward is not None and s.episode.turns]
        return sorted(done, key=lambda s: s.index)

    def ended(self) -> int:
        """Members with a reward, turns or not: a member refused from its first request
        ends with its reward like the others (it trains nothing), so the group completes."""
        return sum(s.reward is not None for s in self.sessions.values())


def split_key(key: str, group_size: int) -> tuple[str, str]:
    """``(group, member)`` of a session key (see the module docstring)."""
    if not key:
        raise RequestError(401, "no session key: send GROUP/MEMBER as the API key", "auth")
    if len(key) > MAX_KEY:
        raise RequestError(
            400, f"session key of {len(key)} characters: keep GROUP/MEMBER to {MAX_KEY} or fewer"
        )
    group, sep, member = key.rpartition("/")
    if not sep:
        if group_size > 1:
            raise RequestError(
                400,
                f"session key {key!r} names no group: use GROUP/MEMBER as the API key "
                f"(rollout.openai_endpoint.group_size={group_size} members share a GROUP)",
            )
        return key, ""
    if not group or not member:
        raise RequestError(400, f"session key {key!r}: GROUP and MEMBER must not be empty")
    return group, member


def text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(400, "only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(400, f"message content must be a string, not {type(content).__name__}")


def input_message(msg: Any) -> dict[str, Any]:
    """A system, user or tool message as the chat template gets it (role, text, name)."""
    if not isinstance(msg, dict) or msg.get("role") not in INPUT_ROLES:
        role = msg.get("role") if isinstance(msg, dict) else type(msg).__name__
        raise RequestError(
            400,
            f"message role {role!r} cannot be added by the agent: send the conversation "
            f"so far (assistant turns as this endpoint returned them) plus new "
            f"{'/'.join(INPUT_ROLES)} messages",
        )
    role = "system" if msg["role"] == "developer" else msg["role"]  # OpenAI's newer name
    out: dict[str, Any] = {"role": role, "content": text_of(msg.get("content"))}
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def model_message(msg: Any) -> dict[str, Any]:
    """A message of a rewritten conversation as the model reads it: an assistant turn's
    tool calls written inline (hermes), as the model writes them; others as
    :func:`input_message`."""
    if not isinstance(msg, dict) or msg.get("role") != "assistant":
        return input_message(msg)
    text = text_of(msg.get("content"))
    for call in tool_calls_of(msg):
        fn = call["function"]
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
            block = json.dumps({"name": fn.get("name", ""), "arguments": args})
        except (ValueError, RecursionError):
            # Not JSON: a malformed block's raw text (chat_bodies.assistant_reply), written
            # back as the model wrote it
            block = args
        text += f"<tool_call>\n{block}\n</tool_call>"
    return {"role": "assistant", "content": text}


def tool_calls_of(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: a list of ``{"function": {"name": ...}}``
    objects (or none), else a 400."""
    calls = msg.get("tool_calls") or []
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
    )
    if not ok or not all(isinstance(c["function"].get("name", ""), str) for c in calls):
        raise RequestError(
            400,
            "an assistant message's tool_calls must be a list of "
            '{"type": "function", "function": {"name": ..., "arguments": ...}} objects, '
            "as this endpoint returned them",
        )
    return calls


def tools_of(tools: Any) -> list[dict[str, Any]] | None:
    """The request's ``tools``: None, or a list of ``{"type": "function", "function":
    {"name": ...}}`` schemas, else a 400."""
    if tools is None:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    )
    if not ok:
        raise RequestError(
            400,
            'tools must be a list of {"type": "function", "function": {"name": ..., '
            '"parameters": {...}}} objects',
        )
    return tools or None


def check_conversation(messages: list[Any], tools: Any) -> None:
    """A chat request's ``messages`` and ``tools`` read as :func:`prepare` reads them (a
    400 for a role, content or tool call it would refuse), before the request's session
    takes a slot of the staleness budget."""
    tools_of(tools)
    for msg in messages:
        model_message(msg)


def _same(shown: dict[str, Any], sent: Any) -> bool:
    if not isinstance(sent, dict) or sent.get("role") != shown["role"]:
        return False
    return text_of(sent.get("content")).strip() == text_of(shown.get("content")).strip()


def new_messages(session: Session, messages: list[Any]) -> list[dict[str, Any]] | None:
    """The messages the agent added since the session's last turn; None when it rewrote
    the conversation instead (then the request is a new sample of the episode)."""
    shown = session.shown
    if shown and isinstance(shown[0], dict) and shown[0].get("role") == "completion":
        # the last sample came from a raw completion (openai_completions.RAW): no chat
        # message continues it
        return None
    if len(messages) <= len(shown) or not all(map(_same, shown, messages)):
        return None
    added = messages[len(shown) :]
    if any(isinstance(m, dict) and m.get("role") == "assistant" for m in added):
        return None  # an assistant turn the model did not sample (a prefill, a handoff)
    return [input_message(m) for m in added]


def first_new(session: Session, messages: list[Any]) -> int:
    """Where what the agent added since the model's last turn starts in a rewritten
    conversation: after that turn when it is still there (a history trimmed before it),
    else after what the session was shown already (the turn itself dropped, or replaced
    by a prefill or a handoff, which count)."""
    shown = session.shown
    reply = next((m for m in reversed(shown) if m.get("role") == "assistant"), None)
    if reply is not None:
        at = next((i for i in range(len(messages) - 1, -1, -1) if _same(reply, messages[i])), -1)
        if at >= 0:
            return at + 1
    n = 0
    while n < min(len(shown), len(messages)) and _same(shown[n], messages[n]):
        n += 1
    return n


def first_piece(prompt_ids: list[int], max_prompt_len: int, version: int) -> Piece:
    """The first sample of a session, or a refusal when its prompt does not fit."""
    if len(prompt_ids) > max_prompt_len:
        raise context_exceeded(
            max_prompt_len,
            f"the prompt of {len(prompt_ids)} tokens exceeds data.max_prompt_length="
            f"{max_prompt_len}: shorten the conversation or raise it",
        )
    return Piece(prompt_ids=prompt_ids, start_version=version)


def next_piece(
    ep: Episode,
    prompt_ids: list[int],
    lead: int,
    *,
    max_prompt_len: int,
    max_response_len: int,
    version: int,
) -> None:
    """Start the episode's next sample from ``prompt_ids`` (its last ``lead`` tokens are the
    session's response), or refuse it. A session's first prompt is held to
    ``data.max_prompt_length`` (:func:`first_piece`); a later one (a rewritten conversation,
    a raw completion) is a history that grew, taken as an agent episode's split takes one
    (:func:`~rollout_servers.episode_tokens.new_sample`): past the limit while it and the
    response budget left fit the engine's context."""
    if not ep.pieces:
        ep.pieces.append(first_piece(prompt_ids, max_prompt_len, version))
        return
    why = new_sample(ep, prompt_ids, lead, max_prompt_len, max_response_len)
    if why:
        raise out_of_room(why, max_prompt_len, max_response_len)
    ep.pieces[-1].start_version = version


def context_exceeded(limit: int, detail: str) -> RequestError:
    """A 400 that clients treat as the end of the context window, not as an error to
    retry: OpenAI's code and the opening LiteLLM (and so SWE-agent) match in the text."""
    return RequestError(
        400,
        f"This model's maximum context length is {limit} tokens. However, {detail}",
        api_code="context_length_exceeded",
    )


ENDED = {
    "length": "the session has no room left in data.max_response_length for another "
    "turn: end the episode with POST /rl/reward",
    "prompt_too_long": "the conversation and the response room left no longer fit the "
    "engine's context (data.max_prompt_length + data.max_response_length): end the episode "
    "with POST /rl/reward",
}


def out_of_room(why: str, max_prompt_len: int, max_response_len: int) -> RequestError:
    """The refusal of a turn that does not fit (``why``: a key of :data:`ENDED`), naming
    the limit it hit."""
    limit = max_response_len if why == "length" else max_prompt_len + max_response_len
    error = context_exceeded(limit, ENDED[why])
    error.ended = why
    return error


@dataclass
class Draft:
    """A turn prepared on copies of what it changes (see the module docstring)."""

    episode: Episode
    shown: list[dict[str, Any]]
    tools: list[dict] | None
    counted: str = ""  # ``splits`` or ``rewritten``: counted by the endpoint on commit

    def commit(self, session: Session) -> None:
        """The engine answered: the session takes the turn (kept until a client has its
        reply, see :meth:`Session.drop_unseen`)."""
        session.before = (session.episode, session.shown, session.tools)
        session.episode, session.shown, session.tools = self.episode, self.shown, self.tools


def prepare(
    session: Session,
    messages: list[Any],
    tools: Any,
    tok: Tokenizer,
    *,
    max_prompt_len: int,
    max_response_len: int,
    version: int,
) -> Draft:
    """A draft whose current sample ends where the next turn starts: the session's first
    prompt, the new messages appended, or a new sample (history rewritten, or a template
    that rewrites it). ``version`` is the engine's, for a new sample's start. The session
    itself is not touched."""
    ep = session.episode
    draft = Draft(ep.draft(), list(session.shown), session.tools if ep.pieces else None)
    try:
        asked = tools_of(tools)
        # New tool schemas change the prompt the model reads: a new sample renders them.
        same_tools = bool(ep.pieces) and asked == session.tools
        added = new_messages(session, messages) if same_tools else None
        draft.tools = draft.tools if same_tools else asked
        if added is not None:
            new = draft.episode
            why = extend(new, added, tok, draft.tools, max_prompt_len, max_response_len)
            if why == "split":
                new.pieces[-1].start_version = version
                draft.counted = "splits"
            elif why:
                raise out_of_room(why, max_prompt_len, max_response_len)
            draft.shown.extend(messages[len(draft.shown) :])
            return draft
        draft.counted = "rewritten" if ep.pieces else ""
        history = [model_message(m) for m in messages]
        prompt = render(tok, history, draft.tools, gen=True)
    except TemplateError as e:
        raise RequestError(400, f"the chat template refused the conversation: {e}") from e
    lead = 0
    if ep.pieces:  # rewritten: what the agent added since the model's turn is response
        lead = added_len(tok, prompt, history, first_new(session, messages), draft.tools)
    next_piece(
        draft.episode,
        prompt,
        lead,
        max_prompt_len=max_prompt_len,
        max_response_len=max_response_len,
        version=version,
    )
    draft.episode.messages[:] = history
    draft.shown[:] = list(messages)
    return draft
