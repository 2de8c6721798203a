"""The learner-only part of ``make gpu-check``: the learner's production code on CUDA.

Run as every rank of a learner (``torchrun --nproc-per-node N benchmarks/gpu_learner_check.py
--device cuda --model DIR --out DIR``; :mod:`benchmarks.gpu_check` starts it), or with
``--device cpu`` as its CPU twin (gloo, float32), which the tests run. It uses the learner's
own classes, not copies of them:

1. ``train``: :class:`learner.trainer.Trainer` (FSDP2; on CUDA bf16 mixed precision over
   float32 master weights, on the process group ``cpu:gloo,cuda:nccl`` of
   :func:`learner.fsdp.init_distributed`) takes two steps on batches that rank 0 shares with
   :func:`learner.broadcast.share_batch` and :func:`learner.loop.to_rollouts` reads.
2. ``collectives``: the learner's group carries a device all-reduce (NCCL on CUDA), a CPU
   all-reduce (gloo beside it) and the loop's version broadcast; every rank trained on the
   same batch.
3. ``checkpoint``: :meth:`Trainer.save`, one more step, :meth:`Trainer.load`: the weights
   and the step are back exactly.
4. ``push``: :meth:`Trainer.full_state_for_push` (the model's dtype), then rank 0 sends it
   the way :class:`asyncrl.sync.sender.WeightPusher` does (a sync store, a group of
   :func:`asyncrl.control.setup.sync_backend`, :func:`asyncrl.sync.weights.send_weights`) to a
   stand-in receiver process: an HF model on its own device that receives with
   :func:`asyncrl.sync.weights.receive_weights`, as the vLLM worker extension does, and loads
   the weights. NCCL cannot put two ranks of one group on one GPU: the receiver takes the
   last visible GPU, so on CUDA this needs two GPUs (skipped with one).

Rank 0 writes ``<out>/learner_check.json``: one ``{"item", "status", "detail"}`` per item,
``status`` one of ``passed``, ``failed``, ``skipped``. Exits 1 when an item failed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (torchrun): the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ITEMS = ("train", "layouts", "collectives", "checkpoint", "push", "offload", "lora")
TITLES = {
    "train": "learner: FSDP2 steps ({dtype} on {device}, group {backend})",
    "layouts": "learner: shared-prompt rows give the padded rows' logprobs ({dtype})",
    "collectives": "learner: collectives on its production group ({backend})",
    "checkpoint": "learner: checkpoint save and load",
    "push": "learner: weight push to a stand-in receiver ({sync})",
    "offload": "learner: FSDP2 CPU offload of actor and reference (actor.fsdp_config)",
    "lora": "learner: LoRA adapters under FSDP2 ({dtype}; adapter-only checkpoint)",
}


def _params_off_cpu(models: dict[str, Any]) -> list[str]:
    """``model/name:device`` of each parameter whose local shard is not in CPU memory (the
    first eight), for the offload check's message."""
    from torch.distributed.tensor import DTensor

    off = []
    for label, model in models.items():
        for name, p in model.named_parameters() if model is not None else ():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.device.type != "cpu":
                off.append(f"{label}/{name}:{local.device}")
    return off[:8] + ([f"... {len(off) - 8} more"] if len(off) > 8 else [])


def learner_config(model: Path, device: str, run_root: Path, *extra: str) -> Any:
    """A small learner config: the tiny model, bf16 rollout dtype on CUDA (float32 on CPU),
    two groups of four per step, one mini-batch; ``extra`` overrides."""
    from asyncrl.config import load_config

    return load_config(
        None,
        [
            *extra,
            f"model.path={model}",
            f"model.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
            f"trainer.device={device}",
            f"trainer.default_local_dir={run_root}",
            "trainer.total_training_steps=4",
            "data.max_response_length=8",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_max_token_len_per_gpu=128",
            "actor.optim.lr=1e-3",
        ],
    )


def wire_batch(seed: int, vocab: int, groups: int = 2, n: int = 4) -> Any:
    """A buffer batch as the learner receives it (wire types), deterministic in ``seed``."""
    import numpy as np

    from asyncrl import wire

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        task_id = f"gpu-check/{seed}/{g}"
        prompt = rng.integers(0, vocab, int(rng.integers(3, 8)))
        members = []
        for i in range(n):
            k = int(rng.integers(2, 8))
            members.append(
                wire.Trajectory.build(
                    task_id=task_id,
                    group_index=i,
                    group_size=n,
                    prompt_ids=prompt,
                    response_ids=rng.integers(0, vocab, k),
                    logprobs=-rng.uniform(4.0, 6.0, k),
                    policy_version=0,
                    reward=float(rng.random() < 0.5),
                )
            )
        out.append(wire.Group.from_trajectories(task_id, members))
    return wire.Batch(
        batch_id=seed, policy_version=0, groups=out, lag_histogram={0: groups}, metrics={}
    )


class Checks:
    """Per-item results (rank 0 reports them); an item that raises fails, the rest go on
    (every rank runs the same items, so the collectives stay matched)."""

    def __init__(self, names: dict[str, str]):
        self.names = names
        self.results: list[dict[str, str]] = []

    def run(self, item: str, fn: Callable[[], str]) -> bool:
        start = time.monotonic()
        try:
            detail = fn()
            status = "skipped" if detail.startswith("skipped: ") else "passed"
            detail = detail.removeprefix("skipped: ")
        except Exception as e:
            traceback.print_exc()
            status, detail = "failed", f"{type(e).__name__}: {e}"[:300]
        took = f" ({time.monotonic() - start:.1f}s)" if status != "skipped" else ""
        self.results.append({"item": self.names[item], "status": status, "detail": detail + took})
        return status == "passed"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", type=Path, required=True, help="an HF model directory (tiny)")
    p.add_argument(
        "--out", type=Path, required=True, help="a fresh directory: learner_check.json, the run"
    )
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from asyncrl.control.setup import sync_backend
    from learner.fsdp import process_group_backend
    from learner.trainer import Trainer

    device = args.device
    names = {
        k: v.format(
            dtype="bf16" if device == "cuda" else "float32",
            device=device,
            backend=process_group_backend(device),
            sync=sync_backend(device),
        )
        for k, v in TITLES.items()
    }
    checks = Checks(names)
    args.out.mkdir(parents=True, exist_ok=True)
    run_root = args.out / "learner_run"  # the same on every rank: checkpoints go there
    cfg = learner_config(args.model, device, run_root)
    vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
    state: dict[str, Any] = {}

    def train() -> str:
        trainer = state["trainer"] = Trainer(cfg, total_steps=4)
        param = next(trainer.model.parameters())
        if param.device.type != device:
            raise AssertionError(f"parameters on {param.device}, not {device}")
        losses = [_step(trainer, seed, vocab) for seed in (1, 2)]
        if not all(math.isfinite(x) for x in losses):
            raise AssertionError(f"non-finite loss: {losses}")
        return (
            f"{trainer.world_size} rank(s), group {dist.get_backend_config()}, "
            f"layout {trainer.layout}, losses {', '.join(f'{x:.3f}' for x in losses)}"
        )

    def layouts() -> str:
        # The layout the model chose (shared on sdpa) against padded rows, on one batch.
        from learner.layout import choose_layout
        from learner.loop import to_rollouts

        trainer = _need(state, "trainer")
        rollouts = to_rollouts(wire_batch(7, vocab))
        chosen = trainer.layout
        attn = getattr(trainer.model.config, "_attn_implementation", None)
        intended, _ = choose_layout(cfg.actor.sequence_layout, attn, device)
        if chosen != intended:  # the model's probe refused the layout auto picks
            raise AssertionError(f"the model refused the {intended} layout (probe)")
        if chosen == "shared":  # the batch is one the shared layout takes (not padded)
            from learner.shared_prefix import collate_shared

            ids = list(range(len(rollouts)))
            mask = collate_shared(rollouts, torch.zeros(len(ids)), ids).attention_mask
            if mask is None or mask.ndim != 4:
                raise AssertionError("the check's batch fell back to padded rows")
        got = {chosen: trainer.compute_logprobs(rollouts, 1.0)}
        trainer.layout, trainer.packed = "padded", False
        try:
            got["padded"] = trainer.compute_logprobs(rollouts, 1.0)
        finally:
            trainer.layout, trainer.packed = chosen, chosen == "packed"
        pairs = [(a, b) for a, b in zip(got[chosen], got["padded"], strict=True) if a is not None]
        diff = max(float((a - b).abs().max()) for a, b in pairs if b is not None)
        # bf16 logits: a different reduction order moves a logprob by a few bf16 ulps of
        # the logits' scale; float32 agrees to rounding.
        tol = 0.1 if device == "cuda" else 1e-4
        if diff > tol:
            raise AssertionError(f"{chosen} vs padded: max |diff| {diff:.2e} > {tol}")
        return f"{chosen} vs padded on {len(pairs)} sequences: max |diff| {diff:.2e}"

    def collectives() -> str:
        from learner.loop import _broadcast_int

        trainer = _need(state, "trainer")
        world = trainer.world_size
        on_device = torch.ones(1, device=trainer.device)
        dist.all_reduce(on_device)  # NCCL on CUDA
        on_cpu = torch.ones(1)
        dist.all_reduce(on_cpu)  # gloo beside it
        version = _broadcast_int(7 if trainer.rank == 0 else -1, trainer)
        if (on_device.item(), on_cpu.item(), version) != (world, world, 7):
            raise AssertionError(f"got {on_device.item()}, {on_cpu.item()}, {version}")
        return f"all-reduce of a {device} and a cpu tensor, version broadcast, {world} rank(s)"

    def checkpoint() -> str:
        trainer = _need(state, "trainer")
        path = trainer.save(run_root)
        saved = {k: v.float().cpu() for k, v in _full(trainer).items()}
        step = trainer.step
        _step(trainer, 3, vocab)
        trainer.load(path)
        back = {k: v.float().cpu() for k, v in _full(trainer).items()}
        if trainer.step != step or any(not torch.equal(saved[k], back[k]) for k in saved):
            raise AssertionError("weights or step differ after load")
        return f"{Path(path).name}: {len(saved)} tensors back exactly"

    def push() -> str:
        trainer = _need(state, "trainer")
        receiver_device = _receiver_device(device)
        tensors = trainer.full_state_for_push()  # every rank: a collective
        if receiver_device is None:
            return "skipped: one GPU: NCCL cannot place the receiver beside the learner"
        if trainer.rank != 0:
            return ""
        return _push(tensors, args.model, receiver_device, sync_backend(device), args.out)

    def offload() -> str:
        offloaded = learner_config(
            args.model,
            device,
            run_root / "offload",
            "actor.fsdp_config.param_offload=true",
            "actor.use_kl_loss=true",
        )
        trainer = Trainer(offloaded, total_steps=4)
        models = {"actor": trainer.model, "ref": trainer.ref_model}
        on_device = _params_off_cpu(models)
        losses = [_step(trainer, seed, vocab) for seed in (1, 2)]
        after = _params_off_cpu(models)
        if on_device or after or not all(math.isfinite(x) for x in losses):
            raise AssertionError(
                f"shards off the CPU at start: {on_device}; after two steps: {after}; "
                f"losses {losses}"
            )
        note = "" if device == "cuda" else " (no effect on the CPU)"
        return f"shards in CPU memory{note}, losses {', '.join(f'{x:.3f}' for x in losses)}"

    def lora_item() -> str:
        from learner import lora
        from learner.fsdp import full_state

        cfg_lora = learner_config(
            args.model, device, run_root / "lora", "model.lora_rank=8", "actor.optim.lr=1e-2"
        )
        trainer = Trainer(cfg_lora, total_steps=4)
        before = full_state(trainer.model)
        losses = [_step(trainer, seed, vocab) for seed in (1, 2)]
        after = full_state(trainer.model)
        base_moved = [
            k for k in after if not lora.is_adapter_key(k) and not torch.equal(after[k], before[k])
        ]
        b_moved = sum(not torch.equal(after[k], before[k]) for k in after if ".lora_B." in k)
        if base_moved or not b_moved or not all(math.isfinite(x) for x in losses):
            raise AssertionError(
                f"base moved: {base_moved[:3]}; adapters B moved: {b_moved}; losses {losses}"
            )
        pushed = trainer.full_state_for_push()  # sync.lora: adapter
        merged = trainer.export_state()
        if not all(lora.is_adapter_key(k) for k in pushed) or any(
            lora.is_adapter_key(k) for k in merged
        ):
            raise AssertionError("the push is not the adapter alone, or the export not merged")
        if not all(t.isfinite().all() for t in (*pushed.values(), *merged.values())):
            raise AssertionError("non-finite pushed or merged weights")
        path = trainer.save(run_root / "lora")
        trainer.load(path)
        back = full_state(trainer.model)
        if any(not torch.equal(back[k], after[k]) for k in after):
            raise AssertionError("weights differ after an adapter checkpoint's load")
        return (
            f"{b_moved} adapters moved, base unchanged, push of {len(pushed)} adapter tensors, "
            f"losses {', '.join(f'{x:.3f}' for x in losses)}"
        )

    ok = checks.run("train", train)
    steps = (
        ("layouts", layouts),
        ("collectives", collectives),
        ("checkpoint", checkpoint),
        ("push", push),
    )
    for item, fn in (*steps, ("offload", offload), ("lora", lora_item)):
        if ok:
            checks.run(item, fn)
        else:
            checks.results.append(
                {"item": names[item], "status": "skipped", "detail": "no trainer"}
            )
    if dist.is_initialized():
        dist.barrier()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        (args.out / "learner_check.json").write_text(json.dumps(checks.results, indent=1))
    failed = any(r["status"] == "failed" for r in checks.results)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


def _need(state: dict[str, Any], key: str) -> Any:
    return state[key]


def _step(trainer: Any, seed: int, vocab: int) -> float:
    """One learner step as the loop takes it: rank 0's batch shared, read, trained on."""
    from learner.broadcast import share_batch
    from learner.loop import to_rollouts

    batch = wire_batch(seed, vocab) if trainer.rank == 0 else None
    shared = share_batch(batch, trainer.rank, trainer.world_size)
    metrics = trainer.train_step(to_rollouts(shared), 1.0)
    return float(metrics.get("loss/total", float("nan")))


def _full(trainer: Any) -> dict[str, Any]:
    from learner import fsdp

    return fsdp.full_state(trainer.model)


def _receiver_device(device: str) -> str | None:
    """Where the stand-in receiver runs: the CPU twin on the CPU; on CUDA the last visible
    GPU, when there are two or more (None: one GPU)."""
    if device == "cpu":
        return "cpu"
    import torch

    n = torch.cuda.device_count()
    return f"cuda:{n - 1}" if n >= 2 else None


def _push(tensors: dict[str, Any], model: Path, receiver_device: str, backend: str, out: Path):
    """Rank 0's side of one push, as WeightPusher runs it, to a receiver process."""
    import torch

    from asyncrl.net.ports import free_ports
    from asyncrl.sync.groups import form_group, open_store, store_prefix
    from asyncrl.sync.plan import plan_buckets, specs_of
    from asyncrl.sync.sender import pack_device
    from asyncrl.sync.weights import send_weights

    port = free_ports("127.0.0.1", 1)[0]  # a free port for the sync store
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=120)
    plan = plan_buckets(specs_of(tensors), 1 << 20)  # 1 MiB buckets: several of them
    result = out / "receiver.pt"
    ctx = mp.get_context("spawn")
    proc = ctx.Process(
        target=_receiver,
        args=(port, "gpu-check", plan, str(model), receiver_device, backend, str(result)),
    )
    proc.start()
    try:
        group = form_group(store, store_prefix("", "gpu-check"), 0, 2, backend=backend)
        time.sleep(0.5)  # the receive posted first, as a server's is (told of the push)
        # As WeightPusher calls it: packing where the backend broadcasts from, asking
        # whether to give up (here: never).
        device = pack_device(backend)
        stats = send_weights(group, tensors, plan, timeout_s=120, device=device, abandon=lambda: "")
        proc.join(180)
    finally:
        if proc.is_alive():
            proc.kill()
    if proc.exitcode != 0:
        raise RuntimeError(f"the receiver exited {proc.exitcode}")
    got = torch.load(result)
    wrong = [n for n, t in tensors.items() if not torch.equal(got[n], t.cpu())]
    if wrong or set(got) != set(tensors):
        raise AssertionError(f"received weights differ: {wrong[:3]}")
    return (
        f"{len(tensors)} tensors ({stats['bytes'] / 2**20:.1f} MiB, {int(stats['buckets'])} "
        f"buckets, {next(iter(tensors.values())).dtype}) to {receiver_device}, loaded equal"
    )


def _receiver(
    port: int, generation: str, plan: Any, model: str, device: str, backend: str, result: str
) -> None:
    """The stand-in receiver: an HF model on ``device`` that joins the group as rank 1,
    receives as the vLLM worker extension does, loads the weights and saves what it holds."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.sync.groups import form_group, given_up, open_store, store_prefix
    from asyncrl.sync.weights import receive_weights

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.to(device)
    store = open_store("127.0.0.1", port, is_host=False, timeout_s=120)
    prefix = store_prefix("", generation)
    group = form_group(store, prefix, 1, 2, backend=backend)
    asks = given_up(store, prefix)  # as the vLLM worker extension's receive asks
    received = {n: t.clone() for n, t in receive_weights(group, plan, device=device, abandon=asks)}
    hf.to(next(iter(received.values())).dtype)
    hf.load_state_dict(received, strict=False)
    held = hf.state_dict()
    torch.save({n: held[n].detach().cpu() for n in received}, result)


if __name__ == "__main__":
    raise SystemExit(main())
