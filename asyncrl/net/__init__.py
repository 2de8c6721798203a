"""The network between roles: sockets, request/reply, keys and who may ask what.

- :mod:`~asyncrl.net.transport`: ZeroMQ sockets with the project's defaults, the
  trajectory pusher/puller, and :class:`~asyncrl.net.transport.ReqClient` (the asking
  side of request/reply, with timeouts and retries);
- :mod:`~asyncrl.net.serving`: the answering side, a ROUTER service that refuses bad or
  forbidden requests and holds long-polls (the buffer and the coordinator use it);
- :mod:`~asyncrl.net.security`: ``endpoints.auth: curve``, per-role keys, and what each
  connection's key says about its role;
- :mod:`~asyncrl.net.authority`: which requests each role's key may send to each service.

May import :mod:`asyncrl.wire` and :mod:`asyncrl.config`; nothing above them (no control
plane, no launcher, no role package), no torch.
"""
