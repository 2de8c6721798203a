"""The control plane: the coordinator and the client that rollout servers use.

The coordinator (hosted by learner rank 0, runnable alone) deals tasks under the staleness
budget, registers rollout servers and watches their heartbeats, announces policy versions,
orchestrates weight syncs and ends the run (docs/DESIGN.md sections 1, 4 and 6).

Modules, from pure rules to I/O:

- :mod:`~asyncrl.control.messages`: the typed msgpack messages of both sockets;
- :mod:`~asyncrl.control.admission`: the admission rule and the budget;
- :mod:`~asyncrl.control.task_source`: the dataset cursor (epochs, validation rounds);
- :mod:`~asyncrl.control.task_states`: the states a task id moves through (and external
  slots, the OpenAI endpoint's groups);
- :mod:`~asyncrl.control.ledger`: deals, acknowledgements, re-deals, refunds (its
  checkpoint format, functions over it, in :mod:`~asyncrl.control.ledger_checkpoint`;
  what it takes back after a restart, servers' tasks and the buffer's inventory, in
  :mod:`~asyncrl.control.ledger_recovery`);
- :mod:`~asyncrl.control.registry`: what is known of each registered server;
- :mod:`~asyncrl.control.syncs`: sync rounds, group generations, catch-ups;
- :mod:`~asyncrl.control.versions`: policy versions, who needs a catch-up, backoff
  (:class:`~asyncrl.control.versions.Versions`, an object the state holds);
- :mod:`~asyncrl.control.validation_schedule`: when validation rounds start, and how many
  have (:class:`~asyncrl.control.validation_schedule.ValidationSchedule`, another);
- :mod:`~asyncrl.control.state`: the registry and everything above, without sockets;
- :mod:`~asyncrl.control.loop` and :mod:`~asyncrl.control.coordinator`: the service;
- :mod:`~asyncrl.control.client`: :class:`CoordinatorClient`, a rollout server's side;
- :mod:`~asyncrl.control.setup`: building it all from a run config.

May import :mod:`asyncrl.config`, :mod:`asyncrl.wire`, :mod:`asyncrl.net` and the plan of
:mod:`asyncrl.sync.weights`; never a role package or the launcher. Importing this package loads zmq, msgspec and numpy, never torch or vLLM (the weight
transfer itself lives in :mod:`asyncrl.sync.weights`, which imports torch lazily).
"""

from asyncrl.control.admission import Budget, budget_limit, grantable, groups_per_version
from asyncrl.control.client import CoordinatorClient, CoordinatorGone
from asyncrl.control.coordinator import Coordinator
from asyncrl.control.messages import SCHEMA_VERSION, Announcement, Registered, SyncStart, Task
from asyncrl.control.setup import coordinator_from_config, state_from_config
from asyncrl.control.state import ControlState
from asyncrl.control.syncs import SyncResult, SyncRound
from asyncrl.control.task_source import TaskSource
from asyncrl.control.validation_schedule import ValidationProgress

__all__ = [
    "SCHEMA_VERSION",
    "Announcement",
    "Budget",
    "ControlState",
    "Coordinator",
    "CoordinatorClient",
    "CoordinatorGone",
    "Registered",
    "SyncResult",
    "SyncRound",
    "SyncStart",
    "Task",
    "TaskSource",
    "ValidationProgress",
    "budget_limit",
    "coordinator_from_config",
    "grantable",
    "groups_per_version",
    "state_from_config",
]
