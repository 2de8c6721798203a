"""Reading and scoring gsm8k-style data in veRL's layout.

Nothing is downloaded: users bring parquet files made by veRL's ``gsm8k.py`` preprocessing
(``data_source = "openai/gsm8k"``, ground truth = the text after ``####`` in the original
answer) or build rows themselves with :func:`make_row`.

Scoring is exactly veRL's ``verl/utils/reward_score/gsm8k.py``, so a veRL user's reward
curves compare one to one: only the response's last 300 characters are read; the answer is
the number after the last ``"#### "`` (one space: "strict") or the last run of digits, dots
and commas anywhere ("flexible"), and it must equal the ground truth as a string. So
``"####72"``, ``"#### $72"``, ``"#### 72."`` and ``"#### 72.0"`` do not match ``"72"``, as in
veRL. Only the ground truth is read leniently (:func:`extract_ground_truth`); veRL's files
hold the bare number, which that leaves as it is. A scorer that forgives formatting is a
custom one (``custom_reward_function.path``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from asyncrl.tasks.schema import make_row as _make_verl_row

DATA_SOURCE = "openai/gsm8k"
DATA_SOURCES = ("openai/gsm8k", "gsm8k")
ABILITY = "math"

#: veRL appends this to every question so the model knows where to put its answer.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

Method = Literal["strict", "flexible"]

#: veRL reads only the response's tail ("the final answer is usually at the end"), so an
#: answer followed by more than this many characters of text scores 0 there, and here.
SOLUTION_CLIP_CHARS = 300

# veRL's patterns: exactly one space after "####", and no "$"; a run of digits, dots and
# commas (a lone "," or "." included) for flexible.
_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE_RE = re.compile(r"-?[0-9.,]+")


def make_row(
    question: str,
    answer: str,
    *,
    split: str,
    index: int,
    data_source: str = DATA_SOURCE,
) -> dict[str, Any]:
    """Build a row exactly as veRL's gsm8k preprocessing does.

    Args:
        question: The problem text (the instruction is appended).
        answer: The full original answer ending in ``#### <number>``, or the bare number.
        split: ``"train"`` or ``"test"``.
        index: Position in the split.
        data_source: ``"openai/gsm8k"`` as in veRL.
    """
    content = f"{question} {INSTRUCTION}"
    extra = {"answer": answer, "question": question}
    return _make_verl_row(
        data_source,
        content,
        extract_ground_truth(answer),
        split=split,
        index=index,
        ability=ABILITY,
        extra_info=extra,
    )


def read_gsm8k(path: str | Path, *, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Read a gsm8k-style parquet file (veRL's layout) into plain Python rows."""
    # Imported here so scoring (which runs in light reward workers) does not load pyarrow.
    from asyncrl.tasks.parquet import read_rows

    return read_rows(path, prompt_key=prompt_key)


def _clean(text: str) -> str:
    """Drop thousands separators, dollar signs, surrounding space and a sentence's final dot."""
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def extract_ground_truth(ground_truth: Any) -> str:
    """Return the reference answer: the text after the last ``####`` if present, cleaned.

    Lenient on purpose: the README promises that the original solution's full ``#### 1,234``
    line works as a ground truth. veRL's preprocessing writes the bare number (``1234``),
    which passes unchanged, so scores still equal veRL's on its files.
    """
    text = str(ground_truth)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return _clean(text)


def extract_answer(solution_str: str, method: Method = "strict") -> str | None:
    """Return the model's answer as veRL's ``extract_solution`` does, or None when it gave none.

    ``strict`` takes the number after the last ``"#### "`` with its commas removed;
    ``flexible`` takes the last match of digits, dots and commas that is not a lone ``"."``,
    commas kept (veRL removes them only in strict mode).
    """
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT_RE.findall(tail)
        return matches[-1].replace(",", "") if matches else None
    if method == "flexible":
        matches = _FLEXIBLE_RE.findall(tail)
        if not matches:
            return None
        # When every match is ".", veRL's loop ends on the first one and returns "." (a
        # wrong answer, worth format_score), not None.
        return next((m for m in reversed(matches) if m != "."), matches[0])
    raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")


def compute_score(
    solution_str: str,
    ground_truth: Any,
    *,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Score a gsm8k response as veRL does: ``score`` if its answer equals the ground truth
    as a string, ``format_score`` if it gave another answer, 0.0 if it gave none.

    ``ground_truth`` may be the bare answer (veRL's files) or a full answer with ``#### 42``.
    """
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == extract_ground_truth(ground_truth) else format_score
