"""LoRA against full fine-tuning, in one run: weight push, learner step, generation.

1. **Push**: the ``small`` model's tensors (float32, random) against its rank-``r`` adapter
   on every linear layer, through the real sync path (:func:`asyncrl.sync.weights.send_weights`
   over gloo to one receiver process, as :mod:`benchmarks.bench_weight_sync`), interleaved;
   bytes, seconds and GB/s of each. From the adapter's measured GB/s, the projection for a
   7B model (Qwen2.5-7B's shapes) at rank 32 in bf16, against its whole weights.
2. **Learner**: :class:`learner.trainer.Trainer` (one rank, gloo) on the ``small`` model,
   full against LoRA rank ``r``, each in a process of its own: median step time over the
   same synthetic batches, trainable parameters, optimizer state and the process's peak
   resident memory.
3. **Generation**: vLLM (this machine's build) on the ``small`` model with the adapter
   merged into the weights, against the base model with the adapter served by vLLM's LoRA
   support (``LoRARequest``): tokens per second over the same seeded requests, each engine
   in a process of its own.

Writes ``bench_lora.json`` and ``.png``; prints each figure and the ratios.
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
from benchmarks.common import interleaved_ratio, parse_args, write_results  # noqa: E402

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
    import resource

    import torch
    import torch.distributed as dist

    from asyncrl.config import load_config
    from learner.trainer import Trainer

    torch.set_num_threads(2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    overrides = [f"model.path={model_dir}", "actor.ppo_mini_batch_size=4"]
    if lora_rank:
        overrides += [f"model.lora_rank={lora_rank}", f"model.lora_alpha={2 * lora_rank}"]
    trainer = Trainer(load_config(None, overrides))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        trainer.train_step(_batch(i), 1.0)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    optim = sum(
        t.numel() * t.element_size()
        for s in trainer.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    conn.send(
        {
            "step_s": statistics.median(times),
            "trainable_params": trainable,
            "optimizer_state_bytes": optim,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )
    dist.destroy_process_group()


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
    from vllm.lora.request import LoRARequest

    from rollout_servers.adapters import engine_lora_rank

    kwargs: dict[str, Any] = {}
    if adapter_dir:
        kwargs = {"enable_lora": True, "max_lora_rank": engine_lora_rank(rank), "max_loras": 1}
    llm = LLM(model_dir, dtype="float32", max_model_len=512, block_size=32,
              enforce_eager=True, seed=0, **kwargs)  # fmt: skip
    lora = LoRARequest("bench", 1, adapter_dir) if adapter_dir else None
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=1)
    prompts = [{"prompt_token_ids": [258, 10 + i % 200, 20, 30]} for i in range(n)]
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

    export_hf(merged, lora.merged(state, 2.0), base)
    return str(base), str(adapter), str(merged)


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
    reps, steps, n, tokens = (3, 1, 16, 32) if args.quick else (7, 6, 64, 64)
    figures: dict[str, Any] = {"rank": args.rank}
    figures["push"] = p = push(args.rank, reps)
    print(f"push: full {p['full']['bytes'] / 1e6:.1f} MB in {p['full']['median_s']:.3f} s, "
          f"adapter {p['adapter']['bytes'] / 1e6:.2f} MB in {p['adapter']['median_s']:.4f} s "
          f"(adapter pushes per full push: {p['speedup']['median']:.1f})", flush=True)  # fmt: skip
    proj = p["qwen2.5-7b_rank32_bf16"]
    print(f"Qwen2.5-7B rank 32 bf16, at these rates: full {proj['full_bytes'] / 1e9:.1f} GB in "
          f"{proj['full_s']:.1f} s, adapter {proj['adapter_bytes'] / 1e6:.0f} MB in "
          f"{proj['adapter_s']:.2f} s", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter, merged = write_models(Path(tmp), args.rank)
        figures["learner"] = learner = {
            "full": in_process(_learner, base, 0, steps),
            "lora": in_process(_learner, base, args.rank, steps),
        }
        for k, v in learner.items():
            print(f"learner {k}: {v['step_s']:.3f} s/step, {v['trainable_params'] / 1e6:.2f}M "
                  f"trainable, optimizer {v['optimizer_state_bytes'] / 1e6:.1f} MB, peak RSS "
                  f"{v['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
        figures["generation"] = gen = {
            "merged": in_process(_generate, merged, None, args.rank, n, tokens),
            "adapter": in_process(_generate, base, adapter, args.rank, n, tokens),
        }
    ratio = gen["adapter"]["tokens_per_s"] / gen["merged"]["tokens_per_s"]
    print(f"generation: merged {gen['merged']['tokens_per_s']:.0f} tokens/s, adapter "
          f"{gen['adapter']['tokens_per_s']:.0f} tokens/s (adapter/merged {ratio:.2f})")  # fmt: skip
    figures["generation_ratio"] = ratio
    config = {"quick": args.quick, "reps": reps, "steps": steps, "requests": n, "tokens": tokens}
    paths = write_results(
        NAME, args.out, figures=figures, config=config, plot=lambda fig: plot(fig, figures)
    )
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
