"""Running user code that may hang or crash: reward functions and agent tools.

- :mod:`~asyncrl.sandbox.workers`: killable worker processes with a per-job timeout and
  an optional memory cap (:class:`~asyncrl.sandbox.workers.WorkerPool`), the base of both
  the reward pool (:mod:`asyncrl.rewards`) and the tool pool (:mod:`asyncrl.tools`);
- :mod:`~asyncrl.sandbox.process`: one worker process, its protocol and its lifetime;
- :mod:`~asyncrl.sandbox.memory`: a worker's memory cap;
- :mod:`~asyncrl.sandbox.output`: the bound on what a worker writes to stdout and stderr;
- :mod:`~asyncrl.sandbox.pyfile`: importing a user's Python file by its path;
- :mod:`~asyncrl.sandbox.proc_table`: the process table and a process's descendants (a
  worker's killed with it; the launcher finds a role's tree with it too).

Standard library only: it may import nothing else from the project (its modules import
each other).
"""

from asyncrl.sandbox.memory import MemoryCap
from asyncrl.sandbox.workers import WorkerPool

__all__ = ["MemoryCap", "WorkerPool"]
