"""What the Ray launcher copies back from nodes that do not share its run directory
(:class:`NodeCopies`): one :class:`~asyncrl.launch.ray_handles.Mirror` per role and node, so
that a replaced agent on the same node goes on from what was copied, and the record of how
far each got (:func:`~asyncrl.launch.ray_handles.write_record`), which the next launch of
the run goes on from. :class:`~asyncrl.launch.ray_launcher.RaySupervisor` asks for a role's
mirror once its agent says where it runs, and pulls it at each look, and once more as the
role is seen to exit or is stopped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from asyncrl.launch.ray_handles import Mirror, read_record, write_record

log = logging.getLogger("asyncrl.launch")

MIRRORED = ("metrics.jsonl", "startup.jsonl")  # the learner's records the view reads
PER_LAUNCH = ("startup.jsonl",)  # begun afresh by every launch (asyncrl.launch.startup)


class NodeCopies:
    """The mirrors of one launch, and the record of what they and earlier launches of the
    run copied back."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        # What was copied back from each role's node, by "<role>@<host name>/<ip>": a replaced
        # agent there goes on from it, and so does the next launch (see mirror).
        self.mirrors: dict[str, Mirror] = {}
        self.copied = read_record(self.run_dir)  # what earlier launches copied
        self.record_failed = False  # said once: its file could not be written

    def mirror(self, name: str, host: str) -> Mirror:
        """What copies back ``name``'s files on the node ``host``: the one an earlier
        agent there used, else a new one going on from what an earlier launch of the run
        copied (a resumed run's node files hold its earlier launches' records too)."""
        key = f"{name}@{host}"
        if key not in self.mirrors:
            files = (f"logs/{name}.log",) + (MIRRORED if name == "learner" else ())
            mirror = Mirror(self.run_dir, files)
            mirror.resume(self.copied.get(key, {}), PER_LAUNCH)
            self.mirrors[key] = mirror
        return self.mirrors[key]

    def pull(self, mirror: Mirror, read: Any) -> None:
        """Copy back what grew in ``mirror``'s files (``read`` as for :meth:`Mirror.pull`),
        and record how far every mirror got, for the next launch of the run."""
        before = mirror.record()
        try:
            mirror.pull(read)
        except Exception as e:  # a lost node is noticed by RaySupervisor._look_at
            log.debug("mirroring: %s", e)
        if mirror.record() != before:  # kept for the next launch of the run
            self.copied.update({key: m.record() for key, m in self.mirrors.items()})
            try:
                write_record(self.run_dir, self.copied)
            except OSError as e:  # the next launch copies these lines again: never fatal
                if not self.record_failed:
                    log.warning("the record of what was copied back is not written: %s", e)
                self.record_failed = True
