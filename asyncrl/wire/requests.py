"""The buffer's request/reply socket (``endpoints.batches``): what a consumer (the learner,
the coordinator) asks and what the buffer answers, as msgspec structs tagged by ``kind``
(:data:`Request`, :data:`Reply`), and the summaries some replies carry. Every message is a
:class:`asyncrl.wire.base.Message`; :class:`Ok` and :class:`ErrorReply` are the ones the
coordinator's sockets answer with too. Frame layout and codec: :mod:`asyncrl.wire`,
:mod:`asyncrl.wire.codec`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncrl.wire.base import ErrorReply, Message, Ok
from asyncrl.wire.types import NonNegInt, ShortStr, TrajectoryMeta, Version


# ----------------------------------------------------------------------- reply payloads
class DroppedTask(msgspec.Struct, frozen=True):
    """A task whose group the buffer threw away without training on it.

    ``cause`` is ``lag``, ``expired``, ``overflow`` (a new group while the buffer held
    ``capacity_groups`` incomplete ones) or ``duplicate`` (a training group that came
    again after the buffer used and forgot its first copy; a duplicate of a group still
    held is not reported: its first copy counts). The coordinator returns such tasks to
    the admission budget (docs/DESIGN.md section 4).
    """

    task_id: str
    cause: str
    validation: bool = False


class ValidationGroup(msgspec.Struct, array_like=True, frozen=True):
    """One scored validation group, summed over its episodes (the samples of a split
    episode share its reward). The buffer keeps one per validation id, so a learner adds
    each group once, whichever buffer session scored it, however often it is read."""

    data_source: str
    trajectories: int
    reward_sum: float
    reward_sq_sum: float
    response_tokens: int
    # What else the scorer returned (a dict's other keys: ``acc``, a format score), summed
    # over the episodes that carry it, with their count: name -> (sum, episodes).
    parts: dict[str, tuple[float, int]] = {}

    @classmethod
    def of(
        cls,
        data_source: str,
        rewards: list[float],
        response_tokens: int,
        parts: list[dict[str, float]] | None = None,
    ) -> ValidationGroup:
        """The group whose episodes scored ``rewards`` (and returned ``parts``, one dict per
        episode)."""
        total, sq = sum(rewards), sum(r * r for r in rewards)
        summed: dict[str, tuple[float, int]] = {}
        for episode in parts or []:
            for name, value in episode.items():
                s, n = summed.get(name, (0.0, 0))
                summed[name] = (s + value, n + 1)
        return cls(data_source, len(rewards), total, sq, response_tokens, summed)


class ValidationStats(msgspec.Struct, kw_only=True):
    """Validation results of one data source, summed over complete groups (squares too,
    for standard errors over responses and over prompts)."""

    groups: int = 0
    trajectories: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    group_mean_sum: float = 0.0  # sum over groups of the group's mean reward
    group_mean_sq_sum: float = 0.0
    response_tokens: int = 0
    parts: dict[str, tuple[float, int]] = {}  # name -> (sum, episodes), see ValidationGroup

    def add(self, g: ValidationGroup) -> None:
        """Count one complete group."""
        mean = g.reward_sum / max(g.trajectories, 1)
        self.groups += 1
        self.trajectories += g.trajectories
        self.reward_sum += g.reward_sum
        self.reward_sq_sum += g.reward_sq_sum
        self.group_mean_sum += mean
        self.group_mean_sq_sum += mean * mean
        self.response_tokens += g.response_tokens
        for name, (total, n) in g.parts.items():
            s, m = self.parts.get(name, (0.0, 0))
            self.parts[name] = (s + total, m + n)

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.trajectories if self.trajectories else float("nan")

    @property
    def response_length_mean(self) -> float:
        return self.response_tokens / self.trajectories if self.trajectories else float("nan")


# ----------------------------------------------------------------------- batch socket
class Hello(Message, tag="hello"):
    """READY handshake and session start of a consumer.

    It tells the buffer that the consumer holds nothing beyond ``acked_through``: batches
    released to this ``consumer_id`` with a larger id and not acknowledged are released
    again, in order (so a learner keeps its consumer id across restarts).
    ``acked_through`` is the last batch id whose effect the consumer's restored checkpoint
    contains (None: no checkpoint); the buffer acknowledges every batch up to it first, so a
    crash between saving a checkpoint and acknowledging loses nothing and repeats nothing.
    """

    consumer_id: ShortStr
    acked_through: int | None = None
    # The buffer session ``acked_through`` belongs to: after a buffer restart, the same
    # number names another batch. Another session's, or "" (not said), acknowledges
    # nothing: the batches come again (trained twice rather than taken for trained).
    session: ShortStr = ""
    # False: the consumer starts without a checkpoint and replays nothing; the groups of
    # its unacknowledged batches go back to the pool (under the lag filter).
    resumed: bool = True
    # A random token per client object (:class:`asyncrl.net.buffer_client.BufferClient`),
    # sent with its batch requests and acks too: the buffer refuses those of any other
    # token under this ``consumer_id`` (``ErrorReply("superseded")``), so a learner left
    # alive beside its successor cannot take the successor's batches (trained twice).
    # "" (an older client): matches only "".
    incarnation: ShortStr = ""


class BatchRequest(Message, tag="batch_request"):
    """Ask for the next training batch; the buffer waits up to ``wait_s`` for one.

    ``received_session``/``received_through`` name the last batch the consumer received
    (through None: none yet); a batch released to it after that one, whose reply it never
    got, is sent again first. ``received_session`` None: the consumer does not track.

    ``ack`` acknowledges batches as an :class:`Ack` would, before the request is served: a
    consumer that acknowledges every batch once trained saves one round trip a batch. They
    are batches of ``received_session``: the buffer ignores them if that is not its own.

    A request whose ``incarnation`` is not that of the last :class:`Hello` under its
    ``consumer_id`` is refused (``ErrorReply("superseded")``), its acks unapplied.
    """

    consumer_id: ShortStr
    policy_version: Version  # the learner's current version: the lag filter uses it
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0
    received_session: ShortStr | None = None
    received_through: int | None = None
    ack: list[int] = msgspec.field(default_factory=list)
    incarnation: ShortStr = ""  # the sender's, as in its :class:`Hello`


class Ack(Message, tag="ack"):
    """The consumer's checkpoint contains these batches: the buffer may forget them.

    ``session``: the buffer session that numbered them; a buffer of another session (it
    restarted since) ignores them, since its batch ids name other batches. None: not said
    (the buffer takes them as its own).
    """

    consumer_id: ShortStr
    batch_ids: list[int]
    session: ShortStr | None = None
    incarnation: ShortStr = ""  # the sender's, as in its :class:`Hello`


class StatsRequest(Message, tag="stats"):
    """Ask for the buffer's metrics (does not change anything)."""


class DroppedRequest(Message, tag="dropped"):
    """Tasks dropped unused and validation tasks scored, from these positions of the two
    logs of buffer ``session`` (the coordinator's poll; it moves its cursors only when the
    reply came, so a lost reply is read again). Another session's cursors read from 0."""

    session: ShortStr = ""
    drops_from: NonNegInt = 0
    validated_from: NonNegInt = 0


class InventoryRequest(Message, tag="inventory"):
    """Which task ids the buffer holds and which it dropped (does not change anything).

    The coordinator asks after its own restart and after the buffer's, to learn which
    acknowledged groups were lost and which dealt tasks must not be dealt again. With
    ``ids`` it asks only about those (its audit of acknowledged groups): the reply's
    ``unknown`` lists the ones this buffer session never received.
    """

    ids: list[str] | None = None


class ValidationRequest(Message, tag="validation"):
    """The validation groups this buffer session scored, per round and id, for the rounds
    named (``rounds``: round keys, ``val.<lineage>/<round>``; empty: every round). Never
    drained: a reply lost on the way, or a learner restarted from a checkpoint taken before
    it read them, reads them again."""

    rounds: list[str] = []


class Shutdown(Message, tag="shutdown"):
    """Stop the buffer service (it replies :class:`Ok` first)."""


class Welcome(Message, tag="welcome"):
    redelivering: int  # unacknowledged batches that will be released again first
    next_batch_id: int
    acked: int  # batches acknowledged by ``acked_through``
    # The highest learner version the buffer has measured lag against: a learner that
    # starts without a checkpoint numbers its versions above it (they never go back).
    policy_version: int = 0


class BatchHeader(Message, tag="batch"):
    """First frame of a batch reply; 3 array frames follow, as in a trajectory message.

    ``group_sizes`` splits ``trajectories`` into groups (consecutive, in order).
    """

    batch_id: int
    policy_version: int
    redelivered: bool
    group_sizes: list[Annotated[int, msgspec.Meta(ge=1)]]
    trajectories: list[TrajectoryMeta]
    lag_histogram: dict[int, int]
    metrics: dict[str, float]
    session: str = ""  # the buffer session that numbered it


class NoBatch(Message, tag="no_batch"):
    """No batch within ``wait_s``: ``ready`` training groups, ``needed`` for one batch."""

    ready: int
    needed: int


class AckReply(Message, tag="ack_reply"):
    acked: list[int]
    unknown: list[int]  # not released or already acknowledged: ignored


class StatsReply(Message, tag="stats_reply"):
    metrics: dict[str, float]


class DroppedReply(Message, tag="dropped_reply"):
    dropped: list[DroppedTask]
    validated: list[str] = []  # validation task ids scored into validation stats
    session: str = ""  # the buffer process's session: a new one means it restarted
    drops_from: int = 0  # where ``dropped`` starts in the session's drop log
    validated_from: int = 0  # where ``validated`` starts in its validation log


class InventoryReply(Message, tag="inventory_reply"):
    """Training and validation task ids of every group held (complete, in the pool or in
    unacknowledged batches, or still incomplete), every group dropped unused, and every
    validation group scored, since this buffer ``session`` started."""

    session: str
    held: list[str]
    dropped: list[DroppedTask]
    validated: list[str]
    unknown: list[str] = []  # of the ids asked about: never received in this session
    # Trajectories may wait unread: the buffer is full or paused, or no read has emptied
    # its socket since reading resumed; "unknown" may be in a queue (do not re-deal).
    paused: bool = False


class ValidationReply(Message, tag="validation_reply"):
    # round key (a validation id's ``val.<lineage>/<round>``) -> validation id -> group
    by_round: dict[str, dict[str, ValidationGroup]]
    session: str = ""  # the buffer session that summed them (a restarted buffer starts at 0)


Request = (
    Hello
    | BatchRequest
    | Ack
    | StatsRequest
    | DroppedRequest
    | InventoryRequest
    | ValidationRequest
    | Shutdown
)
Reply = (
    Welcome
    | BatchHeader
    | NoBatch
    | AckReply
    | StatsReply
    | DroppedReply
    | InventoryReply
    | ValidationReply
    | Ok
    | ErrorReply
)
