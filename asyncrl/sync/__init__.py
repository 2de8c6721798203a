"""How a weight push travels from the learner to the rollout servers.

- :mod:`~asyncrl.sync.plan`: the bucket plan (sent over the wire by the coordinator);
- :mod:`~asyncrl.sync.groups`: the rendezvous store and the process groups built beside
  vLLM's and FSDP's own (gloo on CPU, NCCL on GPU), their members' meeting and release;
- :mod:`~asyncrl.sync.weights`: the send and receive of one push over such a group;
- :mod:`~asyncrl.sync.sender`: the learner's side of a sync round: pack the state dict,
  ask the coordinator to begin, broadcast, report the result.

The rollout server's receiving side (a vLLM worker extension) lives in
``rollout_servers.worker_ext`` and calls :func:`~asyncrl.sync.weights.receive_weights`.
May import :mod:`asyncrl.control` (types only); torch is imported lazily, so the plan stays
importable without it.
"""
