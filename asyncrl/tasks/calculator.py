"""A calculator task for the multi-turn demo: two-digit products and three-digit sums that
the tiny character-level model cannot work out in its head, but can by calling a tool.

A row's prompt is a bare expression (``"47*29="``), its ground truth the exact result,
and its ``agent_name`` ``tool_agent``, so a run with ``rollout.multi_turn.enable`` plays it
as an episode with the tools of ``configs/tools/calculator.yaml`` (``add``, ``mul``). The
episode the warm start teaches (:func:`conversation`) is one call, then the answer::

    user:      47*29=
    assistant: <tool_call>{"name":"mul","arguments":{"a":47,"b":29}}</tool_call>
    tool:      1363
    assistant: 1363

The reward is exact match of the episode's last line with the result.
"""

from __future__ import annotations

import json
import random
from typing import Any

from asyncrl.tasks.schema import TRAIN_SPLIT, VAL_SPLIT, make_row

DATA_SOURCE = "calculator"
AGENT = "tool_agent"
TOOL_NAMES = {"+": "add", "*": "mul"}
OPERANDS = {"*": (10, 99), "+": (100, 999)}  # each op's operand range

Problem = tuple[int, str, int]


def _distinct(op: str) -> int:
    """How many distinct problems ``op`` has over its operand range."""
    lo, hi = OPERANDS[op]
    return (hi - lo + 1) ** 2


def max_rows() -> int:
    """The most rows (training and validation together) :func:`generate` can give. Rows
    alternate sum, product, sum, ..., so ``n`` rows need ``ceil(n/2)`` distinct sums and
    ``floor(n/2)`` distinct products; asking for more drew forever for the missing ones."""
    return min(2 * _distinct("+"), 2 * _distinct("*") + 1)


def answer(problem: Problem) -> int:
    a, op, b = problem
    return a * b if op == "*" else a + b


def tool_call_text(problem: Problem) -> str:
    """The assistant's call for ``problem``, hermes style, in compact JSON."""
    a, op, b = problem
    call = {"name": TOOL_NAMES[op], "arguments": {"a": a, "b": b}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def conversation(problem: Problem) -> list[dict[str, str]]:
    """The ideal episode of ``problem``: the prompt, a call, the tool's answer, the answer."""
    a, op, b = problem
    result = str(answer(problem))
    return [
        {"role": "user", "content": f"{a}{op}{b}="},
        {"role": "assistant", "content": tool_call_text(problem)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def problem_of(prompt: str) -> Problem:
    """The problem of a prompt ``"47*29="``."""
    expr = prompt.rstrip("=")
    op = "*" if "*" in expr else "+"
    a, b = expr.split(op)
    return int(a), op, int(b)


def generate(
    *, n_train: int | None = None, n_val: int | None = None, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and validation rows with disjoint problems (products and sums, half each).

    Defaults: 2,000 training and 32 validation rows. Raises ValueError on negative
    counts, or on more rows than :func:`max_rows` (the problems would run out)."""
    n_train = 2000 if n_train is None else n_train
    n_val = 32 if n_val is None else n_val
    if n_train < 0 or n_val < 0:
        raise ValueError(f"row counts must be >= 0, got n_train={n_train}, n_val={n_val}")
    if n_train + n_val > max_rows():
        raise ValueError(
            f"calculator has {_distinct('*')} distinct products and {_distinct('+')} sums, "
            f"dealt in turn, so at most {max_rows()} distinct problems; cannot split them "
            f"into n_train={n_train} and n_val={n_val}. Ask for fewer rows: --n-train plus "
            f"--n-val at most {max_rows()}."
        )
    rng = random.Random(seed)
    seen: set[Problem] = set()
    problems: list[Problem] = []
    while len(problems) < n_train + n_val:
        op = "*" if len(problems) % 2 else "+"
        lo, hi = OPERANDS[op]
        p = (rng.randint(lo, hi), op, rng.randint(lo, hi))
        if p not in seen:
            seen.add(p)
            problems.append(p)
    return _rows(problems[n_val:], TRAIN_SPLIT), _rows(problems[:n_val], VAL_SPLIT)


def _rows(problems: list[Problem], split: str) -> list[dict[str, Any]]:
    rows = []
    for index, (a, op, b) in enumerate(problems):
        row = make_row(
            DATA_SOURCE,
            f"{a}{op}{b}=",
            str(answer((a, op, b))),
            split=split,
            index=index,
        )
        row["agent_name"] = AGENT
        rows.append(row)
    return rows


def extract_answer(solution_str: str) -> str:
    """The last non-empty line of the response (the final assistant turn)."""
    lines = [line.strip() for line in solution_str.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the episode's last line is exactly the result, else 0.0."""
    return 1.0 if extract_answer(solution_str) == str(ground_truth).strip() else 0.0
