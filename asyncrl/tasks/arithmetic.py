"""A tiny arithmetic task sized for a CPU demo model with a character-level tokenizer.

Prompts are bare expressions such as ``"3+5="`` and the ground truth is the answer as a
string (``"8"``). With the defaults (operands 0..9, addition only) there are 100 distinct
problems, few enough for a 0.3M-parameter model to learn in minutes, and the reward is
exact-match so a learning curve is easy to read.
"""

from __future__ import annotations

import logging
import operator
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.tasks.schema import TRAIN_SPLIT, VAL_SPLIT, make_row

logger = logging.getLogger(__name__)

DATA_SOURCE = "arithmetic"
ABILITY = "math"

SUPPORTED_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}

# Above this many distinct problems we sample instead of listing them all, so a large
# max_operand costs memory proportional to what is asked for, not to the problem space.
_ENUMERATE_LIMIT = 200_000

# A sampled draw that hits an existing problem is retried; this bounds the retries.
_MAX_DRAWS_PER_PROBLEM = 50

# A character-level model ends its answer with a newline or an end-of-turn marker.
_STOP_MARKERS = ("<|im_end|>", "<|endoftext|>")
_INTEGER_RE = re.compile(r"-?[0-9]+")

Problem = tuple[int, str, int]


def _check_params(max_operand: int, ops: Sequence[str], val_fraction: float) -> tuple[str, ...]:
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    unknown = [op for op in ops if op not in SUPPORTED_OPS]
    # One order however they were typed: the shuffled split follows it, and a model warm
    # started on ``--ops "+-"`` trained on the validation rows of data built with "-+".
    unique_ops = tuple(op for op in SUPPORTED_OPS if op in ops)
    if not unique_ops or unknown:
        raise ValueError(f"ops must be a non-empty subset of {tuple(SUPPORTED_OPS)}, got {ops!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    return unique_ops


def _sample_problems(
    rng: random.Random, count: int, max_operand: int, ops: tuple[str, ...]
) -> list[Problem]:
    """Draw ``count`` distinct problems without listing the whole space."""
    seen: set[Problem] = set()
    out: list[Problem] = []
    budget = count * _MAX_DRAWS_PER_PROBLEM
    while len(out) < count and budget > 0:
        budget -= 1
        problem = (rng.randint(0, max_operand), rng.choice(ops), rng.randint(0, max_operand))
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    if len(out) < count:
        raise ValueError(f"could only draw {len(out)} distinct arithmetic problems of {count}")
    return out


def _make_rows(problems: Sequence[Problem], split: str) -> list[dict[str, Any]]:
    rows = []
    for index, (a, op, b) in enumerate(problems):
        answer = SUPPORTED_OPS[op](a, b)
        rows.append(make_row(DATA_SOURCE, f"{a}{op}{b}=", str(answer), split=split, index=index))
    return rows


def generate(
    *,
    n_train: int | None = None,
    n_val: int | None = None,
    seed: int = 0,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    val_fraction: float = 0.2,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate train and validation rows with disjoint prompts.

    The distinct problems ``a op b`` with ``0 <= a, b <= max_operand`` are shuffled by
    ``seed``; validation takes the first ``n_val`` and training the next ``n_train``.

    Args:
        n_train: Training rows; ``None`` means every problem not used for validation.
        n_val: Validation rows; ``None`` means ``round(total * val_fraction)``.
        seed: Shuffle seed; the same seed gives the same rows.
        max_operand: Largest operand (operands start at 0).
        ops: Operators to use, a subset of ``+``, ``-``, ``*``.
        val_fraction: Share of problems held out when ``n_val`` is not given.

    Returns:
        ``(train_rows, val_rows)`` in veRL's layout.

    Raises:
        ValueError: On bad parameters, or when more rows are asked for than exist.
    """
    unique_ops = _check_params(max_operand, ops, val_fraction)
    total = (max_operand + 1) ** 2 * len(unique_ops)
    rng = random.Random(seed)
    if n_val is None:
        n_val = round(total * val_fraction)
    if n_train is None:
        if total > _ENUMERATE_LIMIT:
            raise ValueError(
                f"arithmetic with max_operand={max_operand} has {total} problems; "
                "pass n_train (and n_val) to sample a subset"
            )
        n_train = total - n_val
    if n_train < 0 or n_val < 0 or n_train + n_val > total:
        raise ValueError(
            f"arithmetic with max_operand={max_operand} and ops={unique_ops} has {total} "
            f"distinct problems; cannot split them into n_train={n_train} and n_val={n_val}. "
            "Ask for fewer rows or raise max_operand."
        )
    if total <= _ENUMERATE_LIMIT:
        span = range(max_operand + 1)
        problems = [(a, op, b) for op in unique_ops for a in span for b in span]
        rng.shuffle(problems)
    else:
        problems = _sample_problems(rng, n_train + n_val, max_operand, unique_ops)
    val = _make_rows(problems[:n_val], VAL_SPLIT)
    train = _make_rows(problems[n_val : n_val + n_train], TRAIN_SPLIT)
    logger.debug("arithmetic: %d train and %d val rows of %d problems", len(train), n_val, total)
    return train, val


def extract_answer(solution_str: str) -> str:
    """Return the first line of a response, cut at any end marker and stripped."""
    text = solution_str
    for marker in _STOP_MARKERS:
        text = text.split(marker, 1)[0]
    return text.split("\n", 1)[0].strip()


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """Score 1.0 when the response's first line is exactly the integer answer, else 0.0.

    ``" 8"``, ``"8\\n..."`` and ``"8<|im_end|>"`` all count as ``"8"``; ``"08"``,
    ``"8.0"`` and ``"=8"`` do not, so the model must learn the canonical form.
    """
    answer = extract_answer(solution_str)
    expected = str(ground_truth).strip()
    if not _INTEGER_RE.fullmatch(answer):
        return 0.0
    return 1.0 if answer == expected else 0.0
