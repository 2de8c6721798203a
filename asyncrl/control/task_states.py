"""The states a task id moves through in the coordinator's ledger, and its entry.

Each task id the run ever dealt has exactly one *state*, per kind (train or val):

``in_flight``
    outstanding at a server (dealt, not yet acknowledged), or *queued* to be dealt again
    under the same id (its server died, left, failed it or held it too long);
``in_buffer``
    acknowledged: its server handed the whole group to the buffer;
``trained`` (validation: ``scored``)
    the learner trained on a batch holding it (the buffer scored it into validation);
``dropped/<reason>``
    the buffer threw it away unused (``lag``, ``expired``; ``duplicate``: its group came
    when the buffer had already used and forgotten a group of that id), or its server
    did (``filtered``: its members all scored alike, ``algorithm.filter_groups``), or the
    coordinator did before dealing it (``oversize``: too large for any grant under
    ``control.max_message_mb``, :mod:`asyncrl.control.grant_size`);
``given_up``
    it failed (or timed out) more than ``task_retries`` times.

An *external* slot (``ext/<session>/<n>``, dealt by
:meth:`asyncrl.control.ledger.TaskLedger.deal_external`) is a training task whose
prompt comes from outside the run (an agent behind a server's OpenAI-compatible endpoint).
It is charged like any training task, but it cannot be dealt again: what would fail it
(its server died, it timed out, the buffer lost it) gives it up instead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from asyncrl.control.messages import Task

if TYPE_CHECKING:
    from asyncrl.control.task_source import TaskSource

OUT, QUEUED, BUF, DONE, GIVEN_UP = "out", "queued", "in_buffer", "done", "given_up"
DROP_REASONS = (
    "lag",
    "expired",
    "duplicate",
    "filtered",
    "prompt_too_long",
    "oversize",
    "overflow",
    "invalid",
)
STATES = (OUT, QUEUED, BUF, DONE, GIVEN_UP, *(f"dropped/{r}" for r in DROP_REASONS))
TERMINAL = frozenset({DONE, GIVEN_UP, *(f"dropped/{r}" for r in DROP_REASONS)})
CHARGED = frozenset({OUT, BUF, DONE})
KINDS = ("train", "val")
#: Tallied apart as well: external slots (the OpenAI endpoint's groups), a part of ``train``.
TALLIES = (*KINDS, "external")


EXTERNAL = "ext/"


def kind_of(task_id: str) -> str:
    """``val`` for a validation task id (``val/...`` or ``val.<lineage>/...``), else
    ``train``."""
    return "val" if task_id.startswith(("val/", "val.")) else "train"


def is_external(task_id: str) -> bool:
    return task_id.startswith(EXTERNAL)


def external_id(session: str, serial: int) -> str:
    """The id of the ``serial``-th external slot a coordinator incarnation (``session``)
    dealt: unique across restarts, since every incarnation has its own session."""
    return f"{EXTERNAL}{session}/{serial}" if session else f"{EXTERNAL}{serial}"


def well_formed_external(task_id: str) -> bool:
    """Whether ``task_id`` has the shape of an external slot id (``ext/<n>`` or
    ``ext/<session>/<n>``): a registering server cannot make the ledger adopt anything
    else as a slot."""
    parts = task_id.split("/")
    if parts[0] != EXTERNAL.rstrip("/") or len(parts) not in (2, 3):
        return False
    session_ok = len(parts) == 2 or (0 < len(parts[1]) <= 16 and parts[1].isalnum())
    return session_ok and parts[-1].isdigit() and len(parts[-1]) <= 12


def external_task(task_id: str, version: int) -> Task:
    """The task of an external slot: no prompt, no ground truth (the agent brings both)."""
    return Task(
        task_id=task_id,
        data_source="external",
        prompt=[],
        ground_truth=None,
        n=1,
        agent_name="external",
        dealt_version=version,
    )


class Drops(NamedTuple):
    """What one report of dropped groups did."""

    refunded: int  # training tasks that left the admission budget
    given_up: int  # training prompts out of lag retries (never dealt again)
    overflowed: int = 0  # training groups the buffer had no room for (dealt again)
    overflow_given_up: int = 0  # the same, out of retries (never dealt again)


@dataclass
class Entry:
    state: str
    task: Task | None  # None once terminal (nothing left to deal)
    server: str = ""  # holder while OUT; after, the server that delivered it
    since: float = 0.0  # when dealt (OUT) or acknowledged (BUF)
    failures: int = 0  # failed or timed-out deals so far
    serial: int = 0  # order of the last deal
    # Held by a server that named it at a registration (an earlier coordinator session's
    # deal, or one since given up on it): its attempt there is the server's, not this
    # entry's, so its failure report is taken whatever attempt it names.
    adopted: bool = False


def restored(
    tid: str, state: str, attempt: int, source: TaskSource, version: int
) -> tuple[str, Task | None]:
    """The state and task of ``tid`` restored from a checkpoint that saw it ``state``: a
    task outstanding then is queued (its server belonged to the old session; one that
    still holds it takes it back when it registers). An external one is queued too, but
    never dealt: only its server, which holds its agent's session, can take it back."""
    if state in TERMINAL:
        return state, None
    if is_external(tid):
        return (QUEUED if state == OUT else state), external_task(tid, version)
    task = source.task_for_id(tid, version)
    task = msgspec.structs.replace(task, attempt=attempt + (state == OUT))
    return (QUEUED if state == OUT else state), task


def accounting(tally: dict[str, Counter[str]], dealt: Counter[str]) -> dict[str, float]:
    """``accounting/<kind>/...``: how many ids were dealt and in which state each is now."""
    out: dict[str, float] = {}
    for kind in TALLIES:
        if kind == "external" and not dealt[kind]:
            continue  # a run without the endpoint says nothing of it
        t, p = tally[kind], f"accounting/{kind}"
        parts = {
            "in_flight": t[OUT] + t[QUEUED],
            "in_buffer": t[BUF],
            "scored" if kind == "val" else "trained": t[DONE],
            **{f"dropped/{r}": t[f"dropped/{r}"] for r in DROP_REASONS},
            "given_up": t[GIVEN_UP],
        }
        out[f"{p}/dealt"] = float(dealt[kind])
        out |= {f"{p}/{k}": float(v) for k, v in parts.items()}
        out[f"{p}/unaccounted"] = float(dealt[kind] - sum(parts.values()))
    return out
