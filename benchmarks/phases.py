"""Each phase of the pipeline alone, on chosen cores: what overlap could gain, and the costs
the scheduler model is calibrated on.

``python benchmarks/phases.py {generate,train,sync} CONFIG --cores 0,1 [overrides]`` prints
one JSON object (last line). Run as a subprocess by ``benchmarks/throughput.py``, so that
each measurement has its own process pinned to its cores before torch or vLLM start.

- ``generate``: one vLLM engine (the rollout server's engine arguments) answers the
  training prompts, ``rollout.n`` samples each, at ``concurrency`` sequences in flight;
  reports generated tokens/s and the response lengths. Two concurrencies give the decode
  cost's fixed and per-sequence parts.
- ``train``: the learner's :class:`~learner.trainer.Trainer` (FSDP2, one rank) on synthetic
  batches shaped like the run's (prompt and response lengths from the config or given);
  reports trained tokens/s and seconds per step.
- ``sync``: one weight push of the model through the real sync path (a sender, the
  engines' pause, receive, reload) into as many idle engines as the run has servers, all
  on the given cores; reports its seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("benchmarks.phases")


def _pin(cores: list[int]) -> None:
    """Pin this process (and the threads it starts) to ``cores``; set thread counts to match."""
    os.sched_setaffinity(0, cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    os.environ["OMP_NUM_THREADS"] = str(len(cores))


def _prompts(cfg: Config, tok, limit: int) -> list[list[int]]:
    import pyarrow.parquet as pq

    from asyncrl.prepare.tokenizer import chat_prompt_ids

    rows = pq.read_table(cfg.data.train_files).to_pylist()[:limit]
    return [chat_prompt_ids(tok, list(r["prompt"])) for r in rows]


def _engine_args(cfg: Config):
    from rollout_servers.engine_config import cpu_token_budget, engine_args
    from rollout_servers.main import eager_engine

    ro = cfg.rollout
    max_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    return engine_args(
        cfg.model.path,
        dtype=cfg.model.dtype,
        max_model_len=max_len,
        max_num_batched_tokens=cpu_token_budget(ro.max_inflight, max_len),
        seed=cfg.trainer.seed,
        max_num_seqs=ro.max_inflight,
        enforce_eager=eager_engine(cfg),
    )


async def _generate(cfg: Config, concurrencies: list[int], seconds: float) -> dict:
    """Tokens/s at each concurrency (sequences in flight), after one warm-up round."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from rollout_servers.engine import RolloutEngine

    engine = await RolloutEngine.start(_engine_args(cfg))
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = _prompts(cfg, tok, 512)
    params = SamplingParams(
        temperature=cfg.rollout.temperature, max_tokens=cfg.data.max_response_length, logprobs=0
    )
    out: dict = {"concurrency": {}, "response_lengths": []}
    try:
        rounds = [concurrencies[0], *concurrencies]  # the first round warms up
        for i, c in enumerate(rounds):
            lengths, elapsed = await _round(engine, prompts, params, c, seconds, f"r{i}")
            out["concurrency"][str(c)] = {
                "tokens_per_s": sum(lengths) / elapsed,
                "samples_per_s": len(lengths) / elapsed,
                "samples": len(lengths),
            }
            out["response_lengths"] = lengths[:2000]
    finally:
        engine.shutdown()
    return out


async def _round(engine, prompts, params, concurrency: int, seconds: float, tag: str):
    """``concurrency`` request loops for ``seconds``: (response lengths, elapsed seconds)."""
    lengths: list[int] = []
    start = time.monotonic()

    async def worker(k: int) -> None:
        serial = 0
        while time.monotonic() - start < seconds:
            serial += 1
            prompt = prompts[(k * 7919 + serial) % len(prompts)]
            s = await engine.generate(prompt, params, f"{tag}-{k}-{serial}")
            lengths.append(len(s.token_ids))

    await asyncio.gather(*[worker(k) for k in range(concurrency)])
    return lengths, time.monotonic() - start


def _train(cfg: Config, steps: int, response_len: float) -> dict:
    """Seconds per step and trained tokens/s of the learner on synthetic batches."""
    import random

    from transformers import AutoTokenizer

    from learner.rollouts import Rollout
    from learner.trainer import Trainer

    trainer = Trainer(cfg, total_steps=steps + 1)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = _prompts(cfg, tok, 512)
    rng = random.Random(0)
    vocab = trainer.model.config.vocab_size
    n, groups = cfg.rollout.n, cfg.data.train_batch_size

    def batch(step: int) -> list[Rollout]:
        out = []
        for g in range(groups):
            prompt = prompts[rng.randrange(len(prompts))]
            for _ in range(n):
                length = max(
                    1, min(cfg.data.max_response_length, round(rng.expovariate(1 / response_len)))
                )
                out.append(
                    Rollout(
                        prompt,
                        [rng.randrange(3, vocab) for _ in range(length)],
                        [-1.0] * length,
                        float(rng.random() < 0.5),
                        (step, g),
                        [(trainer.policy_version, length)],
                    )
                )
        return out

    times, tokens, prompt_lens = [], [], []
    for step in range(steps + 1):  # the first step warms up
        rollouts = batch(step)
        start = time.monotonic()
        trainer.train_step(rollouts, cfg.rollout.temperature)
        if step:
            times.append(time.monotonic() - start)
            tokens.append(sum(len(r.prompt_ids) + len(r.response_ids) for r in rollouts))
            prompt_lens += [len(r.prompt_ids) for r in rollouts]
    return {
        "step_s": sum(times) / len(times),
        "tokens_per_s": sum(tokens) / sum(times),
        "samples_per_s": groups * n * len(times) / sum(times),
        "steps": len(times),
        "prompt_len_mean": sum(prompt_lens) / len(prompt_lens),
    }


async def _sync(cfg: Config, reps: int, receivers: int) -> dict:
    """Seconds per weight push of the model into ``receivers`` idle engines at once, as the
    run's servers receive it (the first push, which also forms the group, is not counted)."""
    import threading

    from transformers import AutoModelForCausalLM

    from asyncrl.net.ports import free_ports
    from asyncrl.sync.groups import form_group, open_store
    from asyncrl.sync.plan import plan_buckets, specs_of
    from asyncrl.sync.weights import send_weights
    from rollout_servers.engine import RolloutEngine

    engines = [await RolloutEngine.start(_engine_args(cfg)) for _ in range(receivers)]
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype="float32")
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    plan = plan_buckets(specs_of(tensors), int(cfg.sync.bucket_mb * (1 << 20)))
    port = free_ports("127.0.0.1", 1)[0]  # a free port for the sync store
    store = open_store("127.0.0.1", port, is_host=True, timeout_s=60)
    world = receivers + 1
    group: list = []

    def send() -> None:
        if not group:
            group.append(form_group(store, "bench", 0, world, timeout_s=60))
        send_weights(group[0], tensors, plan, timeout_s=60)

    times = []
    try:
        for version in range(1, reps + 2):
            first = not group
            sender = threading.Thread(target=send)
            start = time.monotonic()
            sender.start()
            await asyncio.gather(
                *[
                    e.sync_weights(
                        version,
                        plan,
                        timeout_s=60,
                        join=("127.0.0.1", port, "bench", i + 1, world, "gloo") if first else None,
                    )
                    for i, e in enumerate(engines)
                ]
            )
            sender.join(60)
            if not first:
                times.append(time.monotonic() - start)
    finally:
        for e in engines:
            e.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {
        "sync_s": sum(times) / len(times),
        "bytes": nbytes,
        "reps": len(times),
        "receivers": receivers,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks/phases.py", description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=["generate", "train", "sync"])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--cores", default="0", help="comma-separated cores to pin to")
    p.add_argument("--seconds", type=float, default=20.0, help="generate: seconds per round")
    p.add_argument("--concurrency", default="16,128", help="generate: sequences in flight")
    p.add_argument("--steps", type=int, default=5, help="train: measured steps")
    p.add_argument(
        "--response-len",
        type=float,
        default=0.0,
        help="train: mean response length (default: max_response_length / 2)",
    )
    p.add_argument("--reps", type=int, default=3, help="sync: measured pushes")
    p.add_argument(
        "--receivers",
        type=int,
        default=0,
        help="sync: engines receiving at once (default: rollout.num_servers)",
    )
    a = p.parse_args(argv)
    _pin([int(c) for c in a.cores.split(",")])
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from asyncrl.config import load_config

    cfg = load_config(a.config, a.overrides)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.rollout.cpu_kvcache_space_gb))
    import torch

    torch.set_num_threads(len(a.cores.split(",")))
    if a.phase == "generate":
        conc = [int(c) for c in a.concurrency.split(",")]
        result = asyncio.run(_generate(cfg, conc, a.seconds))
    elif a.phase == "train":
        result = _train(cfg, a.steps, a.response_len or cfg.data.max_response_length / 2)
    else:
        result = asyncio.run(_sync(cfg, a.reps, a.receivers or cfg.rollout.num_servers))
    result["cores"] = a.cores
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
