"""Stand-in rollout server: pushes trajectory messages from a spec, then reports.

``python -m tests.standins.producer ENDPOINT SPEC.json [--hwm N] [--delay-s S]``. The spec is
``{"messages": [[traj, ...], ...]}``, each ``traj`` the keyword arguments of
:func:`tests.standins.trajgen.make_traj` (``task_id``, ``index``, ``size``, ``version``, ``spans``,
``response_len``, ``validation``, ``data_source``, ...). Prints one JSON line at the end:
``{"sent": messages, "blocked_s": seconds spent blocked at the high-water mark}``.
"""

from __future__ import annotations

import argparse
import json
import time

from asyncrl.net.transport import TrajectoryPusher
from tests.standins.trajgen import make_traj


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("spec")
    parser.add_argument("--hwm", type=int, default=1000)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    with open(args.spec) as f:
        messages = json.load(f)["messages"]
    pusher = TrajectoryPusher(args.endpoint, hwm=args.hwm, linger_s=30)
    for msg in messages:
        trajs = []
        for spec in msg:
            spec = dict(spec)
            if spec.get("spans") is not None:
                spec["spans"] = [tuple(s) for s in spec["spans"]]
            trajs.append(
                make_traj(spec.pop("task_id"), spec.pop("index"), spec.pop("size"), **spec)
            )
        pusher.send(trajs, timeout_s=60)
        if args.delay_s:
            time.sleep(args.delay_s)
    pusher.close()
    print(json.dumps({"sent": pusher.sent, "blocked_s": pusher.total_wait_s}), flush=True)


if __name__ == "__main__":
    main()
