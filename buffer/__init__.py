"""The replay buffer role: complete groups in, training batches out (no torch, no vLLM).

- :mod:`buffer.core`: the buffer as a plain data structure (:class:`~buffer.core.ReplayBuffer`):
  the pool, batches and their acknowledgements, the lag filter, capacity and eviction; its
  records are :mod:`buffer.state` and :mod:`buffer.deliveries`, its reports to the
  coordinator :mod:`buffer.reports`, the FIFO order :mod:`buffer.release_order`;
- :mod:`buffer.assembly`: trajectories into complete groups (duplicates, late members,
  expiry of incomplete groups);
- :mod:`buffer.service`: the buffer behind its two sockets (the loop, backpressure, its
  thread), with :mod:`buffer.service_stats`; :mod:`buffer.answers`: what each request on
  the batch socket is answered;
- :mod:`buffer.main`: the ``asyncrl-buffer`` command; :mod:`buffer.memory`: its process's
  memory settings; :mod:`buffer.rollout_log`: the optional parquet log of trajectories.
"""
