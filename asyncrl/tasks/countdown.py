"""TinyZero's countdown task: reach a target with each given number used exactly once.

Generation builds the target from a random expression over the drawn numbers, so every
problem has at least one solution (kept in ``extra_info["solution"]``).

Scoring follows TinyZero (0.0 no answer, 0.1 well-formed but wrong, 1.0 correct) with one
deliberate difference: the equation is parsed with :mod:`ast` and only integers, ``+ - * /``,
unary signs, parentheses and whitespace are accepted. Anything else, including ``**``,
names, calls, floats, equations over ``MAX_EQUATION_CHARS`` characters and integer literals
over ``MAX_LITERAL_DIGITS`` digits, is "not well-formed" and scores 0.0. That bound keeps
scoring cheap whatever the model writes; nothing from the model is ever executed.
"""

from __future__ import annotations

import ast
import logging
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from asyncrl.tasks.schema import TRAIN_SPLIT, VAL_SPLIT, make_row

logger = logging.getLogger(__name__)

DATA_SOURCE = "countdown"
ABILITY = "math"

PROMPT_TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
    "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work "
    "in <think> </think> tags. And return the final answer in <answer> </answer> tags."
)

# TinyZero's split sizes (it trains on 327,680 and tests on 1,024); a tenth for training keeps
# `prepare` quick, and users ask for more with n_train.
DEFAULT_N_TRAIN = 32_768
DEFAULT_N_VAL = 1_024

MAX_EQUATION_CHARS = 200
MAX_LITERAL_DIGITS = 6
TOLERANCE = Fraction(1, 100_000)

_ASSISTANT_MARKERS = ("Assistant:", "<|im_start|>assistant")
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]*", re.ASCII)
_LEADING_ZEROS = re.compile(r"(?<![0-9])0+(?=[0-9])")
_LONG_LITERAL = re.compile(rf"[0-9]{{{MAX_LITERAL_DIGITS + 1},}}")
_ALLOWED_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.UAdd,
    ast.USub,
)

# Expressions tried per draw of numbers, and draws per requested problem, before giving up.
_EXPRESSIONS_PER_DRAW = 20
_DRAWS_PER_PROBLEM = 200


# --------------------------------------------------------------------------- generation


def _combine(a: int, b: int, op: str) -> tuple[int, bool] | None:
    """Apply ``op`` keeping every intermediate a non-negative integer, as in the TV game.

    Returns ``(value, swapped)``: subtraction and division may swap their operands to stay
    valid, which finds a solution in fewer tries. None when no order divides exactly.
    """
    if op == "+":
        return a + b, False
    if op == "*":
        return a * b, False
    if op == "-":
        return (a - b, False) if a >= b else (b - a, True)
    if b != 0 and a % b == 0:
        return a // b, False
    if a != 0 and b % a == 0:
        return b // a, True
    return None


def _random_solution(rng: random.Random, numbers: list[int]) -> tuple[str, int] | None:
    """Combine all numbers with random operators; return ``(expression, value)`` or None."""
    items = [(n, str(n)) for n in numbers]
    while len(items) > 1:
        # Two distinct random positions, cheaper than rng.sample.
        i = rng.randrange(len(items))
        j = rng.randrange(len(items) - 1)
        j += j >= i
        (a, expr_a), (b, expr_b) = items[i], items[j]
        op = rng.choice("+-*/")
        combined = _combine(a, b, op)
        if combined is None:
            return None
        value, swapped = combined
        if swapped:
            expr_a, expr_b = expr_b, expr_a
        rest = [item for k, item in enumerate(items) if k != i and k != j]
        items = [*rest, (value, f"({expr_a} {op} {expr_b})")]
    value, expr = items[0]
    # The last combination wraps the whole expression in one redundant pair of parentheses.
    return expr[1:-1], value


def _draw_problem(rng: random.Random, cfg: dict[str, int]) -> tuple[list[int], int, str] | None:
    """Draw numbers and a target reachable from them, or None if this draw found none."""
    count = rng.randint(cfg["min_numbers"], cfg["max_numbers"])
    numbers = [rng.randint(cfg["min_number"], cfg["max_number"]) for _ in range(count)]
    for _ in range(_EXPRESSIONS_PER_DRAW):
        found = _random_solution(rng, numbers)
        if found is not None and cfg["min_target"] <= found[1] <= cfg["max_target"]:
            return numbers, found[1], found[0]
    return None


def _make_row(numbers: list[int], target: int, solution: str, split: str, index: int) -> dict:
    content = PROMPT_TEMPLATE.format(numbers=numbers, target=target)
    truth = {"target": target, "numbers": numbers}
    return make_row(
        DATA_SOURCE, content, truth, split=split, index=index, extra_info={"solution": solution}
    )


def generate(
    *,
    n_train: int | None = None,
    n_val: int | None = None,
    seed: int = 0,
    min_numbers: int = 3,
    max_numbers: int = 4,
    min_number: int = 1,
    max_number: int = 99,
    min_target: int = 1,
    max_target: int = 100,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate solvable countdown problems; train and val share no (numbers, target).

    Validation rows are drawn first, so changing ``n_train`` leaves the validation set as is.

    Args:
        n_train: Training rows (default ``DEFAULT_N_TRAIN``).
        n_val: Validation rows (default ``DEFAULT_N_VAL``).
        seed: Random seed; the same seed gives the same rows.
        min_numbers, max_numbers: How many numbers a problem has.
        min_number, max_number: Range of each number.
        min_target, max_target: Range of the target.

    Returns:
        ``(train_rows, val_rows)`` in veRL's layout.

    Raises:
        ValueError: On bad ranges, or when the ranges cannot yield enough distinct problems.
    """
    cfg = dict(
        min_numbers=min_numbers,
        max_numbers=max_numbers,
        min_number=min_number,
        max_number=max_number,
        min_target=min_target,
        max_target=max_target,
    )
    if not (2 <= min_numbers <= max_numbers and 0 <= min_number <= max_number):
        raise ValueError(
            f"countdown needs 2 <= min_numbers <= max_numbers and a number range: {cfg}"
        )
    if min_target > max_target:
        raise ValueError(f"countdown needs min_target <= max_target: {cfg}")
    n_train = DEFAULT_N_TRAIN if n_train is None else n_train
    n_val = DEFAULT_N_VAL if n_val is None else n_val
    rng = random.Random(seed)
    seen: set[tuple[tuple[int, ...], int]] = set()
    splits: dict[str, list[dict[str, Any]]] = {VAL_SPLIT: [], TRAIN_SPLIT: []}
    for split, wanted in ((VAL_SPLIT, n_val), (TRAIN_SPLIT, n_train)):
        rows = splits[split]
        budget = wanted * _DRAWS_PER_PROBLEM
        while len(rows) < wanted and budget > 0:
            budget -= 1
            drawn = _draw_problem(rng, cfg)
            if drawn is None:
                continue
            numbers, target, solution = drawn
            key = (tuple(sorted(numbers)), target)
            if key not in seen:
                seen.add(key)
                rows.append(_make_row(numbers, target, solution, split, len(rows)))
        if len(rows) < wanted:
            raise ValueError(
                f"countdown found only {len(rows)} distinct {split} problems of {wanted} "
                f"with {cfg}; widen the ranges or ask for fewer"
            )
    return splits[TRAIN_SPLIT], splits[VAL_SPLIT]


# ----------------------------------------------------------------------------- scoring


def extract_equation(solution_str: str) -> str | None:
    """Return the content of the last ``<answer>...</answer>`` pair, or None.

    As in TinyZero, text up to the first ``Assistant:`` (or ``<|im_start|>assistant``) is
    dropped so an answer echoed in the prompt does not count. Unlike TinyZero, the answer may
    sit on any line, not only the last one, and a response without the marker is searched
    whole (our servers pass the response alone).
    """
    text = solution_str
    for marker in _ASSISTANT_MARKERS:
        if marker in text:
            text = text.split(marker, 1)[1]
            break
    # rfind keeps this linear in the length of the text, whatever tags the model emits.
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>") : end].strip()


def parse_equation(equation: str) -> ast.Expression | None:
    """Parse an equation restricted to integers, ``+ - * /``, parentheses and whitespace.

    Returns None when the text is not such an equation or exceeds the size bounds.
    """
    if len(equation) > MAX_EQUATION_CHARS or not _ALLOWED_CHARS.fullmatch(equation):
        return None
    # Python rejects "07"; a person would read it as 7.
    text = " ".join(_LEADING_ZEROS.sub("", equation).split())
    if not text or _LONG_LITERAL.search(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            return None
        if isinstance(node, ast.Constant) and (
            type(node.value) is not int  # also rejects True/False and floats
        ):
            return None
    return tree


def _literals(tree: ast.Expression) -> list[int]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is int]


def _evaluate(node: ast.AST) -> Fraction:
    """Evaluate a tree accepted by :func:`parse_equation` exactly; may raise ZeroDivisionError."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right
    raise TypeError(f"unexpected node {type(node).__name__}")  # parse_equation forbids it


def _read_ground_truth(ground_truth: Any) -> tuple[Fraction, list[int]]:
    try:
        target = Fraction(ground_truth["target"])
        numbers = [int(n) for n in ground_truth["numbers"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, "
            f"got {ground_truth!r}"
        ) from exc
    return target, numbers


def compute_score(
    solution_str: str, ground_truth: Any, *, format_score: float = 0.1, score: float = 1.0
) -> float:
    """Score a countdown response as TinyZero does, with a safe, bounded parser.

    Returns ``score`` (1.0) when the last answer uses each given number exactly once and
    equals the target within 1e-5; ``format_score`` (0.1) when it is a well-formed equation
    that uses other numbers, misses the target or divides by zero; 0.0 when there is no
    answer or it is not a well-formed equation.
    """
    target, numbers = _read_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    tree = parse_equation(equation)
    if tree is None:
        return 0.0
    # Checking the numbers first means we only ever evaluate the given, small literals.
    if Counter(_literals(tree)) != Counter(numbers):
        return format_score
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        return format_score
    return score if abs(value - target) <= TOLERANCE else format_score
