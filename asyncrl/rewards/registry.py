"""Which scorer handles which ``data_source``, and loading a user's own scorer.

Scorers follow veRL's signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict return must carry a ``"score"`` key; its other numeric entries are reported as
reward parts (veRL logs them as ``reward_extra_info``).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.sandbox.pyfile import import_file
from asyncrl.tasks import arithmetic, calculator, countdown, gsm8k

logger = logging.getLogger(__name__)

#: A scorer with veRL's signature.
ScoreFn = Callable[..., Any]

_BUILTIN: dict[str, Callable[[str, Any], float]] = {
    arithmetic.DATA_SOURCE: arithmetic.compute_score,
    calculator.DATA_SOURCE: calculator.compute_score,
    countdown.DATA_SOURCE: countdown.compute_score,
    **{name: gsm8k.compute_score for name in gsm8k.DATA_SOURCES},
}

#: The data sources :func:`default_compute_score` knows.
KNOWN_DATA_SOURCES: tuple[str, ...] = tuple(sorted(_BUILTIN))


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Score one response with the built-in scorer for its ``data_source``.

    Raises:
        KeyError: For a data source without a built-in scorer; the message says how to
            plug in a custom one.
    """
    scorer = _BUILTIN.get(data_source)
    if scorer is None:
        raise KeyError(
            f"no built-in reward for data_source={data_source!r} (known: "
            f"{', '.join(KNOWN_DATA_SOURCES)}); set reward.custom_reward_function.path to a "
            "Python file defining compute_score(data_source, solution_str, ground_truth, "
            "extra_info=None)"
        )
    return float(scorer(solution_str, ground_truth))


def check_custom_path(path: str | Path) -> Path:
    """Return ``path`` as a Path if it is an existing file, else raise a ValueError with a fix."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(
            f"reward.custom_reward_function.path={str(path)!r} is not a file; "
            "point it at your scorer's .py file or unset it to use the built-in rewards"
        )
    return file


def load_custom_scorer(
    path: str | Path, name: str = "compute_score", bound: dict[str, Any] | None = None
) -> ScoreFn:
    """Import a Python file by path and return its function ``name``.

    The file runs once per process that loads it (each reward worker loads it at start).
    ``bound``: the keyword arguments the caller will bind (``reward_kwargs``).

    Raises:
        ValueError: When the file is missing, fails to import, has no callable ``name``, or
        that function cannot take a scorer's arguments.
    """
    file = check_custom_path(path).resolve()
    try:
        module = import_file(file, "asyncrl_custom_reward")
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(
            f"importing reward file {file} failed: {type(exc).__name__}: {exc}; "
            "fix the file (run `python <file>` to see the full traceback)"
        ) from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(
            f"reward file {file} has no function {name!r}; define it or set "
            "reward.custom_reward_function.name to the function's name"
        )
    _check_signature(function, f"{file}: {name}", bound or {})
    logger.info("loaded custom reward %s from %s", name, file)
    return function


def _check_signature(function: ScoreFn, where: str, bound: dict[str, Any]) -> None:
    """Refuse a scorer that cannot take the keyword arguments every call passes (veRL's
    ``data_source, solution_str, ground_truth, extra_info``, and ``bound``): each call
    would raise, and the whole run would train on zero rewards."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    args = dict.fromkeys(("data_source", "solution_str", "ground_truth", "extra_info"))
    try:
        signature.bind(**args, **bound)
    except TypeError as e:
        raise ValueError(
            f"reward file {where}{signature} cannot be called as every scorer is, with the "
            f"keyword arguments {', '.join([*args, *bound])} ({e}): add the missing "
            "parameters (or **kwargs)"
        ) from None


#: At most this many distinct dropped reward parts are logged per process.
MAX_LOGGED_PARTS = 32
_logged_parts: set[tuple[str, str]] = set()


def _describe(value: Any) -> str:
    """``type repr`` of ``value`` for an error message, cut to 80 characters (a repr can
    itself raise: an int of more than 4300 digits refuses to become a string)."""
    try:
        text = repr(value)
    except Exception:
        text = "<unprintable>"
    return f"{type(value).__name__} {text[:80]}"


def finite_number(value: Any, what: str = "") -> float:
    """``value`` as a finite float; else an error that reads after "returned" (``what``:
    where in the return value it was, e.g. ``dict['score'] = ``).

    Anything veRL could write into its reward tensor is a number here: Python and numpy
    scalars (bools included, ``np.bool_`` is no ``numbers.Real``), 0-d numpy arrays and 0-d
    tensors. Tensors are duck-typed (``.ndim``, ``.item()``) so reward workers never import
    torch. Strings are refused although ``float("1")`` works: veRL's tensor write refuses
    them too.

    Raises:
        TypeError: Not a single number.
        ValueError: NaN, infinite, or an int too large for a float.
    """
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what}{_describe(value)}, not a number")
    ndim = getattr(value, "ndim", 0)
    if ndim != 0:
        raise TypeError(f"{what}{_describe(value)} with {ndim} dimensions, not a single number")
    try:
        item = value.item() if hasattr(value, "item") else value
        if isinstance(item, (str, bytes)):  # a 0-d array of strings
            raise TypeError
        result = float(item)
    except OverflowError:
        raise ValueError(f"{what}{_describe(value)}, too large for a float") from None
    except Exception:
        raise TypeError(f"{what}{_describe(value)}, not a number") from None
    if not math.isfinite(result):
        raise ValueError(f"{what}{result}, not a finite number")
    return result


def _drop_part(key: str, part: Any, reason: str) -> None:
    """Log a reward part that is left out, once per key and type: a part the user meant as
    a metric (DAPO's ``filter_groups.metric=acc``) must not vanish without a word."""
    variant = (key, type(part).__name__)
    if variant in _logged_parts or len(_logged_parts) >= MAX_LOGGED_PARTS:
        return
    _logged_parts.add(variant)
    logger.warning(
        "reward part %r left out: %s; return a finite number for it to be logged "
        "(logged once per key and type)",
        key,
        reason,
    )


def normalize_score(value: Any) -> tuple[float, dict[str, float]]:
    """Turn a scorer's return value into ``(score, parts)``.

    A number (as :func:`finite_number` reads one) is the score. A dict must hold a numeric
    ``"score"``; its other numeric entries become parts. Each part is converted on its own,
    so one that is not a finite number is left out without costing the sample its score.
    Strings and None are left out silently (veRL scorers often return e.g. a parsed
    prediction, or None when there is none); anything else is logged once.

    Raises:
        TypeError: The value (or its ``"score"``) is not a number.
        ValueError: It is NaN or infinite, or a dict lacks ``"score"``.
    """
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"dict without a 'score' key (keys: {sorted(map(str, value))})")
        score = finite_number(value["score"], "dict['score'] = ")
        parts = {}
        for key, part in value.items():
            if key == "score" or part is None or isinstance(part, (str, bytes)):
                continue
            try:
                parts[str(key)] = finite_number(part)
            except Exception as exc:
                _drop_part(str(key), part, str(exc))
        return score, parts
    return finite_number(value), {}
