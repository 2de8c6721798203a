"""Stand-in learner: hosts the coordinator and the sync store as learner rank 0 does, and
pushes weights through the real sync protocol, without training. Also the small test
harness around it: a config on free loopback ports (:func:`loopback_config`), and the buffer
service as a real process (:func:`spawn_buffer`).

A test harness drives it by hand::

    learner = StandInLearner(cfg, tensors=random_weights(0)).start()
    learner.coordinator.trained(ids)  # what the learner trained on moves the window...
    result = learner.push()           # ...at the next version, broadcast to every member
    learner.serve_catchups()          # late joiners and failed members get the weights
    learner.shutdown()                # tells every server and the buffer to stop

It sends random tensors (:func:`random_weights`) or an HF model's state dict
(``model_dir``). ``python -m tests.standins.learner CONFIG [overrides]`` runs it alone:
it pushes ``--versions`` versions ``--every-s`` seconds apart, then shuts the run down.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.control.setup import coordinator_from_config, store_host, sync_backend
from asyncrl.control.syncs import SyncResult
from asyncrl.sync.groups import open_store
from asyncrl.sync.plan import specs_of
from asyncrl.sync.sender import WeightPusher
from tests.helpers import endpoint_overrides

log = logging.getLogger("tests.standins.learner")


def loopback_config(directory: Path, overrides: Sequence[str] = ()) -> tuple[Any, Path]:
    """A run config on 127.0.0.1 with a free port per endpoint and its run directory under
    ``directory``, written as ``directory/config.yaml`` for processes to read."""
    from asyncrl.config import load_config, write_resolved

    base = ["endpoints.host=127.0.0.1", f"trainer.default_local_dir={directory}/runs"]
    cfg = load_config(None, [*base, *endpoint_overrides(), *overrides])
    return cfg, write_resolved(cfg, Path(directory))


def spawn_buffer(config_path: Path, log_path: Path | None = None) -> subprocess.Popen:
    """``asyncrl-buffer CONFIG`` as a process (its log to ``log_path``)."""
    out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    cmd = [sys.executable, "-m", "buffer.main", str(config_path)]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def random_weights(seed: int = 0) -> dict[str, Any]:
    """A few fp32 and bf16 tensors, different for every seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 64, generator=g),
        "layers.0.norm.weight": torch.randn(64, generator=g).bfloat16(),
        "layers.0.proj.weight": torch.randn(64, 128, generator=g),
        "layers.1.proj.weight": torch.randn(64, 128, generator=g).bfloat16(),
        "head.bias": torch.randn(7, generator=g),
    }


def model_weights(model_dir: str) -> dict[str, Any]:
    """The state dict of an HF causal LM (float32), as the sender holds it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {n: t.detach() for n, t in model.state_dict().items()}


class StandInLearner:
    """Learner rank 0 without training: the coordinator, the sync store, a sender."""

    def __init__(
        self,
        cfg: Config,
        *,
        tensors: dict[str, Any] | None = None,
        model_dir: str | None = None,
        **coordinator_kwargs: Any,
    ):
        self.cfg = cfg
        if tensors is None:
            tensors = model_weights(model_dir) if model_dir else random_weights(0)
        self.tensors = tensors
        self.timeout_s = cfg.sync.timeout_s
        self.store = open_store(
            store_host(cfg.endpoints.host),
            cfg.endpoints.sync_store,
            is_host=True,
            timeout_s=self.timeout_s,
        )
        self.coordinator = coordinator_from_config(cfg, **coordinator_kwargs)
        # The learner's own sender: the stand-in runs exactly the learner's side of a sync.
        self.pusher = WeightPusher(
            self.coordinator,
            self.store,
            backend=sync_backend(cfg.trainer.device),
            timeout_s=self.timeout_s,
            bucket_bytes=int(cfg.sync.bucket_mb * (1 << 20)),
            deal_at_send=cfg.staleness.deal_at_send,
        )

    def start(self) -> StandInLearner:
        self.coordinator.start()
        return self

    def set_weights(self, tensors: dict[str, Any]) -> None:
        """Replace the weights the next push sends (same names, shapes and dtypes)."""
        if specs_of(tensors) != specs_of(self.tensors):
            raise ValueError("new weights must have the same names, shapes and dtypes")
        self.tensors = tensors

    def push(self) -> SyncResult:
        """Push a new version to every member; a failure drops members, never raises."""
        return self.pusher.push(self.tensors)

    def serve_catchups(self) -> list[SyncResult]:
        """Give every server waiting for a catch-up the current weights, one at a time."""
        return self.pusher.serve_catchups(self.tensors)

    def digest(self) -> str:
        """The digest receivers report when they hold exactly these weights."""
        from tests.standins.weights import digest

        return digest(self.tensors)

    def shutdown(self, reason: str = "training done", wait_s: float = 10.0) -> bool:
        return self.coordinator.shutdown(reason, wait_s)

    def close(self) -> None:
        """Stop the coordinator (without telling anyone) and release the store."""
        self.coordinator.stop()
        self.pusher.forget()
        self.store = None


def main(argv: Sequence[str] | None = None) -> int:
    from asyncrl.cli import role_parser, setup_logging
    from asyncrl.config import ConfigError, load_config

    parser = role_parser("tests.standins.learner", "Stand-in learner: pushes weights.", None)
    parser.add_argument("--versions", type=int, default=3, help="versions to push")
    parser.add_argument("--every-s", type=float, default=5.0, help="seconds between pushes")
    parser.add_argument("--model-dir", help="push this HF model's weights (else random)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        sys.stderr.write(f"{parser.prog}: {e}\n")
        return 2
    learner = StandInLearner(cfg, model_dir=args.model_dir).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    pushed = 0
    while pushed < args.versions and not stop.wait(args.every_s):
        if learner.coordinator.shutdown_requested.is_set():
            break
        if not args.model_dir:  # a new version deserves new weights
            learner.set_weights(random_weights(pushed + 1))
        result = learner.push()
        learner.serve_catchups()
        log.info("version %d pushed: ok %s, failed %s", result.version, result.ok, result.failed)
        pushed += 1
    learner.shutdown("stand-in learner done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
