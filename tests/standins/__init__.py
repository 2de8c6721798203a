"""Stand-in peers for tests and benchmarks: small, real processes that play a role without
its heavy engine (no vLLM, no training loop), so a protocol can be tested alone.

- :mod:`.learner`: learner rank 0 without training (the coordinator, the sync store, the
  learner's own weight sender), a run config on free loopback ports, the buffer as a process;
- :mod:`.rollout`: a rollout server process that answers every task with a fixed response;
- :mod:`.weights`: a weight receiver process holding an HF model (no vLLM);
- :mod:`.producer` / :mod:`.consumer`: a trajectory producer and a batch consumer for the
  buffer, started by :mod:`.harness`; :mod:`.trajgen` makes their trajectories.

Each process runs as ``python -m tests.standins.<module>`` with the repository root on
``PYTHONPATH`` (:func:`.harness.standin_env`); benchmarks import them the same way.

Two modules hold in-process stand-ins instead: :mod:`.chat` (a character tokenizer with a
chat template) and :mod:`.server_parts` (a rollout server's collaborators: engine,
tokenizer, scorer, pusher and control client, and a slow tool for episodes).
"""
