"""Learner step cost: the trainer's ``train_step`` against a bare training loop, same run.

Both sides train the same model on the same tokens with the same loss shape and optimizer:
- **trainer**: :class:`learner.trainer.Trainer` (FSDP2 on a one-rank gloo group, cleaning,
  advantages, planning, collation, importance-weighted PPO loss, metrics) on a batch of
  :class:`~learner.rollouts.Rollout`, with ``actor.sequence_layout`` forced to each layout;
- **bare**: the same HF model without FSDP, the batch's tensors built once beforehand, one
  forward, the clipped PPO loss with truncated importance weights (token mean), backward,
  gradient clipping and AdamW: what a hand-written loop would do, nothing more.

Batch shapes (128 sequences = 16 prompts x 8 samples, one mini-batch, one update):
``tiny`` (the demo's 0.33M model) with ~23-token prompts and 1-4-token responses, as in the
demo; ``small`` (24M) with the same prompts and 4-token responses (an untrained model runs
to ``max_response_length``). Each case runs on 1 and 2 cores (process affinity and torch
threads), in each layout: padded, packed, and shared (one row per prompt, its samples'
responses after it, :mod:`learner.shared_prefix`), which ``auto`` picks here (SDPA on CPU,
see :mod:`learner.layout`). The bare loop takes the same layout as the trainer in each
pair (its rows built by the learner's own collation: ``collate`` padded or packed,
``collate_shared``), so that a ratio measures the trainer's overhead and not a layout's gain.

The two sides are timed interleaved (``benchmarks.common.interleaved_ratio``); a sample is
the mean of a few steps after a warm-up. The ratio is trainer time / bare time in the same
layout (lower is better; goal <= 1.3, which the headline applies to the layout ``auto``
picks), reported as the median over repetitions with its min-max spread. The layout's own
gain is a separate figure (``layout_gain`` in the JSON, a printed line per case): the bare
loop padded against the same loop in shared rows, interleaved, as padded time / shared time
(above 1: the shared rows are faster). Last line: the worst ``auto`` ratio over the cases
run.
"""

from __future__ import annotations

import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RatioStats,
    format_ratio,
    headline,
    interleaved_ratio,
    parse_args,
    write_results,
)

NAME = "bench_learner"
GOAL = 1.3
PROMPTS, SAMPLES = 16, 8
TEMPERATURE = 1.0
# The demo's optimiser and loss settings (configs/cpu_demo.yaml).
LR, CLIP_LOW, CLIP_HIGH, IS_CAP = 6e-4, 0.2, 0.28, 2.0


def synthetic_batch(model: str, vocab: int, seed: int = 0) -> list[Any]:
    """The batch of one learner step: ``PROMPTS`` groups of ``SAMPLES`` rollouts."""
    from learner.rollouts import Rollout

    rng = random.Random(seed)
    out = []
    for g in range(PROMPTS):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 26))]
        for _ in range(SAMPLES):
            n = 4 if model == "small" else rng.randint(1, 4)
            response = [rng.randrange(3, vocab) for _ in range(n)]
            logprobs = [rng.uniform(-3.0, -0.1) for _ in range(n)]
            reward = float(rng.random() < 0.5)
            out.append(Rollout(prompt, response, logprobs, reward, f"g{g}", [(0, n)]))
    return out


def trainer_cfg(model_dir: str, layout: str):
    from asyncrl.config import load_config

    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "data.max_prompt_length=32",
            "data.max_response_length=4",
            f"data.train_batch_size={PROMPTS}",
            f"rollout.n={SAMPLES}",
            f"actor.ppo_mini_batch_size={PROMPTS}",
            f"actor.optim.lr={LR}",
            f"actor.clip_ratio_low={CLIP_LOW}",
            f"actor.clip_ratio_high={CLIP_HIGH}",
            f"algorithm.importance.cap={IS_CAP}",
            f"actor.sequence_layout={layout}",
            "trainer.device=cpu",
        ],
    )


LAYOUTS = ("padded", "packed", "shared")


class BareLoop:
    """The hand-written baseline: one model, prebuilt tensors in ``layout`` (one of
    :data:`LAYOUTS`), one update per call."""

    def __init__(self, model_dir: str, rollouts: list[Any], layout: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from learner.collate import collate
        from learner.rollouts import baseline_advantages
        from learner.shared_prefix import collate_shared

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0)
        adv = baseline_advantages(rollouts, rollouts, "grpo")
        ids = list(range(len(rollouts)))
        if layout == "shared":
            self.mb = collate_shared(rollouts, adv, ids, temperature=TEMPERATURE)
        elif layout in ("padded", "packed"):
            self.mb = collate(rollouts, adv, ids, packed=layout == "packed")
        else:
            raise ValueError(f"unknown layout {layout!r}: one of {LAYOUTS}")
        # Rows per sequence: fewer than one where shared rows hold a prompt once.
        self.rows = int(self.mb.input_ids.shape[0])

    def step(self) -> None:
        import torch

        mb = self.mb
        out = self.model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            attention_mask=mb.attention_mask,
            use_cache=False,
        )
        logits = out.logits.reshape(-1, out.logits.shape[-1])[mb.gather_index]
        logp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
        logp = logp.gather(-1, mb.targets[..., None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        adv = mb.advantages[:, None]
        clipped = torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
        weight = torch.exp(logp.detach() - mb.behaviour).clamp(max=IS_CAP)
        loss_t = -weight * torch.minimum(ratio * adv, clipped * adv)
        loss = (loss_t * mb.mask).sum() / mb.mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _use_cores(n: int) -> None:
    import torch

    os.sched_setaffinity(0, set(range(n)))
    torch.set_num_threads(n)


def _mean_time(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def run_case(
    model: str, model_dir: str, cores: int, reps: int, steps: int
) -> tuple[list[dict], dict[str, Any]]:
    """Every layout of one model on ``cores`` cores: trainer vs bare in the same layout,
    interleaved; then the layout's gain, the bare loop padded vs shared. (rows, gain)."""
    from transformers import AutoConfig

    from learner.trainer import Trainer

    _use_cores(cores)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = synthetic_batch(model, vocab)
    rows = []
    bares: dict[str, BareLoop] = {}
    for layout in LAYOUTS:
        trainer = Trainer(trainer_cfg(model_dir, layout))
        bare = bares[layout] = BareLoop(model_dir, batch, layout)
        metrics = trainer.train_step(batch, TEMPERATURE)  # warm-up, both sides
        bare.step()
        stats: RatioStats = interleaved_ratio(
            lambda t=trainer: _mean_time(lambda: t.train_step(batch, TEMPERATURE), steps),
            lambda b=bare: _mean_time(b.step, steps),
            reps,
        )
        rows.append(
            {
                "model": model,
                "cores": cores,
                "layout": layout,
                "auto": layout == "shared",  # what auto picks on this CPU
                "bare_layout": layout,  # like with like: the ratio is the trainer's overhead
                "bare_rows": bare.rows,
                "trainer_s": sorted(stats.real)[len(stats.real) // 2],
                "bare_s": sorted(stats.baseline)[len(stats.baseline) // 2],
                "pad_ratio": metrics["batch/pad_ratio"],
                "tokens": sum(len(r.prompt_ids) + len(r.response_ids) for r in batch),
                "stats": stats.to_json(),
                "_stats": stats,  # for the headline; not written
            }
        )
        print(
            f"{model:5s} {cores} core(s) {layout:6s}: trainer {rows[-1]['trainer_s']:.3f} s, "
            f"bare {rows[-1]['bare_s']:.3f} s, trainer/bare {format_ratio(stats)}",
            flush=True,
        )
    # The layout's gain on its own: the same hand-written loop in both layouts.
    gain: RatioStats = interleaved_ratio(
        lambda: _mean_time(bares["padded"].step, steps),
        lambda: _mean_time(bares["shared"].step, steps),
        reps,
    )
    print(
        f"{model:5s} {cores} core(s) layout gain, bare padded/shared step time "
        f"{format_ratio(gain)}",
        flush=True,
    )
    return rows, {"model": model, "cores": cores, "stats": gain.to_json(), "_stats": gain}


def build_models(names: list[str], root: Path) -> dict[str, str]:
    """Random-weight models (timing does not depend on the weights)."""
    from asyncrl.prepare.model import build_model

    dirs = {}
    for name in names:
        build_model(name, root / name)
        dirs[name] = str(root / name)
    return dirs


def plot(fig: Any, rows: list[dict]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{r['model']}\n{r['cores']}c {r['layout']}" for r in rows]
    med = [r["stats"]["median"] for r in rows]
    err = [
        [m - r["stats"]["min"] for m, r in zip(med, rows, strict=True)],
        [r["stats"]["max"] - m for m, r in zip(med, rows, strict=True)],
    ]
    colors = ["tab:green" if r["auto"] else "tab:gray" for r in rows]
    ax.bar(range(len(rows)), med, yerr=err, color=colors, capsize=3)
    ax.axhline(GOAL, color="tab:red", ls="--", label=f"goal {GOAL}")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="trainer / bare step time", title="learner step vs bare loop (green: auto)")
    ax.legend()


def main(argv: list[str] | None = None) -> None:
    def extra(p) -> None:
        p.add_argument("--models", default=None, help="comma-separated: tiny,small")
        p.add_argument("--cores", default=None, help="comma-separated core counts (1,2)")

    args = parse_args(NAME, "Learner step vs a bare training loop.", argv, extra)
    import transformers

    transformers.logging.disable_progress_bar()  # a bar per model load would bury the table
    models: list[str] = str(args.models or ("tiny" if args.quick else "tiny,small")).split(",")
    usable = len(os.sched_getaffinity(0))
    cores = [int(c) for c in (args.cores or ("1" if args.quick else "1,2")).split(",")]
    cores = [c for c in cores if c <= usable]
    # (repetitions, steps per sample): a small-model step takes seconds on one core.
    plan = {"tiny": (3, 2) if args.quick else (7, 5), "small": (3, 1) if args.quick else (5, 1)}
    rows: list[dict] = []
    gains: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = build_models(models, Path(tmp))
        for m in models:
            for c in cores:
                case_rows, gain = run_case(m, dirs[m], c, *plan[m])
                rows += case_rows
                gains.append(gain)
    auto = [r for r in rows if r["auto"]]
    worst = max(auto, key=lambda r: r["stats"]["median"])
    worst_stats: RatioStats = worst["_stats"]
    for r in rows + gains:
        del r["_stats"]
    figures = {"rows": rows, "goal": GOAL, "worst_auto": worst["stats"], "layout_gain": gains}
    config = {"models": models, "cores": cores, "reps_and_steps_per_sample": plan}
    write_results(NAME, args.out, figures=figures, config=config, plot=lambda f: plot(f, rows))
    for r in rows:  # every pair has one layout on both sides: the goal applies to each
        ok = " ok" if r["stats"]["median"] <= GOAL else " OVER GOAL"
        auto_mark = " (auto)" if r["auto"] else ""
        print(
            f"  {r['model']} {r['cores']}c {r['layout']}{auto_mark}: {r['stats']['median']:.2f}{ok}"
        )
    for g in gains:
        print(
            f"  {g['model']} {g['cores']}c layout gain (bare padded/shared): "
            f"{g['stats']['median']:.2f}"
        )
    assert math.isfinite(worst_stats.median)
    headline(
        f"learner trainer/bare step time, auto layout on both sides, worst case (goal <= {GOAL})",
        worst_stats,
    )


if __name__ == "__main__":
    main()
