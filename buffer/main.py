"""``asyncrl-buffer CONFIG [overrides]``: the replay buffer service.

Reads ``data``, ``staleness``, ``buffer``, ``endpoints`` and ``trainer``; binds the
trajectory and batch sockets; serves until SIGTERM, SIGINT or a ``shutdown`` request, then
exits 0.
"""

from __future__ import annotations

import signal

from asyncrl.cli import parse_role_args

GROUPS = ("data", "staleness", "buffer", "control", "endpoints", "trainer")  # what it reads


def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_role_args(
        "asyncrl-buffer", "Hold complete groups and release training batches.", GROUPS, argv
    )
    from asyncrl.config import run_dir
    from asyncrl.launch import startup
    from asyncrl.net import security
    from asyncrl.net.taken import endpoint_listens, exit_if_taken, exit_unless_free
    from buffer.memory import collect_on_schedule, reuse_freed_memory
    from buffer.service import BufferService  # after the config is known to be good

    reuse_freed_memory()
    collect_every_s = collect_on_schedule()
    security.configure(cfg.endpoints, "buffer")

    startup.mark(run_dir(cfg), "buffer", "started")
    listens = endpoint_listens(cfg.endpoints, "trajectories", "batches")
    # A failed bind of the batches socket leaves the service waiting on zmq for good.
    exit_unless_free("buffer", listens)
    service = BufferService.from_config(cfg, collect_every_s=collect_every_s)
    startup.mark(run_dir(cfg), "buffer", "ready")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.request_stop())
    with exit_if_taken("buffer", listens):  # taken since the check above
        service.run()  # binds both first
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
