"""LoRA against full fine-tuning, in one run: weight push, learner step, generation.

1. **Push**: the ``small`` model's tensors (float32, random) against its rank-``r`` adapter
   on every linear layer, through the real sync path (:func:`asyncrl.sync.weights.send_weights`
   over gloo to one receiver process, as :mod:`benchmarks.bench_weight_sync`), interleaved;
   bytes, seconds and GB/s of each. From the adapter's measured GB/s, the projection for a
   7B model (Qwen2.5-7B's shapes) at rank 32 in bf16, against its whole weights.
2. **Learner**: :class:`learner.trainer.Trainer` (one rank, gloo) on the ``small`` model,
   full against LoRA rank ``r``, each in a process of its own that stays up (two warm-up
   steps, then a sample of a few steps per request, the same synthetic batches on both
   sides), sampled interleaved: step time, trainable parameters, optimizer state and the
   process's peak resident memory.
3. **Generation**: vLLM (this machine's build) on the ``small`` model with the adapter
   merged into the weights, against the base model with the adapter served by vLLM's LoRA
   support (``LoRARequest``): tokens per second over the same seeded requests, each sample
   an engine in a fresh process (two engines at once would share one accelerator's
   memory), interleaved.

Every arm runs through ``benchmarks.common.interleaved_ratio`` (A, B, B, A over the same
odd number of repetitions, 3 with ``--quick``): each ratio is per repetition, reported as
median with min and max. Writes ``bench_lora.json`` and ``.png``; prints each figure and
ratio; the last line is LoRA/full learner steps per second.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_weight_sync import TIMEOUT_S, _start, _timed, small_model_shapes  # noqa: E402
from benchmarks.common import (  # noqa: E402
    format_ratio,
    headline,
    interleaved_ratio,
    parse_args,
    write_results,
)

NAME = "bench_lora"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen2.5-7B: hidden 3584, 28 layers, 4 KV heads of 128, intermediate 18944, vocab 152064.
QWEN_7B = {"hidden": 3584, "layers": 28, "kv": 512, "intermediate": 18944, "params": 7.62e9}


def adapter_shapes(shapes: dict[str, tuple[int, ...]], rank: int) -> dict[str, tuple[int, ...]]:
    """``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` of every linear weight."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR:
            stem = name.removesuffix(".weight")
            out[stem + ".lora_A.weight"] = (rank, shape[1])
            out[stem + ".lora_B.weight"] = (shape[0], rank)
    return out


def projected_7b(rank: int) -> dict[str, float]:
    """Bytes of Qwen2.5-7B in bf16 and of its rank-``rank`` adapter on every linear layer."""
    h, kv, i = QWEN_7B["hidden"], QWEN_7B["kv"], QWEN_7B["intermediate"]
    per_layer = rank * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)  # q o, k v, gate up down
    adapter = per_layer * QWEN_7B["layers"]
    return {"full_bytes": QWEN_7B["params"] * 2, "adapter_bytes": adapter * 2.0}


# ----------------------------------------------------------------------- 1. push
def push(rank: int, reps: int) -> dict[str, Any]:
    import torch

    from asyncrl.sync.plan import plan_buckets, specs_of
    from asyncrl.sync.weights import send_weights

    pg, conns, procs = _start(1)
    full_shapes = small_model_shapes()
    sides = {
        "full": {n: torch.randn(s) for n, s in full_shapes.items()},
        "adapter": {n: torch.randn(s) for n, s in adapter_shapes(full_shapes, rank).items()},
    }
    out: dict[str, Any] = {}

    def rate(which: str):
        tensors = sides[which]
        plan = plan_buckets(specs_of(tensors), 32 << 20)
        nbytes = sum(t.numel() * 4 for t in tensors.values())
        seconds: list[float] = []

        def measure() -> float:
            send = lambda: send_weights(pg, tensors, plan, timeout_s=TIMEOUT_S)  # noqa: E731
            seconds.append(_timed(pg, conns, ("plan", plan), send))
            return 1.0 / seconds[-1]  # pushes per second

        measure()  # warm-up: pack buffers allocated
        seconds.clear()
        out[which] = {"bytes": nbytes, "tensors": len(tensors), "seconds": seconds}
        return measure

    full_rate, adapter_rate = rate("full"), rate("adapter")
    stats = interleaved_ratio(adapter_rate, full_rate, reps)
    for c in conns:
        c.send(None)
    for p in procs:
        p.join(10)
    for side in out.values():
        side["median_s"] = statistics.median(side["seconds"])
        side["gb_per_s"] = side["bytes"] / side["median_s"] / 1e9
    out["speedup"] = stats.to_json()
    out["_stats"] = stats  # for the printed line; not written
    proj = projected_7b(32)
    proj["adapter_s"] = proj["adapter_bytes"] / (out["adapter"]["gb_per_s"] * 1e9)
    proj["full_s"] = proj["full_bytes"] / (out["full"]["gb_per_s"] * 1e9)
    out["qwen2.5-7b_rank32_bf16"] = proj
    return out


# ----------------------------------------------------------------------- 2. learner
def _batch(seed: int, groups: int = 4, n: int = 8) -> list[Any]:
    """``groups`` prompts of 32 tokens, ``n`` responses of 64 each, random rewards."""
    import random

    from learner.rollouts import Rollout

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(256) for _ in range(32)]
        for _ in range(n):
            response = [rng.randrange(256) for _ in range(64)]
            lp = [rng.uniform(-6.0, -4.0) for _ in response]
            out.append(
                Rollout(prompt, response, lp, float(rng.random() < 0.5), f"{seed}-{g}", [(0, 64)])
            )
    return out


def _learner(model_dir: str, lora_rank: int, steps: int, conn: Any) -> None:
    """A trainer that stays up: after two warm-up steps it sends its sizes, then answers
    each request with the median time of ``steps`` steps, and ``None`` with its peak
    memory. Both arms train the same sequence of batches."""
    import resource

    import torch
    import torch.distributed as dist

    from asyncrl.config import load_config
    from learner.trainer import Trainer

    torch.set_num_threads(2)
    # torch documents dist.HashStore but re-exports it without marking it public
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    overrides = [f"model.path={model_dir}", "actor.ppo_mini_batch_size=4"]
    if lora_rank:
        overrides += [f"model.lora_rank={lora_rank}", f"model.lora_alpha={2 * lora_rank}"]
    trainer = Trainer(load_config(None, overrides))
    batches = iter(range(1 << 30))

    def step() -> float:
        start = time.perf_counter()
        trainer.train_step(_batch(next(batches)), 1.0)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up
        step()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    optim = sum(
        t.numel() * t.element_size()
        for s in trainer.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    conn.send({"trainable_params": trainable, "optimizer_state_bytes": optim})
    while conn.recv() is not None:
        conn.send(statistics.median(step() for _ in range(steps)))
    conn.send({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    dist.destroy_process_group()


class Worker:
    """``target(*args, conn)`` in a spawned process that stays up: its first message on
    start (:attr:`info`), one answer per :meth:`ask`, its last on :meth:`close`."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = target.__name__
        self.proc = ctx.Process(target=target, args=(*args, child))
        self.proc.start()
        self.info: dict[str, Any] = self._recv()

    def _recv(self) -> Any:
        if not self.conn.poll(900):
            self.proc.kill()
            raise RuntimeError(f"{self.name} sent nothing in 900 s")
        return self.conn.recv()

    def ask(self) -> Any:
        self.conn.send(True)
        return self._recv()

    def close(self) -> Any:
        self.conn.send(None)
        got = self._recv()
        self.proc.join(60)
        return got


def learner_arms(base: str, rank: int, steps: int, reps: int) -> dict[str, Any]:
    """Full and LoRA trainers, both up, sampled interleaved: each side's step times, sizes
    and peak memory, and LoRA/full steps per second per repetition (``speedup``)."""
    workers = {
        "full": Worker(_learner, base, 0, steps),
        "lora": Worker(_learner, base, rank, steps),
    }
    seconds: dict[str, list[float]] = {"full": [], "lora": []}

    def rate(which: str):
        def measure() -> float:
            seconds[which].append(float(workers[which].ask()))
            return 1.0 / seconds[which][-1]  # steps per second

        return measure

    stats = interleaved_ratio(rate("lora"), rate("full"), reps)
    out: dict[str, Any] = {}
    for which, worker in workers.items():
        out[which] = {
            **worker.info,
            **worker.close(),
            "step_s": statistics.median(seconds[which]),
            "step_s_reps": seconds[which],
        }
    out["speedup"] = stats.to_json()
    out["_stats"] = stats
    return out


def in_process(target, *args) -> dict[str, Any]:
    """Run ``target(*args, conn)`` in a spawned process; its one message."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    if not parent.poll(900):
        proc.kill()
        raise RuntimeError(f"{target.__name__} sent nothing in 900 s")
    got = parent.recv()
    proc.join(60)
    return got


# ----------------------------------------------------------------------- 3. generation
def _generate(model_dir: str, adapter_dir: str | None, rank: int, n: int, tokens: int, conn):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from rollout_servers.adapters import engine_lora_rank

    kwargs: dict[str, Any] = {}
    if adapter_dir:
        kwargs = {"enable_lora": True, "max_lora_rank": engine_lora_rank(rank), "max_loras": 1}
    llm = LLM(model_dir, dtype="float32", max_model_len=512, block_size=32,
              enforce_eager=True, seed=0, **kwargs)  # fmt: skip
    lora = LoRARequest("bench", 1, adapter_dir) if adapter_dir else None
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=1)
    prompts = [TokensPrompt(prompt_token_ids=[258, 10 + i % 200, 20, 30]) for i in range(n)]
    llm.generate(prompts[:4], params, lora_request=lora, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    conn.send({"tokens": produced, "seconds": seconds, "tokens_per_s": produced / seconds})


def write_models(root: Path, rank: int) -> tuple[str, str, str]:
    """The ``small`` model, a random rank-``rank`` adapter for it (non-zero ``B``), and
    the model with that adapter merged in float32: (base, adapter, merged) directories."""
    import torch

    from asyncrl.prepare.model import build_model
    from asyncrl.sync.adapter import save_peft_adapter
    from learner import lora

    base = root / "small"
    model, _ = build_model("small", base)
    g = torch.Generator().manual_seed(0)
    lora.inject(model, rank=rank, alpha=2 * rank, target_modules="all-linear")
    for m in model.modules():
        if isinstance(m, lora.LoRALinear):
            m.lora_B.weight.data = torch.randn(m.lora_B.weight.shape, generator=g) * 0.02
    state = {k: p.detach() for k, p in model.named_parameters()}
    adapter = save_peft_adapter(root / "adapter", state, rank=rank, alpha=2 * rank)
    merged = root / "merged"
    from learner.export import export_hf

    export_hf(merged, lora.merged(state, 2.0), base, step=0)
    return str(base), str(adapter), str(merged)


def generation_arms(
    base: str, adapter: str, merged: str, rank: int, n: int, tokens: int, reps: int
) -> dict[str, Any]:
    """Merged weights against the served adapter, an engine in a fresh process per sample,
    interleaved: each side's samples and adapter/merged tokens per second per repetition."""
    samples: dict[str, list[dict[str, Any]]] = {"merged": [], "adapter": []}
    args = {"merged": (merged, None), "adapter": (base, adapter)}

    def rate(which: str):
        def measure() -> float:
            got = in_process(_generate, *args[which], rank, n, tokens)
            samples[which].append(got)
            return got["tokens_per_s"]

        return measure

    stats = interleaved_ratio(rate("adapter"), rate("merged"), reps)
    out: dict[str, Any] = {
        which: {
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in got),
            "samples": got,
        }
        for which, got in samples.items()
    }
    out["ratio"] = stats.to_json()
    out["_stats"] = stats
    return out


def plot(fig: Any, f: dict[str, Any]) -> None:
    ax = fig.add_subplot(1, 3, 1)
    ax.bar(["full", "adapter"], [f["push"]["full"]["median_s"], f["push"]["adapter"]["median_s"]])
    ax.set_title("push seconds (small model)", fontsize=9)
    ax = fig.add_subplot(1, 3, 2)
    ax.bar(["full", "LoRA"], [f["learner"]["full"]["step_s"], f["learner"]["lora"]["step_s"]])
    ax.set_title("learner step seconds", fontsize=9)
    ax = fig.add_subplot(1, 3, 3)
    g = f["generation"]
    ax.bar(["merged", "adapter"], [g["merged"]["tokens_per_s"], g["adapter"]["tokens_per_s"]])
    ax.set_title("vLLM tokens/s", fontsize=9)


def main(argv: list[str] | None = None) -> None:
    def extra(p):
        p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")

    args = parse_args(NAME, (__doc__ or "").split("\n")[0], argv, extra)
    # steps: learner steps per sample (a small-model step takes seconds on this CPU).
    reps, steps, n, tokens = (3, 1, 16, 32) if args.quick else (7, 3, 64, 64)
    figures: dict[str, Any] = {"rank": args.rank}
    figures["push"] = p = push(args.rank, reps)
    push_stats = p.pop("_stats")
    print(f"push: full {p['full']['bytes'] / 1e6:.1f} MB in {p['full']['median_s']:.3f} s, "
          f"adapter {p['adapter']['bytes'] / 1e6:.2f} MB in {p['adapter']['median_s']:.4f} s "
          f"(adapter pushes per full push: {format_ratio(push_stats)})", flush=True)  # fmt: skip
    proj = p["qwen2.5-7b_rank32_bf16"]
    print(f"Qwen2.5-7B rank 32 bf16, at these rates: full {proj['full_bytes'] / 1e9:.1f} GB in "
          f"{proj['full_s']:.1f} s, adapter {proj['adapter_bytes'] / 1e6:.0f} MB in "
          f"{proj['adapter_s']:.2f} s", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter, merged = write_models(Path(tmp), args.rank)
        figures["learner"] = learner = learner_arms(base, args.rank, steps, reps)
        learner_stats = learner.pop("_stats")
        for k in ("full", "lora"):
            v = learner[k]
            print(f"learner {k}: {v['step_s']:.3f} s/step (median of {reps}), "
                  f"{v['trainable_params'] / 1e6:.2f}M trainable, optimizer "
                  f"{v['optimizer_state_bytes'] / 1e6:.1f} MB, peak RSS "
                  f"{v['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
        figures["generation"] = gen = generation_arms(
            base, adapter, merged, args.rank, n, tokens, reps
        )
        gen_stats = gen.pop("_stats")
    print(f"generation: merged {gen['merged']['tokens_per_s']:.0f} tokens/s, adapter "
          f"{gen['adapter']['tokens_per_s']:.0f} tokens/s (adapter/merged "
          f"{format_ratio(gen_stats)})", flush=True)  # fmt: skip
    figures["generation_ratio"] = gen["ratio"]
    config = {"quick": args.quick, "reps": reps, "steps": steps, "requests": n, "tokens": tokens}
    paths = write_results(
        NAME, args.out, figures=figures, config=config, plot=lambda fig: plot(fig, figures)
    )
    print(f"wrote {paths[0]} and {paths[1]}")
    headline(f"LoRA rank {args.rank}/full learner steps per s", learner_stats)


if __name__ == "__main__":
    main()
