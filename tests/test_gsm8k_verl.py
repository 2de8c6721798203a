"""The built-in gsm8k scorer gives veRL's scores (``verl/utils/reward_score/gsm8k.py``),
which a veRL user's reward curves are compared against.

Each expected value below is what veRL's ``compute_score`` returns for that response: it
reads the last 300 characters, takes the number after the last ``"#### "`` (strict) or
the last run of digits, dots and commas (flexible), and compares it to the ground truth
as a string. ``format_score`` is 0.5 in the table so that "no answer" (0.0), "another
answer" (0.5) and "right" (1.0) read apart.
"""

from __future__ import annotations

import pytest

from asyncrl.rewards import default_compute_score
from asyncrl.tasks import gsm8k

NONE, WRONG, RIGHT = 0.0, 0.5, 1.0
# No digit, dot or comma, so nothing in it is an answer; 350 characters.
FILLER = "\nlet me double check this once more" * 10

STRICT = [
    ("#### 72", "72", RIGHT),
    ("48 + 24 = 72 clips\n#### 72", "72", RIGHT),
    ("#### 72\n", "72", RIGHT),
    ("#### 72 and 5", "72", RIGHT),  # only the run of digits right after "#### "
    ("####72", "72", NONE),  # exactly one space after ####
    ("####  72", "72", NONE),
    ("####\n72", "72", NONE),
    ("#### $72", "72", NONE),  # "$" is not in veRL's pattern
    ("#### 72.", "72", WRONG),  # the dot is part of the answer
    ("#### 72.0", "72", WRONG),  # strings, not numbers, are compared
    ("#### 072", "72", WRONG),
    ("#### .", "72", WRONG),  # a lone dot is an answer in strict mode
    ("#### 1,000", "1000", RIGHT),  # commas are removed in strict mode
    ("#### 72,000", "72000", RIGHT),
    ("#### -5", "-5", RIGHT),
    ("#### -72", "72", WRONG),
    ("#### - 5", "-5", NONE),
    ("#### 5 then later #### 72", "72", RIGHT),  # the last #### counts
    ("#### 72 then later #### 5", "72", WRONG),
    ("the answer is 72", "72", NONE),
    ("", "72", NONE),
    ("#### 72" + FILLER, "72", NONE),  # the answer lies before the last 300 characters
    ("x" * 1000 + "\n#### 72", "72", RIGHT),  # a long start does not matter
]

FLEXIBLE = [
    ("the answer is 72", "72", RIGHT),
    ("#### 72", "72", RIGHT),
    ("it costs $72", "72", RIGHT),
    ("so 70, no: -72", "-72", RIGHT),
    ("the answer is 72.", "72", WRONG),  # the sentence's dot is kept
    ("1,000 apples", "1000", WRONG),  # commas are kept in flexible mode
    ("1000 apples", "1000", RIGHT),
    ("48 + 24 = 72, so 72 clips", "72", RIGHT),
    ("no numbers", "72", NONE),
    ("no numbers, sorry", "72", WRONG),  # a lone comma is an answer
    ("Done.", "72", WRONG),  # only dots: veRL returns "." rather than nothing
    ("72" + FILLER, "72", NONE),
]


@pytest.mark.parametrize(("response", "truth", "expected"), STRICT)
def test_strict_scores_equal_verl(response: str, truth: str, expected: float) -> None:
    assert gsm8k.compute_score(response, truth, format_score=WRONG) == expected


@pytest.mark.parametrize(("response", "truth", "expected"), FLEXIBLE)
def test_flexible_scores_equal_verl(response: str, truth: str, expected: float) -> None:
    got = gsm8k.compute_score(response, truth, method="flexible", format_score=WRONG)
    assert got == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [("#### 72", 1.0), ("#### 72.", 0.0), ("#### $72", 0.0), ("#### 72" + FILLER, 0.0)],
)
def test_the_built_in_scorer_uses_verls_defaults(response: str, expected: float) -> None:
    """What a run scores with: strict, format_score 0, score 1, as veRL's defaults."""
    for source in gsm8k.DATA_SOURCES:
        assert default_compute_score(source, response, "72") == expected


def test_score_and_format_score_are_used_as_given() -> None:
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0


@pytest.mark.parametrize(
    "truth", ["72", "She sold 48 + 24 = 72 clips.\n#### 72", "#### 72", " 72\n", "$72"]
)
def test_a_full_answer_line_as_ground_truth_is_reduced_to_its_number(truth: str) -> None:
    """The ground truth side stays lenient (the README promises the original solution's
    ``#### 72`` line works); veRL's files hold the bare number, which it leaves alone."""
    assert gsm8k.extract_ground_truth(truth) == "72"
    assert gsm8k.compute_score("so\n#### 72", truth) == 1.0


def test_an_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 72", "72", method="fuzzy")  # type: ignore[arg-type]
