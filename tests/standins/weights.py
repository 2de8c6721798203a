"""Stand-in weight receiver: a process holding an HF model (no vLLM) that joins sync groups
and loads what the learner broadcasts, driven over a pipe by its parent.

The real receiver is the rollout server's vLLM worker extension; this one runs the same
:mod:`asyncrl.sync.groups` and :mod:`asyncrl.sync.weights` calls, so the sync protocol is tested without an engine.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from typing import Any

from asyncrl.sync.groups import form_group, open_store
from asyncrl.sync.plan import WeightPlan
from asyncrl.sync.weights import receive_weights


def _receiver_loop(conn, host: str, port: int, model_dir: str | None, timeout_s: float) -> None:
    """Consumes commands from ``conn``: ``("sync", generation, rank, world, plan, keep)``
    joins (or reuses) the group and receives one broadcast; ``("exit",)`` ends;
    ``("die",)`` exits abruptly (a crash). Produces ``("ok", received)`` or
    ``("error", message)`` per sync. Waits on the pipe and, inside a sync, on the group's
    collectives (each bounded by ``timeout_s``)."""
    import torch

    model = None
    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    store = open_store(host, port, is_host=False, timeout_s=timeout_s)
    conn.send(("ready", None))
    group, current = None, None
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            return
        if cmd[0] == "die":
            os._exit(17)
        _, generation, rank, world, plan, keep = cmd
        try:
            if generation != current:
                group = form_group(store, generation, rank, world, timeout_s=timeout_s)
                current = generation
            received = {n: t.clone() for n, t in receive_weights(group, plan, timeout_s=timeout_s)}
            if model is not None:
                model.load_state_dict(received, strict=False)
                received = {
                    n: p.detach().clone() for n, p in model.state_dict().items() if n in received
                }
            conn.send(("ok", received if keep else {n: None for n in received}))
        except Exception as e:  # report to the parent; the group is unusable after a failure
            group, current = None, None
            conn.send(("error", f"{type(e).__name__}: {e}"))


class StandInReceiver:
    """Parent-side handle of a stand-in receiver process."""

    def __init__(
        self,
        host: str,
        port: int,
        model_dir: str | None = None,
        timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
    ):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_receiver_loop, args=(child, host, port, model_dir, timeout_s), daemon=True
        )
        self.proc.start()
        status, _ = self.result(start_timeout_s)
        if status != "ready":
            self.close()
            raise RuntimeError(f"stand-in receiver did not start within {start_timeout_s}s")

    def start_sync(
        self,
        generation: str | int,
        rank: int,
        world: int,
        plan: WeightPlan,
        keep: bool = True,
    ) -> None:
        self.conn.send(("sync", generation, rank, world, plan, keep))

    def result(self, timeout_s: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout_s):
            return ("error", f"no answer within {timeout_s}s")
        return self.conn.recv()

    def kill(self) -> None:
        self.conn.send(("die",))
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):  # the child may already be gone
                self.conn.send(("exit",))
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def digest(tensors: dict[str, Any]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes (sorted by name): equal digests mean
    bit-identical tensors, so a receiver can prove what it loaded in one short string."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ProbeScorer:
    """Scores the post-sync probe (:mod:`asyncrl.sync.probe`) as a server's engine would:
    teacher-forced logprobs at temperature 1 of an HF model of ``model_dir``'s architecture
    holding the received tensors."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    def score(self, tensors: dict[str, Any]) -> list[float]:
        import torch

        from asyncrl.sync.probe import probe_ids

        self.model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        out: list[float] = []
        with torch.no_grad():
            for ids in probe_ids():
                x = torch.tensor([ids])
                logp = torch.log_softmax(self.model(x).logits[0, :-1].float(), dim=-1)
                out += logp.gather(1, x[0, 1:, None]).squeeze(1).tolist()
        return out


class EngineSender:
    """The learner's side of a sync with a real :class:`~rollout_servers.engine.RolloutEngine`
    in this process: hosts the sync store, forms group ``g1`` with the engine's worker on the
    first push, and broadcasts tensors while the engine receives them."""

    def __init__(self):
        from asyncrl.sync.groups import open_store
        from tests.helpers import free_port

        self.port = free_port()
        self.store = open_store("127.0.0.1", self.port, is_host=True, timeout_s=60)
        self.group = None

    def push(self, loop, engine, tensors: dict, version: int) -> dict:
        """Push ``tensors`` as ``version``; returns the engine's sync stats."""
        import threading

        from asyncrl.sync.groups import form_group
        from asyncrl.sync.plan import plan_buckets, specs_of
        from asyncrl.sync.weights import send_weights
        from rollout_servers.engine import SyncJoin

        plan = plan_buckets(specs_of(tensors), 1 << 20)
        join = None if self.group else SyncJoin("127.0.0.1", self.port, "g1", 1, 2, "gloo")

        def send():
            if self.group is None:
                self.group = form_group(self.store, "g1", 0, 2, timeout_s=60)
            send_weights(self.group, tensors, plan, timeout_s=60)

        sender = threading.Thread(target=send)
        sender.start()
        stats = loop.run(engine.sync_weights(version, plan, join=join, timeout_s=60))
        sender.join(60)
        return stats
