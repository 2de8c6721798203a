"""TinyZero's countdown task: reach a target with each given number used exactly once.

Generation builds the target from a random expression over the drawn numbers, so every
problem has at least one solution (kept in ``extra_info["solution"]``).

Scoring is TinyZero's rule (``verl/utils/reward_score/countdown.py`` in TinyZero), so a run
on TinyZero's files is rewarded as TinyZero rewards it:

- the answer is the last ``<answer>...</answer>`` on the response's **last line** (TinyZero
  cut the decoded prompt and response at the prompt's assistant marker, then took the last
  line; the scorer here gets the response alone, which is the same text after that cut);
  none scores 0;
- one whose runs of digits are not exactly the given numbers, that holds anything but
  digits, ``+ - * / ( ) .`` and whitespace, that Python cannot evaluate, or whose value is
  not within 1e-5 of the target scores ``format_score`` (0.1): a malformed answer scores
  the same as a wrong one, as in TinyZero;
- a correct one scores ``score`` (1.0).

TinyZero evaluates the answer with ``eval``. Nothing from the model is run here: the
answer is compiled (so exactly what ``eval`` would refuse is refused) and its syntax tree
evaluated with Python's own arithmetic, the same ints, floats and exceptions. The one
difference: a power whose result would exceed :data:`MAX_POWER_BITS` bits counts as failing
to evaluate, where ``eval`` would run for hours or run out of memory (``99**99**99``).
"""

from __future__ import annotations

import ast
import logging
import operator
import random
import re
import warnings
from collections.abc import Callable
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

#: TinyZero's scores: a correct answer, and one that is there but not correct.
SCORE = 1.0
FORMAT_SCORE = 0.1
#: How close to the target a value must be (strictly), as in TinyZero.
TOLERANCE = 1e-5
#: The largest power (in bits of its result) computed; a larger one fails to evaluate.
MAX_POWER_BITS = 1 << 16

_OPEN, _CLOSE = "<answer>", "</answer>"
# TinyZero's patterns, Unicode-aware as Python's re is by default: "\d" takes any digit
# (int() reads them all), while the compiler accepts only ASCII ones, so an answer written
# with other digits passes the number check and fails to evaluate, as it does there.
_NUMBER = re.compile(r"\d+")
_EQUATION_CHARS = re.compile(r"[\d+\-*/().\s]+")
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,  # "//" is made of allowed characters
}

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


class _TooLarge(ArithmeticError):
    """A power over :data:`MAX_POWER_BITS` bits: not computed, the answer fails to evaluate."""


def extract_equation(solution_str: str) -> str | None:
    """The last ``<answer>...</answer>`` on the response's last line, stripped, or None.

    Pairs are matched left to right as TinyZero's non-greedy pattern matches them (an
    ``<answer>`` pairs with the first ``</answer>`` after it), found with ``str.find`` so
    the work stays linear in the line's length whatever tags the model writes.
    """
    line = solution_str.split("\n")[-1]
    found, start = None, 0
    while (opened := line.find(_OPEN, start)) >= 0:
        closed = line.find(_CLOSE, opened + len(_OPEN))
        if closed < 0:  # no later <answer> has a closing tag either
            break
        found, start = line[opened + len(_OPEN) : closed], closed + len(_CLOSE)
    return None if found is None else found.strip()


def uses_numbers(equation: str, numbers: Any) -> bool:
    """Whether the equation's runs of digits, read as integers, are exactly ``numbers``
    (each once), as TinyZero checks them; any failure to compare is a no."""
    try:
        return sorted(int(n) for n in _NUMBER.findall(equation)) == sorted(numbers)
    except Exception:  # TinyZero treats every error here as "not the given numbers"
        return False


def evaluate_equation(equation: str) -> Any:
    """The value ``eval`` gives ``equation`` (an int, float or complex), or None where
    ``eval`` would raise, or the characters are not TinyZero's (see the module docstring)."""
    if not _EQUATION_CHARS.fullmatch(equation):
        return None
    text = equation.lstrip(" \t")  # eval drops leading spaces and tabs
    try:
        # Compiled, never run: it fails exactly where eval would fail to compile. Its
        # warnings ("'int' object is not callable" for "(2)(3)") are the model's, not ours.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(text, "<answer>", "eval")
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    try:
        return _value(tree.body)
    except (ArithmeticError, TypeError, ValueError, RecursionError, MemoryError):
        return None


def _value(node: ast.expr) -> Any:
    """Evaluate a node as Python would. Only numbers, the operators ``+ - * / // **`` and
    unary signs can make a number from the allowed characters; anything else (``...``,
    ``()``, ``(2)(3)``) raises TypeError, as its evaluation does in Python."""
    signs: list[ast.unaryop] = []
    value: Any
    while isinstance(node, ast.UnaryOp):  # a loop: the parser nests thousands of signs
        signs.append(node.op)
        node = node.operand
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            value = _power(left, right)
        elif type(node.op) in _BINARY:
            value = _BINARY[type(node.op)](left, right)
        else:
            raise TypeError(f"operator {type(node.op).__name__}")
    else:
        raise TypeError(f"not a number: {type(node).__name__}")
    for sign in reversed(signs):
        if not isinstance(sign, (ast.USub, ast.UAdd)):
            raise TypeError(f"operator {type(sign).__name__}")
        value = -value if isinstance(sign, ast.USub) else +value
    return value


def _power(base: Any, exponent: Any) -> Any:
    """``base ** exponent``, refusing an integer power of more than :data:`MAX_POWER_BITS`
    bits (float and complex powers are cheap: they overflow or round instead)."""
    # 0, 1 and -1 stay small whatever the exponent; a negative one gives a float.
    if type(base) is int and type(exponent) is int and abs(base) > 1 and exponent > 0:
        # |base| >= 2**(bit_length - 1), so the result has more bits than this
        bits = exponent * (abs(base).bit_length() - 1)
        if bits > MAX_POWER_BITS:
            raise _TooLarge(f"{base}**{exponent}")
    return base**exponent


def _read_ground_truth(ground_truth: Any) -> tuple[Any, Any]:
    """``(target, numbers)`` as the row holds them: compared as they are, as TinyZero does."""
    try:
        return ground_truth["target"], ground_truth["numbers"]
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(
            f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, "
            f"got {ground_truth!r}"
        ) from exc


def compute_score(
    solution_str: str,
    ground_truth: Any,
    *,
    format_score: float = FORMAT_SCORE,
    score: float = SCORE,
) -> float:
    """Score a countdown response by TinyZero's rule (see the module docstring).

    Returns 0.0 without an answer on the last line; ``score`` when the answer uses each
    given number exactly once and comes within 1e-5 of the target; ``format_score`` for
    any other answer.

    Raises:
        ValueError: ``ground_truth`` lacks ``target`` or ``numbers``.
    """
    target, numbers = _read_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    # The numbers are checked first, as TinyZero does: only then is the answer evaluated.
    if not uses_numbers(equation, numbers):
        return format_score
    value = evaluate_equation(equation)
    if value is None:
        return format_score
    try:
        correct = bool(abs(value - target) < TOLERANCE)
    except Exception:  # a target that is no number: TinyZero's comparison fails too
        return format_score
    return score if correct else format_score
