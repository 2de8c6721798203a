"""Who may ask what: the requests each role's key may send to each service.

With ``endpoints.auth: curve`` every connection to a served socket carries the role of the
key it presented (:mod:`asyncrl.net.security` records it); a service checks each request
against its :class:`Policy` before acting on it (:class:`asyncrl.net.serving.RouterService`).
Authority follows what each role does in a run (docs/DESIGN.md section 11):

- the **learner** key is the run's own: learner rank 0 consumes batches, and the
  coordinator inside it drains the buffer's dropped tasks, takes its inventory and stops
  it; whatever acts for the whole run (ending it, speaking for a server it reaped) uses it
  too. It may send every request.
- the **rollout** key sits on nodes that run model-driven tools and user reward code, so
  it holds the least: a rollout server's own requests to the coordinator (tasks, acks,
  registration, heartbeats, slots, sync reports, leaving) and pushing trajectories. It may
  not ask the buffer for anything, nor end the run.
- the **buffer** key serves; the buffer asks no one anything, so it may send nothing.

The buffer's trajectory socket (a PULL, no requests) takes any of the run's keys.
Without CURVE a connection has no role and every request is served, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The buffer's batch socket (asyncrl.wire.requests), by tag.
BUFFER_REQUESTS = frozenset(
    {"hello", "batch_request", "ack", "stats", "dropped", "inventory", "validation", "shutdown"}
)
# What a rollout server sends the coordinator (asyncrl.control.messages), by tag.
SERVER_REQUESTS = frozenset(
    {
        "task_request",
        "task_ack",
        "task_nack",
        "slot_request",
        "register",
        "heartbeat",
        "sync_done",
        "leave",
    }
)
# Everything the coordinator's task and control sockets serve.
COORDINATOR_REQUESTS = SERVER_REQUESTS | {"shutdown"}


@dataclass(frozen=True)
class Policy:
    """The request kinds (wire tags) each role may send to one service; a role not listed
    may send nothing there."""

    service: str  # how refusals name it: "the buffer's batch socket"
    allowed: Mapping[str, frozenset[str]]

    def permits(self, role: str | None, kind: str) -> bool:
        """Whether a request of ``kind`` from a connection of ``role`` is served (None: no
        authentication on this socket, so no role to check)."""
        return role is None or kind in self.allowed.get(role, frozenset())

    def refusal(self, role: str, kind: str) -> str:
        """One line for the refused client: who it is, what it asked, and the way out."""
        holders = sorted(r for r, kinds in self.allowed.items() if kind in kinds)
        who = f"the {role} key" if role else "a connection without a role"
        fix = (
            f"send it from a process holding the {' or '.join(holders)} key"
            if holders
            else "no role may send it here"
        )
        return f"{who} may not send {kind} to {self.service}: {fix}"


BUFFER = Policy("the buffer's batch socket", {"learner": BUFFER_REQUESTS})
COORDINATOR = Policy(
    "the coordinator", {"learner": COORDINATOR_REQUESTS, "rollout": SERVER_REQUESTS}
)
