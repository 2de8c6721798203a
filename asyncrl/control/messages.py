"""Control-plane messages: typed msgpack (msgspec structs), one frame each.

Two sockets, both bound by the coordinator as ROUTER; every peer talks to them from REQ
sockets (one request, one reply):

``tasks`` (``endpoints.tasks``)
    :class:`TaskRequest` -> :class:`TaskGrant` (held by the coordinator up to ``wait_s``
    while nothing can be granted: a long-poll, so dealing resumes the moment the budget
    opens); :class:`TaskAck` -> :class:`TaskAckReply` (also accepted on ``control``, as is
    :class:`TaskNack` -> :class:`Ok`).

``control`` (``endpoints.control``)
    :class:`Register` -> :class:`Registered`; :class:`Heartbeat` -> :class:`Announcement`
    (a long-poll too: answered at once when there is news for that server, otherwise after
    ``wait_s``); :class:`SlotRequest` -> :class:`TaskGrant` (at once); :class:`SyncDone`,
    :class:`Leave` and :class:`ShutdownRequest` -> :class:`Ok`. Anything refused gets :class:`ErrorReply`.

Announcements are level-triggered, not a queue: a heartbeat says which version and which
sync the server has already seen (``seen_version``, ``seen_sync``), and the coordinator
answers with its current state. A reply lost to a timeout is therefore repeated by the
next heartbeat instead of being lost (PUB/SUB would drop it silently).

Every message is an :class:`asyncrl.wire.base.Message` (it carries ``schema``, and decoders
refuse other versions), :class:`Ok` and :class:`ErrorReply` are the buffer's too, and a
message that cannot be accepted raises :class:`~asyncrl.wire.base.WireError`. Both sides
read messages of at most ``control.max_message_mb`` (:func:`decode_request`,
:func:`decode_reply`), and the coordinator builds no grant past it
(:mod:`asyncrl.control.grant_size`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

from asyncrl.sync.plan import WeightPlan
from asyncrl.wire.base import SCHEMA_VERSION as SCHEMA_VERSION  # re-exported
from asyncrl.wire.base import ErrorReply, Message, Ok, check_size, decode
from asyncrl.wire.base import encode as encode  # re-exported
from asyncrl.wire.types import Version

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
ServerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
TaskId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
# Bounds on what one message from a server may hold: a hostile or broken peer costs at most
# one message's worth of memory and time (a server holds far fewer tasks than this).
TaskIds = Annotated[list[TaskId], msgspec.Meta(max_length=65536)]

#: ``control.max_message_mb``'s default, the bound on a control message where no config
#: gives one. Every role reads the configured bound (a grant of code tasks, whose tests ride
#: in ``ground_truth``, easily takes more than this default).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


#: How a failed sync's report (``SyncDone.error``) begins when the server's engine is left
#: holding partly loaded weights: its client then registers them as such
#: (``Register.weights_partial``).
WEIGHTS_PARTIAL = "weights partly loaded"


# ----------------------------------------------------------------------- payloads
class Task(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One prompt to sample ``n`` responses for; every response carries ``task_id``.

    ``task_id`` is unique per deal and deterministic: ``train/<epoch>/<position>`` (position
    in that epoch's shuffled order) or ``val/<round>/<row>``. A task re-dealt after its
    server died keeps its id and gets ``attempt + 1``; the buffer keeps the first copy.
    """

    task_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    data_source: str
    prompt: list[dict[str, Any]]  # chat messages, as in veRL's parquet
    ground_truth: Any  # reward_model.ground_truth: a string, or a dict (countdown)
    n: Annotated[int, msgspec.Meta(ge=1)]  # samples per prompt (rollout.n, val_kwargs.n)
    validation: bool = False  # outside the budget; the buffer routes it to metrics
    extra_info: dict[str, Any] = {}
    prompt_token_ids: list[int] | None = None  # set when the dealer tokenizes
    attempt: NonNeg = 0  # 0: first deal; k: re-dealt k times
    dealt_version: Version = 0  # the policy version when it was (last) dealt
    # The session of the coordinator that dealt it ("": not said): a server's report names
    # it, so that a report sent again across a learner restart cannot end the new
    # coordinator's own deal of the same id (``TaskAck.session``).
    dealt_session: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # veRL's per-row agent: single_turn, or tool_agent (a multi-turn episode with tools
    # when rollout.multi_turn.enable; tools_kwargs and interaction_kwargs in extra_info).
    agent_name: Annotated[str, msgspec.Meta(max_length=64)] = "single_turn"
    # algorithm.filter_groups: drop the group at the server if its members score alike.
    filter: bool = False


class SyncStart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Join group ``generation`` at ``rank`` (learner rank 0) and receive ``version``.

    ``rank`` is the first of the server's ``engine_world_size`` ranks. ``catchup`` marks a
    one-off group (``catchup/<server>/<n>``, world 2 for a one-rank engine) for a server
    that joined late or failed a sync.
    """

    sync_id: NonNeg  # increases with every sync the coordinator starts
    version: Version
    generation: str
    rank: Annotated[int, msgspec.Meta(ge=1)]
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    plan: WeightPlan  # where each tensor travels (the learner's, as it built it)
    backend: str = "gloo"
    timeout_s: float = 120.0
    catchup: bool = False
    # The coordinator session that started it: sync ids restart from a checkpoint's, so a
    # report a server sends late, after a learner restart, names the round it is about.
    session: str = ""


# ----------------------------------------------------------------------- requests
class TaskRequest(Message, tag="task_request"):
    """Ask for up to ``max_tasks`` tasks; the coordinator may hold it up to ``wait_s``.

    ``request_id`` makes a retry idempotent: a client whose reply timed out asks again
    with the same id and gets the same grant again (its tasks were dealt already), so a
    lost reply never strands tasks at a live server. It moves on after each reply.
    """

    server_id: ServerId
    max_tasks: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.0
    request_id: NonNeg = 0
    #: The responses the server has room for (0: not said): tasks are dealt while their
    #: ``n`` fit, and always the first (a validation group's ``val_kwargs.n`` may be above
    #: ``rollout.n``, the size the server's request counted on).
    max_samples: NonNeg = 0


class SlotRequest(Message, tag="slot_request"):
    """Ask for one *external* training slot: a task id charged to the admission budget like
    any training task, for a group whose prompt comes from outside the run (a rollout
    server's OpenAI-compatible endpoint). Answered at once with a :class:`TaskGrant` of
    one task (``data_source`` ``external``, no prompt) or none, with the reason.

    ``request_id`` makes a retry idempotent, as for :class:`TaskRequest`. Sent on the
    control socket, so it never waits behind a held task request.
    """

    server_id: ServerId
    request_id: NonNeg = 0


class TaskAck(Message, tag="task_ack"):
    """These tasks' groups were handed whole to the trajectory socket: never re-deal them.

    ``filtered``: instead, their groups were dropped at the server by the group filter
    (every member scored alike): never re-deal them either; their budget frees at once.
    ``prompt_too_long`` with it: dropped before generation by ``data.filter_overlong_prompts``
    (accounted alike, but no verdict of the group filter: it counts toward neither its
    bound nor a prompt's skip streak).
    """

    server_id: ServerId
    task_ids: TaskIds
    filtered: bool = False
    prompt_too_long: bool = False
    # With ``filtered``, each task's attempt as this server was dealt it (Task.attempt);
    # None: not said. A report sent again after a lost reply must not end the task's next
    # deal here (that deal's group is judged on its own).
    attempts: list[int] | None = None
    # With ``attempts``, the coordinator session that dealt the tasks (Task.dealt_session;
    # "": not said): after a learner restart, attempts start over, and a report of the old
    # coordinator's deal would match the new one's.
    session: Annotated[str, msgspec.Meta(max_length=64)] = ""


class TaskNack(Message, tag="task_nack"):
    """These tasks failed at this server (``reason`` says how): deal them again elsewhere.

    Sent only for a task whose group was not handed to the trajectory socket; the
    coordinator deals it again, or gives it up after ``control.task_retries`` failures.
    """

    server_id: ServerId
    task_ids: TaskIds
    reason: Text = ""
    # Each task's attempt as this server was dealt it (Task.attempt); None: not said. A
    # report sent again after a lost reply must not fail the task's next deal here.
    attempts: list[int] | None = None
    session: Annotated[str, msgspec.Meta(max_length=64)] = ""  # as in TaskAck


class Register(Message, tag="register"):
    """A rollout server announces itself (again after a restart or a "not registered").

    ``engine_world_size`` is how many sync ranks the server's engine occupies; 0 means it
    takes no part in weight syncs (a stand-in, or a server that loads weights elsewhere)
    and simply adopts announced versions.
    """

    server_id: ServerId
    address: Text = ""  # where the server can be reached (informational: logs, metrics)
    engine_world_size: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 1
    policy_version: Version = 0  # the version of the weights it holds now
    pid: int = 0
    # Tasks it is still generating (a registration after the coordinator restarted): they
    # stay its own instead of being dealt a second time.
    task_ids: TaskIds = []
    # Its values of the keys it must share with the learner (asyncrl.config.shared): a
    # registration that differs is refused (``config_mismatch``). Empty: not judged.
    settings: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=128)], Text], msgspec.Meta(max_length=64)
    ] = {}
    # Its engine's weights are partly loaded (a sync broke off mid-load; it holds
    # generation): ``policy_version`` is its last whole load, not what it holds.
    weights_partial: bool = False


#: Metrics one heartbeat may carry (a client sends at most these; see ``Heartbeat``).
HEARTBEAT_METRICS_MAX = 1024


class Heartbeat(Message, tag="heartbeat"):
    """Liveness plus a watch: answered when there is news newer than ``seen_*``."""

    server_id: ServerId
    session: Annotated[str, msgspec.Meta(max_length=64)]  # the session it registered with
    policy_version: Version  # weights it holds
    seen_version: Version  # latest announced version it has seen
    seen_sync: NonNeg  # latest sync_id it has seen (0: none)
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.0
    # The server's own (e.g. rollout/tokens_per_s), for logs.
    metrics: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=256)], float],
        msgspec.Meta(max_length=HEARTBEAT_METRICS_MAX),
    ] = {}


class SyncDone(Message, tag="sync_done"):
    """A member finished sync ``sync_id``: loaded ``version`` (``ok``) or failed."""

    server_id: ServerId
    sync_id: NonNeg
    version: Version
    ok: bool
    error: Text = ""
    seconds: float = 0.0
    checksum: str = ""  # optional digest of what was loaded (tests, debugging)
    # The post-sync probe scored with the loaded weights (asyncrl.sync.probe); empty: none.
    probe: Annotated[list[float], msgspec.Meta(max_length=1024)] = []
    session: Annotated[str, msgspec.Meta(max_length=64)] = ""  # its SyncStart's


class Leave(Message, tag="leave"):
    """A server stops cleanly, or the launcher reaped it; its unacknowledged tasks are
    re-dealt at once. ``pid`` (0: any) names the process that left: a Leave for an earlier
    incarnation than the registered one is ignored."""

    server_id: ServerId
    reason: Text = ""
    pid: int = 0


class ShutdownRequest(Message, tag="shutdown"):
    """Ask the coordinator to end the run: it tells every peer and the buffer to stop."""

    reason: Text = ""


# ----------------------------------------------------------------------- replies
class TaskGrant(Message, tag="task_grant"):
    """Tasks (possibly none). With none, ``reason`` says why: ``budget`` (admission),
    ``catchup`` (weights must be caught up first), ``exhausted`` (no training data left),
    ``starting`` (fewer than ``control.min_servers_to_start`` servers registered yet, or a
    resumed coordinator still learning what the servers and the buffer hold),
    ``unregistered`` (register again), ``shutdown``. With fewer tasks than asked, ``size``
    says the next task would have taken the reply past ``control.max_message_mb`` (it
    waits for the next request)."""

    tasks: list[Task]
    policy_version: Version
    reason: str = ""
    detail: Text = ""  # a refused slot request: who holds the budget (one line)


class TaskAckReply(Message, tag="task_ack_reply"):
    acked: list[str]
    unknown: list[str]  # not outstanding (already acknowledged, or from an old session)


class Registered(Message, tag="registered"):
    """Welcome: the current version, where to sync, and how often to heartbeat."""

    server_id: ServerId
    session: str
    policy_version: Version
    sync_store_host: str
    sync_store_port: int
    generation: str  # current main group generation ("" before the first sync)
    heartbeat_s: float
    dead_after_s: float
    catchup: bool  # a catch-up sync comes before the first task
    # The session's secret part of every sync group's store prefix: only registered servers
    # learn it (over the control channel, authenticated with endpoints.auth: curve).
    sync_secret: str = ""


class Announcement(Message, tag="announcement"):
    """Answer to a heartbeat: the version announcement, a sync to join, or shutdown."""

    registered: bool  # False: unknown here (declared dead, or a new session): register
    policy_version: Version
    sync: SyncStart | None = None
    shutdown: bool = False


Request = (
    TaskRequest
    | SlotRequest
    | TaskAck
    | TaskNack
    | Register
    | Heartbeat
    | SyncDone
    | Leave
    | ShutdownRequest
)
Reply = TaskGrant | TaskAckReply | Registered | Announcement | Ok | ErrorReply

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def decode_request(frame: Any, max_bytes: int = 0) -> Request:
    """A validated request of any kind, at most ``max_bytes`` (0: the default bound); raises
    :class:`~asyncrl.wire.base.WireError`."""
    return decode(_request_decoder, frame, within(frame, max_bytes))


def decode_reply(frame: Any, max_bytes: int = 0) -> Reply:
    """A validated reply of any kind, at most ``max_bytes`` (0: the default bound); raises
    :class:`~asyncrl.wire.base.WireError`."""
    return decode(_reply_decoder, frame, within(frame, max_bytes))


#: Room :func:`check_sync_start` leaves for a sync's group and session names (a catch-up's
#: group is ``catchup/<server id of up to 128 characters>/<n>``).
_NAME_ROOM = 256


def check_sync_start(plan: WeightPlan, max_bytes: int = 0) -> int:
    """The bytes of the heartbeat reply that announces a sync of ``plan`` (at most: names
    at their longest); raises ValueError, naming the key that fixes it, when that reply is
    over ``max_bytes`` (0: the default bound).

    Why before the first push: a server's socket drops a reply over the bound unread, so it
    would hear nothing, give the coordinator up as silent, restart and be sent the same
    catch-up again, while the learner's syncs time out. A plan lists every tensor by name,
    about 65 bytes each: a mixture of experts of ~70k expert matrices passes 4 MiB."""
    limit = max_bytes or DEFAULT_MAX_MESSAGE_BYTES
    start = SyncStart(
        sync_id=1 << 62,
        version=1 << 62,
        generation="g" * _NAME_ROOM,
        rank=1,
        world_size=2,
        plan=plan,
        session="s" * _NAME_ROOM,
        catchup=True,
    )
    size = len(encode(Announcement(registered=True, policy_version=1 << 62, sync=start)))
    if size > limit:
        tensors = sum(len(b.entries) for b in plan.buckets)
        raise ValueError(
            f"announcing a weight sync of {tensors} tensors takes {size / 2**20:.3g} MiB, "
            f"more than control.max_message_mb={limit / 2**20:.3g} allows: set "
            f"control.max_message_mb={math.ceil(size * 1.25 / 2**20 * 10) / 10:g} or more in "
            "the config every role reads"
        )
    return size


def within(frame: Any, max_bytes: int) -> int:
    """The bound ``frame`` is read under (``max_bytes``, 0: the default), or ``oversize``
    naming the key that raises it."""
    limit = max_bytes or DEFAULT_MAX_MESSAGE_BYTES
    check_size([frame], limit, "control.max_message_mb")
    return limit
