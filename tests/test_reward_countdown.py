"""The built-in countdown scorer rewards as TinyZero's does (its
``verl/utils/reward_score/countdown.py``): on a table of whole responses, including those a
review found scored apart (an answer with ``= 20``, a ``x`` sign, ``$`` signs, a float, the
answer followed by another line), and on generated responses against a restatement of
TinyZero's rule that, as TinyZero does, runs ``eval``."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from asyncrl.rewards import default_compute_score
from asyncrl.tasks import countdown

# The restated rule's eval warns of text such as "(2)(3)", as TinyZero's did.
pytestmark = pytest.mark.filterwarnings("ignore::SyntaxWarning")

GT = {"target": 20, "numbers": [2, 3, 4]}


def tinyzero_rule(response: str, truth: dict[str, Any]) -> float:
    """TinyZero's rule, restated for the test: the last ``<answer>`` of the last line; 0.1
    unless its digit runs are the given numbers, its characters the allowed ones and its
    ``eval`` within 1e-5 of the target. ``eval`` is safe on what reaches it here: digits
    and operators only, with the few small numbers the tests give."""
    found = re.findall(r"<answer>(.*?)</answer>", response.split("\n")[-1])
    if not found:
        return 0.0
    equation = found[-1].strip()
    try:
        if sorted(int(n) for n in re.findall(r"\d+", equation)) != sorted(truth["numbers"]):
            return 0.1
    except Exception:
        return 0.1
    if not re.fullmatch(r"[\d+\-*/().\s]+", equation):
        return 0.1
    try:
        value = eval(equation, {"__builtins__": None}, {})  # noqa: S307 - see the docstring
        return 1.0 if abs(value - truth["target"]) < 1e-5 else 0.1
    except Exception:
        return 0.1


# What the rollout server hands the scorer: the response alone, special tokens dropped.
TABLE = [
    # the review's rows
    ("2+3=5, 5*4=20</think>\n<answer> (2 + 3) * 4 </answer>", 1.0),
    ("2+3=5, 5*4=20</think>\n<answer> (2 + 3) * 4 = 20 </answer>", 0.1),
    ("</think>\n<answer>(2+3)\u00d74</answer>", 0.1),
    ("</think>\n<answer>$(2+3)*4$</answer>", 0.1),
    ("</think>\n<answer>(2+3)*4</answer>\nSo the answer is 20.", 0.0),
    ("</think>\n<answer>2.0*3*4</answer>", 0.1),
    # more of the rule
    ("no tags at all", 0.0),
    ("<answer>(2+3)*4", 0.0),  # never closed
    ("<answer></answer>", 0.1),  # empty: an answer, not the numbers
    ("<answer>(2 + 3) * 4</answer><answer>2*3*4</answer>", 0.1),  # the last one counts
    ("<answer>2*3*4</answer> <answer>(2 + 3) * 4</answer>", 1.0),
    ("<answer>(2+3)*4</answer>\n", 0.0),  # the last line is empty
    ("<answer>(2+3)*\n4</answer>", 0.0),  # split over two lines
    ("<answer>(4 - 3 + 2 ** 2) * 4</answer>", 0.1),  # a number given once, used twice
    ("<answer>(2 + 3) * 4.</answer>", 1.0),  # a float literal, 20.0
    ("<answer>4 ** 2 + 3 + 2</answer>", 0.1),  # powers evaluate: 21
    ("<answer>(3 + 2) * 4 / 1</answer>", 0.1),  # 1 is not given
    ("<answer>(3 + 2) * 4 // 1</answer>", 0.1),
    ("<answer>4 // 3 * 20</answer>", 0.1),  # 20 is not given
    ("<answer>02 * 3 * 4</answer>", 0.1),  # Python refuses the leading zero
    ("<answer>(2 + 3) * 4 / (3 - 3)</answer>", 0.1),  # a number twice
    ("<answer>2 / (3 - 3) * 4</answer>", 0.1),  # division by zero
    ("<answer>((2 + 3)) * (4)</answer>", 1.0),
    ("<answer>-(-(2 + 3)) * 4</answer>", 1.0),
    ("<answer>(2+3)*4 </answer><|im_end|>", 1.0),  # what follows on the line is ignored
]


@pytest.mark.parametrize(("response", "expected"), TABLE)
def test_tinyzero_table(response: str, expected: float) -> None:
    assert tinyzero_rule(response, GT) == expected  # the table states TinyZero's rule
    assert default_compute_score("countdown", response, GT) == expected


PIECES = [
    *"234+-*/(). 0",
    "20",
    "24",
    "**",
    "//",
    "...",
    "=",
    "x",
    "$",
    "\t",
    "\r",
    "\x0c",
    "\u00a0",
    "\u0663",  # an Arabic-Indic three: a digit to \d, none to Python's parser
    "\n",
    "<answer>",
    "</answer>",
    "Assistant:",
]


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=24).map("".join),
    st.sampled_from([20, 24, 9, 1, 0.5]),
)
@example("<answer>(2+3)*4</answer>", 20)
@example("<answer>4**3**2</answer>", 262144)
@example("<answer>(0-4)**.3*2</answer>", 20)  # a complex power
def test_the_same_as_tinyzero_on_generated_responses(body: str, target: float) -> None:
    """Responses made of tags, lines, numbers and operators: which answer is read, and
    how it scores, as TinyZero reads and scores it."""
    truth = {"target": target, "numbers": [2, 3, 4]}
    response = body if "<answer>" in body else f"<answer>{body}</answer>"
    assert countdown.compute_score(response, truth) == tinyzero_rule(response, truth)


OPERATORS = ["+", "-", "*", "/", "**", "//"]
#: Pieces inserted into an equation: operators, and characters that break it.
NOISE = [*"+-*/() .0=x$\t\r\x0c", "**", "...", "\u00a0", "\u00d7", "\u0662"]


@st.composite
def equations(draw: st.DrawFn) -> str:
    """An equation over 2, 3 and 4 in any order, with random operators, parentheses and
    signs, and up to two random pieces inserted anywhere: most evaluate, some do not."""
    numbers = draw(st.permutations(["2", "3", "4"]))
    text = draw(st.sampled_from(["", "-"])) + numbers[0]
    for number in numbers[1:]:
        if draw(st.booleans()):
            text = f"({text})"
        operator = draw(st.sampled_from(OPERATORS))
        sign = draw(st.sampled_from(["", "", "-"]))
        if draw(st.booleans()):
            text = f"{text} {operator} {sign}{number}"
        else:
            text = f"{sign}{number}{operator}{text}"
    for piece in draw(st.lists(st.sampled_from(NOISE), max_size=2)):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + piece + text[at:]
    return text


@settings(max_examples=1500, deadline=None)
@given(equations())
@example("(2 + 3) * 4")
@example("4**3**2")
@example("(0-4)**.3*2")  # a complex power
def test_the_same_as_tinyzero_on_generated_equations(equation: str) -> None:
    """Each generated equation scores as TinyZero scores it, against its own value as the
    target (correct, when it is well-formed) and against another."""
    # A noise "0" beside a number under a power (4 ** 3 ** 20) makes a number of billions of
    # digits: this test's own eval (and TinyZero's rule) would run for hours.
    assume("**" not in equation or not re.search(r"\d\d", equation))
    response = f"<think>...</think>\n<answer>{equation}</answer>"
    try:
        value = eval(equation, {"__builtins__": None}, {})  # noqa: S307 - digits and operators
    except Exception:
        value = None
    targets = [20, value] if isinstance(value, (int, float)) else [20]
    for target in targets:
        truth = {"target": target, "numbers": [2, 3, 4]}
        assert countdown.compute_score(response, truth) == tinyzero_rule(response, truth)


def test_huge_powers_are_not_computed() -> None:
    """``eval`` would run for hours or run out of memory on the first two; a power over
    MAX_POWER_BITS bits fails to evaluate (0.1) at once. That is the one difference from
    TinyZero: a huge power that cancels out scores 0.1 here, 1.0 there, while one within
    the bound is computed as ``eval`` computes it."""
    start = time.monotonic()
    for equation, numbers in [("99**99**99", [99, 99, 99]), ("9**9**9**9", [9, 9, 9, 9])]:
        truth = {"target": 20, "numbers": numbers}
        assert countdown.compute_score(f"<answer>{equation}</answer>", truth) == 0.1
    assert time.monotonic() - start < 5
    over = "<answer>(2**99999)//(2**99999)*20</answer>"
    truth = {"target": 20, "numbers": [2, 99999, 2, 99999, 20]}
    assert (countdown.compute_score(over, truth), tinyzero_rule(over, truth)) == (0.1, 1.0)
    within = "<answer>2**60000-2**60000+20</answer>"
    truth = {"target": 20, "numbers": [2, 60000, 2, 60000, 20]}
    assert countdown.compute_score(within, truth) == tinyzero_rule(within, truth) == 1.0


def test_ground_truth_is_compared_as_the_row_holds_it() -> None:
    """TinyZero compares the given numbers as they are: floats equal to integers match;
    text does not (veRL files hold integers; a JSON-minded copy might hold text)."""
    assert (
        countdown.compute_score(
            "<answer>(2+3)*4</answer>", {"target": 20.0, "numbers": [2.0, 3, 4]}
        )
        == 1.0
    )
    assert (
        countdown.compute_score(
            "<answer>(2+3)*4</answer>", {"target": 20, "numbers": ["2", "3", "4"]}
        )
        == 0.1
    )
    assert (
        countdown.compute_score("<answer>(2+3)*4</answer>", {"target": "20", "numbers": [2, 3, 4]})
        == 0.1
    )
