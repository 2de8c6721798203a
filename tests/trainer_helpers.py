"""What the learner's trainer tests share: synthetic batches, the gradients an optimizer
receives and float32 tolerances."""

from __future__ import annotations

import random

import torch

from learner.rollouts import Rollout
from learner.trainer import Trainer


def synthetic_batch(seed: int, groups: int = 4, n: int = 4) -> list[Rollout]:
    """Random prompts/responses with plausible behaviour logprobs, plus one non-finite
    logprob and one malformed rollout (both must be handled, not crash)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 8))]
        for _ in range(n):
            k = rng.randint(2, 10)
            out.append(
                Rollout(
                    prompt,
                    [rng.randrange(256) for _ in range(k)],
                    [rng.uniform(-6.0, -4.0) for _ in range(k)],
                    float(rng.random() < 0.5),
                    f"{seed}-{g}",
                    [(0, k)],
                )
            )
    out[1].behaviour_logprobs[0] = float("nan")
    out.append(Rollout([1, 2], [3, 4], [-1.0], 1.0, f"{seed}-0"))  # lengths disagree
    return out


# Two ways of computing the same step (1 or 2 ranks, packed or padded input) round
# differently, and Adam amplifies that: its first step is lr * g / (|g| + eps), so a gradient
# near zero that rounds to +1e-11 on one machine and -1e-11 on another moves its weight by
# +-1e-6 (at lr 1e-3, lr / eps = 1e5 times the rounding). Weights after an Adam step are no
# measure of numerics; the gradients the optimizer receives are.
def record_gradients(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Every optimizer update's full gradients (clipped, as the optimizer sees them), in
    order. With more than one rank, every rank must record (gathering is a collective)."""
    from torch.distributed.tensor import DTensor

    updates: list[dict[str, torch.Tensor]] = []

    def before_step(optimizer, args, kwargs) -> None:
        grads = {}
        for name, p in trainer.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name] = g.detach().clone()
        updates.append(grads)

    trainer.optimizer.register_step_pre_hook(before_step)
    return updates


def float32_tolerance(trainer: Trainer, batch: list[Rollout]) -> float:
    """Relative tolerance between two float32 computations of one step's loss or gradients.

    A float32 sum of n terms is off by at most about n * eps times the terms' magnitude,
    whatever order the machine sums in. A weight's gradient sums over the batch's tokens,
    after a backward pass that summed over the model's widest dimension.
    """
    c = trainer.model.config
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in batch)
    widest = max(c.hidden_size, c.intermediate_size, c.vocab_size)
    return (tokens + widest) * torch.finfo(torch.float32).eps


def assert_gradients_match(got: dict, expected: dict, rel: float) -> None:
    """Each tensor within ``rel`` of its largest gradient: a near-zero element is what is left
    of terms of ordinary size, so it carries their rounding, not a share of its own value."""
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        atol = rel * g.abs().max().item()
        torch.testing.assert_close(
            got[name], g, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
