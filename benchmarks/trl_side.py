"""The single-process side of ``benchmarks/vs_trl.py``: TRL's ``GRPOTrainer`` on the same
model, prompts, reward and hyperparameters as an asyncrl run, in this one process.

    python benchmarks/trl_side.py --model M --data D/train.parquet --steps 180 \\
        --max-new-tokens 4 --lr 6e-4 --warmup 10 --out trl.json [--reward-file F]

It writes, per optimizer step, the wall-clock time at its end and the mean training reward,
so the comparison can time "step 1 to the end" as ``make demo`` does. TRL is an optional
dependency (``pip install -e .[bench]``); nothing else imports this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any


def _scorer(reward_file: str | None):
    """veRL's ``compute_score(data_source, solution_str, ground_truth, extra_info)``: the
    built-in one, or ``compute_score`` of ``reward_file`` (as reward.custom_reward_function)."""
    if reward_file is None:
        from asyncrl.rewards import default_compute_score

        return default_compute_score
    spec = importlib.util.spec_from_file_location("bench_reward", reward_file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def _dataset(path: str):
    """veRL parquet rows -> TRL's conversational prompts, with the reward's columns."""
    import pandas as pd
    from datasets import Dataset

    rows = pd.read_parquet(path)
    return Dataset.from_dict(
        {
            "prompt": [list(map(dict, p)) for p in rows["prompt"]],
            "data_source": list(rows["data_source"]),
            "ground_truth": [str(rm["ground_truth"]) for rm in rows["reward_model"]],
        }
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    trl: Any = importlib.import_module("trl")  # the optional bench extra

    torch.set_num_threads(args.threads)
    score = _scorer(args.reward_file)
    rewards: list[float] = []
    tokens: list[int] = []
    tok = AutoTokenizer.from_pretrained(args.model)

    def reward(
        prompts, completions, data_source, ground_truth, completion_ids=None, **_: Any
    ) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [
            float(score(src, text, gt))
            for text, src, gt in zip(texts, data_source, ground_truth, strict=True)
        ]
        rewards.append(sum(out) / len(out))
        # Response tokens as generated (EOS included, as asyncrl counts them); re-encoding
        # the decoded text of random tokens would count others.
        tokens.append(sum(len(ids) for ids in completion_ids or []))
        return out

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.monotonic())

    config = trl.GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_out"),
        per_device_train_batch_size=args.prompts * args.n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup,
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        loss_type="dapo",  # token-mean over the batch: actor.loss_agg_mode token-mean
        scale_rewards="group",
        max_steps=args.steps,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=args.model,
        reward_funcs=reward,
        args=config,
        train_dataset=_dataset(args.data),
        processing_class=tok,
        callbacks=[Clock()],
    )
    start = time.monotonic()
    trainer.train()
    return {
        "start": start,
        "step_ends": [t - start for t in ends],
        "reward_mean": rewards,
        "response_tokens": tokens,
        "threads": args.threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description="TRL's GRPOTrainer, as benchmarks/vs_trl.py runs it")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="veRL parquet file of training prompts")
    p.add_argument("--reward-file", default=None)
    p.add_argument("--steps", type=int, default=180)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    main()
