"""The launcher's side of each role's Ray agent (:mod:`asyncrl.launch.ray_agent`): what it
knows of the agent (:class:`Agent`), the copying back of files that grow on the agent's
node (:class:`Mirror`), and what a failed call to the agent means (:func:`slow_answer`).

A call that only took too long is asked again at the next poll: the agent may still run
its role, and replacing it then would run the role twice. An agent is lost after
:data:`SLOW_POLLS` unanswered polls in a row, or at once when Ray says it died; the
launcher then kills it all the same (its watchdog takes the role's tree with it), so that
the role restarted in a new agent never runs beside its old copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLOW_POLLS = 3  # unanswered polls in a row (each up to CALL_TIMEOUT_S) before it is lost


def slow_answer(error: BaseException) -> bool:
    """Whether a failed call to an agent only found it slow: Ray's timeout, or an actor
    Ray says is unavailable for now (a network blip), rather than dead."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError

    return isinstance(error, GetTimeoutError | ActorUnavailableError)


class NotOnNode(Exception):
    """Raised by an agent's ``start``: the role's command or working directory does not
    exist on its node (every node needs the launcher's interpreter path and checkout)."""


def not_on_node(error: BaseException) -> str | None:
    """The agent's one line if ``error`` is its :class:`NotOnNode` (as Ray raises it: a
    task error whose ``cause`` it is), else None."""
    for e in (getattr(error, "cause", None), error):
        if isinstance(e, NotOnNode):
            return str(e.args[0]) if e.args else type(e).__name__
    return None


class Mirror:
    """Copies files that grow on a role's node into the launcher's run directory: each
    call appends what is new (``read(rel, offset) -> bytes`` reads the node's copy). The
    launcher keeps one per role and node, so that a replaced agent on the same node goes
    on where the last one stopped instead of copying the files again."""

    def __init__(self, run_dir: Path, files: tuple[str, ...]):
        self.run_dir = run_dir
        self.offsets = dict.fromkeys(files, 0)

    def pull(self, read: Any) -> None:
        for rel, offset in self.offsets.items():
            data = read(rel, offset)
            if data:
                path = self.run_dir / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "ab") as f:
                    f.write(data)
                self.offsets[rel] = offset + len(data)


@dataclass
class Agent:
    """The launcher's view of one role's agent."""

    handle: Any
    pending: Any = None  # the ObjectRef of a start call not answered yet
    since: float = 0.0  # when that call was made
    pid: int | None = None  # the role's pid on its node while it runs
    where: dict[str, Any] | None = None
    mirror: Mirror | None = None  # None: the node shares the launcher's run directory
    slow: int = 0  # polls in a row it did not answer in time
