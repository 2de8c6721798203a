"""What the coordinator knows of each registered rollout server.

One :class:`ServerRecord` per live server, kept by :class:`~asyncrl.control.state.ControlState`
(which adds, touches and removes them) and read by
:class:`~asyncrl.control.versions.Versions` (which decides who needs weights).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from asyncrl.control.messages import TaskGrant

#: Slot grants a server's record keeps by request id, for a retry of any of them (the
#: endpoint's groups ask at once, and its reaper asks again under an old id meanwhile).
SLOT_GRANTS_KEPT = 256


@dataclass
class ServerRecord:
    server_id: str
    address: str
    engine_world_size: int
    policy_version: int  # the weights it holds (its reports and its syncs)
    order: int  # registration order: rank order in the main group
    last_seen: float
    pid: int = 0
    told_shutdown: bool = False
    syncing: int = 0  # sync id it was asked to join and has not reported on (0: none)
    last_grant: tuple[int, TaskGrant] | None = None  # (request id, grant with tasks)
    # The same for external slots, by request id: several are asked at once, and one
    # kept grant let a retry of an older id get a fresh slot, its lost one held for good.
    slot_grants: OrderedDict[int, TaskGrant] = field(default_factory=OrderedDict)
    metrics: dict[str, float] = field(default_factory=dict)  # its last heartbeat's
    catchup_failures: int = 0  # consecutive failed catch-ups
    catchup_after: float = 0.0  # no catch-up is started before this time (backoff)
    # A round whose send failed closed before its report: it may still wait in that
    # round's receive (until its own sync.timeout_s). No catch-up before its report or then.
    receiving_until: float = 0.0
    # It registered with weights partly loaded (a sync broke off mid-load): they are no
    # version's, whatever it reports, until a sync of this session loads them whole.
    weights_partial: bool = False
    _trusted: bool = field(default=False, repr=False)

    @property
    def trusted(self) -> bool:
        """Its weights are known to be this learner's: it started from the initial
        checkpoint of a fresh run, or received a sync in this session. A server that
        registers after a learner restart may hold weights the restored learner never had
        (a version from after the checkpoint): it gets a catch-up whatever version it
        reports. Partly loaded weights are never trusted, whatever the replay's rules set
        (:meth:`~asyncrl.control.versions.Versions.set_replay`)."""
        return self._trusted and not self.weights_partial

    @trusted.setter
    def trusted(self, value: bool) -> None:
        self._trusted = value
