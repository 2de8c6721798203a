"""What every message of every socket shares: one schema version, one tagged base for
request/reply messages, one ``Ok`` and one ``ErrorReply``, one error class, one validating
decoder.

Two services answer requests: the buffer (its batch socket, :mod:`asyncrl.wire.requests`)
and the coordinator (its tasks and control sockets, :mod:`asyncrl.control.messages`). Their
messages differ; how they travel does not: one msgpack map per frame, tagged by ``kind``,
carrying ``schema`` (:data:`SCHEMA_VERSION`), decoded by msgspec's typed decoder into a
struct or refused with a :class:`WireError` whose ``kind`` says why. A service answers a
refused request with an :class:`ErrorReply` carrying that kind
(:class:`asyncrl.net.serving.RouterService` does it for both).

Imports msgspec only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

#: Version of every layout on every socket (trajectories, batches, control); decoders
#: refuse other values. Bump it on any incompatible change (an optional field whose absence
#: keeps its old meaning, like ``TrajectoryMeta.temperature``, is not one: every message an
#: older sender sends stays valid).
SCHEMA_VERSION = 1

#: Why a message was rejected. ``malformed``: not msgpack, or wrong frame structure;
#: ``schema``: another schema version; ``invalid``: a field of the wrong type, range or
#: consistency; ``length``: an array frame whose size does not match the lengths in the
#: header, or version spans that do not cover the response; ``nonfinite``: inf (or an
#: absurd magnitude) in logprobs, NaN or inf in rewards (a NaN logprob is valid: not
#: reported); ``oversize``: beyond the receiver's limits.
REJECT_KINDS = ("malformed", "schema", "invalid", "length", "nonfinite", "oversize")

#: A frame: bytes, a memoryview, a zmq.Frame or a numpy array (anything with the buffer
#: protocol).
Frame = Any


class WireError(ValueError):
    """A message that cannot be accepted; ``kind`` is one of :data:`REJECT_KINDS`;
    ``key``: the config key whose limit it broke, if one did (``data.max_response_length``),
    for a receiver's log line to name."""

    def __init__(self, kind: str, detail: str, key: str = ""):
        assert kind in REJECT_KINDS, kind
        self.kind = kind
        self.detail = detail
        self.key = key
        super().__init__(f"{kind}: {detail}")


class Message(msgspec.Struct, tag_field="kind", kw_only=True, forbid_unknown_fields=True):
    """Base of every request and reply: a map tagged by ``kind`` that carries ``schema``.

    ``schema`` defaults to this side's version, so a sender never spells it; a receiver's
    decoder refuses any other value (:func:`decode`).
    """

    schema: int = SCHEMA_VERSION

    @property
    def kind(self) -> str:
        """The message's tag on the wire (``"hello"``, ``"heartbeat"``, ...)."""
        return type(self).__struct_config__.tag  # type: ignore[return-value]


class Ok(Message, tag="ok"):
    """The request was done; there is nothing else to say."""


class ErrorReply(Message, tag="error"):
    """The request was refused; ``error`` is one of :data:`REJECT_KINDS`, or
    ``wrong_socket`` for a valid request sent to a socket that does not serve it,
    ``forbidden`` for one its sender's role may not send, ``superseded`` for a consumer's
    batch request or ack after another client said hello under its consumer id,
    ``internal`` for a request the service failed on (a bug: it logged the traceback)."""

    error: str
    detail: str

    @classmethod
    def of(cls, err: WireError) -> ErrorReply:
        """The reply that tells a client why its request was refused."""
        return cls(error=err.kind, detail=err.detail)


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """One frame: the msgpack map of the message, its ``kind`` and ``schema`` included."""
    return _encoder.encode(msg)


def check_size(frames: Sequence[Frame], limit: int, key: str) -> None:
    """Raise ``WireError("oversize")`` naming config ``key`` when ``frames`` add up to more
    than ``limit`` bytes (0: no limit). Senders check before sending, as receivers before
    decoding: a bare size would not tell a user which key to raise."""
    size = sum(nbytes(f) for f in frames)
    if limit and size > limit:
        raise WireError(
            "oversize",
            f"a message of {size / (1 << 20):.2f} MiB is over {key}={limit / (1 << 20):g}: "
            f"raise {key} in the config every role reads",
        )


def nbytes(frame: Frame) -> int:
    """Size in bytes of any buffer-protocol frame."""
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    if isinstance(frame, memoryview):  # what the buffer service reads: no second view
        return frame.nbytes
    return memoryview(frame).nbytes  # numpy arrays, zmq.Frame and other buffer objects


def single(frames: Sequence[Frame]) -> Frame:
    """The one frame of a request (a REQ socket's body after the envelope)."""
    if len(frames) != 1:
        raise WireError("malformed", f"a request is one frame, got {len(frames)}")
    return frames[0]


def decode(decoder: msgspec.msgpack.Decoder, frame: Frame, max_bytes: int | None = None) -> Any:
    """A validated message of the decoder's type, or :class:`WireError`: ``oversize`` past
    ``max_bytes``, ``malformed``, ``invalid``, or ``schema`` for another version."""
    if max_bytes is not None and (size := nbytes(frame)) > max_bytes:
        raise WireError("oversize", f"message of {size} bytes > {max_bytes}")
    try:
        msg = decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise _classify(frame, e) from None
    except Exception as e:  # e.g. invalid UTF-8 in a string: bad input all the same
        raise WireError("malformed", f"undecodable header ({type(e).__name__}: {e})") from None
    if msg.schema != SCHEMA_VERSION:
        raise WireError("schema", f"schema version {msg.schema}, this side speaks {SCHEMA_VERSION}")
    return msg


def _classify(frame: Frame, err: msgspec.DecodeError) -> WireError:
    """Why a header failed typed decoding: not msgpack, another schema, or a bad field."""
    if not isinstance(err, msgspec.ValidationError):
        return WireError("malformed", f"not a msgpack header ({err})")
    try:
        raw = msgspec.msgpack.decode(frame)
    except Exception:  # e.g. invalid UTF-8 in a key the typed decoder never reached
        return WireError("malformed", f"not a valid msgpack header ({err})")
    # A message of another schema version usually differs in shape too: say which it is.
    if isinstance(raw, dict) and "schema" in raw and raw["schema"] != SCHEMA_VERSION:
        return WireError("schema", f"schema version {raw['schema']!r} ({err})")
    return WireError("invalid", str(err))
