"""Wire types and codec: what rollout servers, the buffer and the learner send each other.

Importing this package pulls in msgspec and numpy only (no torch, no vLLM, no zmq).

Trajectory message (rollout server -> buffer, ZeroMQ PUSH/PULL, one multipart message)
---------------------------------------------------------------------------------------
Always four frames: a msgpack map, then three raw arrays, each the concatenation over the
message's trajectories in the header's order::

    frame 0   {"kind": "trajectories", "schema": 1, "trajectories": [meta, ...]}
    frame 1   prompt token ids     int32 little-endian, sum of prompt_len
    frame 2   response token ids   int32 little-endian, sum of response_len
    frame 3   behaviour logprobs   float32 little-endian, sum of response_len; NaN where
                                   the engine reported none (the learner drops the token)

(Three frames per message rather than per trajectory: ZeroMQ's cost is per frame.)

Each ``meta`` is a map with the fields of :class:`TrajectoryMeta`: required ``task_id``
(str), ``group_index``, ``group_size``, ``prompt_len``, ``response_len`` (ints),
``version_spans`` (list of ``[policy_version, n_tokens]`` pairs covering the response in
order; the oldest version sets the lag), ``reward`` (float); optional ``reward_parts`` (map
str -> float), ``finish_reason`` (str), ``validation`` (bool), ``data_source`` and
``server_id`` (str), ``created_at`` and ``finished_at`` (float seconds, wall clock),
``temperature`` (float >= 0: what the response was sampled at; without it the learner uses
its configured temperature). Unknown keys are rejected. ``version_spans`` are in generation order, so versions never
decrease along them; a trajectory's lag is the learner's version minus its first span's
version. A message may carry one trajectory or a whole group (cheapest); the buffer
assembles groups by ``task_id`` either way.

In Python, :func:`encode_trajectories` builds these frames from :class:`Trajectory` objects
(:meth:`Trajectory.build` makes one from lists or arrays) and
:class:`asyncrl.net.transport.TrajectoryPusher` sends them. Decoding yields a :class:`Packed`
(the metas and the three arrays, as views of the frames) whose ``trajectories`` are
per-trajectory views; a :class:`Group` and a :class:`Batch`'s groups are packed the same
way, so a learner can build padded or packed tensors from whole arrays.

A client that has only ``msgpack`` and ``numpy`` (or any language with msgpack and raw
little-endian arrays) produces a valid message like this::

    import msgpack, numpy as np, zmq
    push = zmq.Context().socket(zmq.PUSH)
    push.connect("tcp://127.0.0.1:5552")          # endpoints.trajectories
    meta = {"task_id": "t-1", "group_index": 0, "group_size": 1, "prompt_len": 3,
            "response_len": 2, "version_spans": [[0, 2]], "reward": 1.0}
    header = msgpack.packb({"kind": "trajectories", "schema": 1, "trajectories": [meta]})
    push.send_multipart([
        header,
        np.array([5, 6, 7], dtype="<i4").tobytes(),
        np.array([8, 9], dtype="<i4").tobytes(),
        np.array([-0.1, -2.3], dtype="<f4").tobytes(),
    ])

Integers are accepted where floats are expected. Only msgpack and raw arrays travel:
decoding uses msgspec's typed msgpack decoder, which checks every field, then the frames
are checked against the header (:mod:`asyncrl.wire.codec`; :data:`REJECT_KINDS` lists
what a receiver refuses).

Batch socket (consumer <-> buffer, REQ -> ROUTER)
-------------------------------------------------
Requests are single-frame msgpack maps tagged by ``kind`` (:data:`Request`): ``hello``
(the READY handshake and session start), ``batch_request`` (carries the learner's
``policy_version``), ``ack`` (batch ids), ``stats``, ``dropped``, ``validation``,
``shutdown``. Replies (:data:`Reply`) are single frames too, except ``batch``: a
:class:`BatchHeader` followed by the three concatenated array frames, laid out as above.
"""

from asyncrl.wire.base import (
    REJECT_KINDS,
    SCHEMA_VERSION,
    ErrorReply,
    Frame,
    Message,
    Ok,
    WireError,
    nbytes,
)
from asyncrl.wire.codec import (
    DEFAULT_LIMITS,
    Limits,
    NamedTask,
    decode_packed,
    decode_reply,
    decode_request,
    decode_trajectories,
    encode_batch,
    encode_packed,
    encode_reply,
    encode_request,
    encode_trajectories,
    named_tasks,
)
from asyncrl.wire.requests import (
    Ack,
    AckReply,
    BatchHeader,
    BatchRequest,
    DroppedReply,
    DroppedRequest,
    DroppedTask,
    Hello,
    InventoryReply,
    InventoryRequest,
    NoBatch,
    Reply,
    Request,
    Shutdown,
    StatsReply,
    StatsRequest,
    ValidationGroup,
    ValidationReply,
    ValidationRequest,
    ValidationStats,
    Welcome,
)
from asyncrl.wire.types import (
    LOGPROB_DTYPE,
    MAX_ABS_REWARD,
    MAX_VERSION,
    TOKEN_DTYPE,
    Batch,
    Group,
    Packed,
    TrajectoriesHeader,
    Trajectory,
    TrajectoryMeta,
)

__all__ = [
    "DEFAULT_LIMITS",
    "LOGPROB_DTYPE",
    "MAX_ABS_REWARD",
    "MAX_VERSION",
    "REJECT_KINDS",
    "SCHEMA_VERSION",
    "TOKEN_DTYPE",
    "Ack",
    "AckReply",
    "Batch",
    "BatchHeader",
    "BatchRequest",
    "DroppedReply",
    "DroppedRequest",
    "DroppedTask",
    "ErrorReply",
    "Frame",
    "Group",
    "Hello",
    "InventoryReply",
    "InventoryRequest",
    "Limits",
    "Message",
    "NamedTask",
    "NoBatch",
    "Ok",
    "Packed",
    "Reply",
    "Request",
    "Shutdown",
    "StatsReply",
    "StatsRequest",
    "TrajectoriesHeader",
    "Trajectory",
    "TrajectoryMeta",
    "ValidationGroup",
    "ValidationReply",
    "ValidationRequest",
    "ValidationStats",
    "Welcome",
    "WireError",
    "decode_packed",
    "decode_reply",
    "decode_request",
    "decode_trajectories",
    "encode_batch",
    "encode_packed",
    "encode_reply",
    "encode_request",
    "encode_trajectories",
    "named_tasks",
    "nbytes",
]
