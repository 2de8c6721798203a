"""The launcher's side of each role's Ray agent (:mod:`asyncrl.launch.ray_agent`): what it
knows of the agent (:class:`Agent`), the copying back of files that grow on the agent's
node (:class:`Mirror`, which the next launch of the run goes on from), and what a failed
call to the agent means (:func:`slow_answer`).

A call that only took too long is asked again at the next poll: the agent may still run
its role, and replacing it then would run the role twice. An agent is lost after
:data:`SLOW_POLLS` unanswered polls in a row, or at once when Ray says it died; the
launcher then kills it all the same (its watchdog takes the role's tree with it), so that
the role restarted in a new agent never runs beside its old copy.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.metrics import set_aside

log = logging.getLogger("asyncrl.launch")

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
    on where the last one stopped instead of copying the files again; and it keeps how far
    each got in the run directory (:meth:`record`, :data:`RECORD_FILE`), so that a later
    launch of the run goes on from there too (:meth:`resume`)."""

    def __init__(self, run_dir: Path, files: tuple[str, ...]):
        self.run_dir = run_dir
        self.offsets = dict.fromkeys(files, 0)
        # Each local copy's size right after this mirror's last copy into it (see resume).
        self.sizes = dict.fromkeys(files, 0)
        self.inodes = dict.fromkeys(files, 0)  # of each node file read (0: not yet)

    def pull(self, read: Any) -> None:
        """Append what each node file gained (``read(rel, offset, inode) -> (inode, start,
        data)``, :meth:`~asyncrl.launch.ray_agent.RoleAgent.read`). A node file replaced
        since (the learner set ``metrics.jsonl`` aside for a run begun afresh) sets the
        local copy aside too, and is copied whole; records (``.jsonl``) are copied whole
        lines only, since a resumed learner cuts a half-written last one (a file cut
        shorter all the same is cut here by as much). Appended blindly, the local copy mixed
        two runs' records and took the new file's bytes from the middle of a line."""
        for rel, offset in list(self.offsets.items()):
            inode, start, data = read(rel, offset, self.inodes[rel])
            path = self.run_dir / rel
            if start < offset:
                if start == 0 and inode != self.inodes[rel]:
                    set_aside(path)
                    log.info("%s was begun afresh on its node: copied again from its start", rel)
                    self.sizes[rel] = 0
                elif path.exists():
                    self.sizes[rel] = max(0, self.sizes[rel] - (offset - start))
                    os.truncate(path, min(self.sizes[rel], path.stat().st_size))
                self.offsets[rel] = start
            self.inodes[rel] = inode or self.inodes[rel]
            if rel.endswith(".jsonl"):  # whole records only: a half-written one may be cut
                data = data[: data.rfind(b"\n") + 1]
            if data:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "ab") as f:
                    f.write(data)
                    self.sizes[rel] = f.tell()
                self.offsets[rel] = start + len(data)

    def record(self) -> dict[str, list[int]]:
        """How far each file was copied: ``rel -> [bytes read on the node, local size]``."""
        return {rel: [self.offsets[rel], self.sizes[rel]] for rel in self.offsets}

    def resume(self, record: dict[str, list[int]], per_launch: tuple[str, ...] = ()) -> None:
        """Go on from an earlier launch's :meth:`record` rather than from the start of the
        node's files, which would append every earlier record a second time. A local copy
        shorter now than after that copy was set aside or begun afresh since (the launcher
        sets ``metrics.jsonl`` aside when it sees no checkpoint, as for a learner on another
        node): its node's file is copied whole again. ``per_launch`` files are begun afresh
        by every launch, so what their node's copy held before belongs to an earlier one."""
        for rel, (offset, size) in record.items():
            if rel not in self.offsets:
                continue
            local = self.run_dir / rel
            if local.exists() and local.stat().st_size >= size:
                self.offsets[rel], self.sizes[rel] = offset, size
            elif rel in per_launch:
                self.offsets[rel] = offset


#: What the mirrors of a launch copied from each role's node, by ``<role>@<host name>/<ip>``
#: (:meth:`Mirror.record`), for the next launch of the run (a node's disk outlives its Ray
#: node id: a cluster started again gives the node a new one).
RECORD_FILE = ".mirrored.json"


def read_record(run_dir: Path) -> dict[str, dict[str, list[int]]]:
    """The :data:`RECORD_FILE` an earlier launch of the run left ({} when none, or when it
    cannot be read: the nodes' files are then copied whole, as by a first launch)."""
    try:
        record = json.loads((run_dir / RECORD_FILE).read_text())
    except (OSError, ValueError) as e:
        log.debug("no record of an earlier launch's copies: %s", e)
        return {}
    return record if isinstance(record, dict) else {}


def write_record(run_dir: Path, record: dict[str, dict[str, list[int]]]) -> None:
    """Replace :data:`RECORD_FILE` with ``record`` (written after the copies it counts: a
    launcher killed in between has a next launch copy those lines again, never lose them)."""
    tmp = run_dir / f"{RECORD_FILE}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, run_dir / RECORD_FILE)


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
