"""asyncrl: asynchronous, off-policy, disaggregated RL for LLMs.

This package holds what several processes share, one sub-package per concern:
:mod:`asyncrl.config` (the run config), :mod:`asyncrl.control` (the coordinator),
:mod:`asyncrl.net` (sockets, keys, authority), :mod:`asyncrl.sync` (weight pushes),
:mod:`asyncrl.launch` (launchers and supervision), :mod:`asyncrl.wire` (the buffer's
messages), :mod:`asyncrl.tasks`, :mod:`asyncrl.rewards`, :mod:`asyncrl.tools`,
:mod:`asyncrl.sandbox` (user code in killable workers) and :mod:`asyncrl.prepare` (local
models and data); at the top only :mod:`asyncrl.cli` and :mod:`asyncrl.metrics`. It imports
none of the role packages. Importing it must stay light: no torch and no vLLM at import
time, so the buffer process stays small.
"""

__version__ = "0.1.0"
