"""Which scorer handles which ``data_source``, and loading a user's own scorer.

Scorers follow veRL's signature::

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict return must carry a ``"score"`` key; its other numeric entries are reported as
reward parts (veRL logs them as ``reward_extra_info``).

veRL's ``reward_model.reward_manager`` decides how a scorer is called (:data:`REWARD_MANAGERS`):
``naive`` and ``dapo`` pass the four arguments by keyword and take the return as it is;
``prime`` (PRIME's manager) passes them by position and keeps the first element of a tuple
or list, as PRIME-style scorers return ``(score, metadata)``.
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
from asyncrl.wire.types import MAX_ABS_REWARD, MAX_SHORT_STR, usable_reward

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

#: veRL's per-response reward managers (``reward_model.reward_manager``) scorers run under.
REWARD_MANAGERS: tuple[str, ...] = ("naive", "prime", "dapo")
#: The manager that calls a scorer by position and reads a tuple's or list's first element.
POSITIONAL_MANAGER = "prime"
#: The scorer's arguments, in the order veRL passes them.
SCORER_ARGS: tuple[str, ...] = ("data_source", "solution_str", "ground_truth", "extra_info")
#: The parameters of a scorer for veRL's ``batch`` manager, which gets lists of each.
BATCH_ARGS: tuple[str, ...] = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def check_reward_manager(reward_manager: str) -> str:
    """``reward_manager`` if it is one of :data:`REWARD_MANAGERS`, else a ValueError."""
    if reward_manager not in REWARD_MANAGERS:
        raise ValueError(
            f"reward manager {reward_manager!r} is not one of {', '.join(REWARD_MANAGERS)}: "
            "scorers here are called once per response, as those managers call them"
        )
    return reward_manager


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
    path: str | Path,
    name: str = "compute_score",
    bound: dict[str, Any] | None = None,
    reward_manager: str = "naive",
) -> ScoreFn:
    """Import a Python file by path and return its function ``name``.

    The file runs once per process that loads it (each reward worker loads it at start).
    ``bound``: the keyword arguments the caller will bind (``reward_kwargs``).
    ``reward_manager``: how the function will be called (see the module docstring).

    Raises:
        ValueError: When the file is missing, fails to import, has no callable ``name``, or
        that function cannot take a scorer's arguments.
    """
    check_reward_manager(reward_manager)
    file = check_custom_path(path).resolve()
    try:
        module = import_file(file, "asyncrl_custom_reward")
    except ValueError:
        raise
    except Exception as exc:
        hint = verl_import_hint(exc)
        if hint is not None:
            raise ValueError(f"reward file {file} {hint}") from exc
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
    _check_signature(function, f"{file}: {name}", bound or {}, reward_manager)
    logger.info("loaded custom reward %s from %s", name, file)
    return function


def verl_import_hint(exc: BaseException) -> str | None:
    """What to say of a scorer that failed for want of veRL (``from verl.utils.reward_score
    import ...``), which is not installed here; None for any other failure. It reads after
    "reward file X"."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if not missing or missing.split(".")[0] != "verl":
        return None
    return (
        f"imports veRL ({type(exc).__name__}: {exc}): veRL's built-in scorers are not shipped "
        f"here. The built-in scorers here cover data_source {', '.join(KNOWN_DATA_SOURCES)} "
        "(used when reward.custom_reward_function.path is unset); for any other, the file "
        "must carry its own copy of the scoring rule it imported from veRL "
        "(verl/utils/reward_score/<name>.py) rather than import it"
    )


def _check_signature(
    function: ScoreFn, where: str, bound: dict[str, Any], reward_manager: str = "naive"
) -> None:
    """Refuse a scorer that cannot take the arguments every call passes (veRL's
    ``data_source, solution_str, ground_truth, extra_info``, by keyword or, under the prime
    manager, by position; and ``bound`` by keyword): each call would raise, and the whole
    run would train on zero rewards. A scorer for veRL's batch manager is refused whatever
    the manager: called by position it would take one response's text for a list of them."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    if set(signature.parameters) & set(BATCH_ARGS):
        raise ValueError(f"reward file {where}{signature} {_batch_fix(function)}")
    positional = reward_manager == POSITIONAL_MANAGER
    try:
        if positional:
            signature.bind(*SCORER_ARGS, **bound)
        else:
            signature.bind(**dict.fromkeys(SCORER_ARGS), **bound)
    except TypeError as e:
        problem = _signature_problem(signature, bound, positional, str(e))
        raise ValueError(f"reward file {where}{signature} {problem}") from None


def _batch_fix(function: ScoreFn) -> str:
    """What to do with a scorer for veRL's batch manager, which passes lists: here each
    response is scored on its own, so a one-line wrapper that scores a list of one ports
    it. It reads after the file, the function's name and its signature."""
    batch = getattr(function, "__name__", "compute_score")
    return (
        f"is a scorer for veRL's batch manager (it takes lists: {', '.join(BATCH_ARGS)}); "
        "scorers here score one response per call. Add a per-sample function to the file and "
        "name it in reward.custom_reward_function.name, e.g. def score_one(data_source, "
        "solution_str, ground_truth, extra_info=None, **kwargs): return "
        f"{batch}([data_source], [solution_str], [ground_truth], [extra_info], **kwargs)[0]"
    )


def _signature_problem(
    signature: inspect.Signature, bound: dict[str, Any], positional: bool, error: str
) -> str:
    """Why a scorer of this ``signature`` cannot be called (``error``: what binding its
    arguments said), and the fix; it reads after the file, the function's name and its
    signature."""
    names = ", ".join(SCORER_ARGS)
    if positional:
        return (
            f"cannot be called as veRL's prime manager calls a scorer, with the positional "
            f"arguments {names} and the keyword arguments {', '.join(bound) or '(none)'} "
            f"({error}): add the missing parameters (or **kwargs)"
        )
    keywords = ", ".join([*SCORER_ARGS, *bound])
    try:
        signature.bind(*SCORER_ARGS, **bound)
    except TypeError:
        return (
            f"cannot be called as every scorer is, with the keyword arguments {keywords} "
            f"({error}): add the missing parameters (or **kwargs)"
        )
    # It takes them by position: written for veRL's prime manager.
    return (
        f"cannot be called as every scorer is, with the keyword arguments {keywords} "
        f"({error}): veRL's naive and dapo managers pass them by keyword, so name the "
        f"parameters {names}; its prime manager passes them by position, as "
        "reward_model.reward_manager=prime does here"
    )


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
        ValueError: NaN, infinite, or too large for float32 (the learner's rewards).
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
    if not usable_reward(result):  # the learner holds rewards in float32
        raise ValueError(f"{what}{result:g}, beyond the learner's float32 (+-{MAX_ABS_REWARD:.4g})")
    return result


def _drop_part(
    key: str, part: Any, reason: str, fix: str = "return a finite number for it to be logged"
) -> None:
    """Log a reward part that is left out, once per key and type: a part the user meant as
    a metric (DAPO's ``filter_groups.metric=acc``) must not vanish without a word."""
    variant = (key, type(part).__name__)
    if variant in _logged_parts or len(_logged_parts) >= MAX_LOGGED_PARTS:
        return
    _logged_parts.add(variant)
    logger.warning(
        "reward part %r left out: %s; %s (logged once per key and type)", key, reason, fix
    )


def normalize_score(value: Any, reward_manager: str = "naive") -> tuple[float, dict[str, float]]:
    """Turn a scorer's return value into ``(score, parts)``.

    A number (as :func:`finite_number` reads one) is the score. A dict must hold a numeric
    ``"score"``; its other numeric entries become parts. Each part is converted on its own,
    so one that is not a finite number is left out without costing the sample its score.
    Strings and None are left out silently (veRL scorers often return e.g. a parsed
    prediction, or None when there is none); anything else is logged once. Under the prime
    manager a tuple or list scores its first element, as veRL's prime manager reads one;
    the naive and dapo managers write the return into the reward tensor as it is, which
    refuses a tuple, so they refuse it here too (a list of scores, say, is not read as its
    first one).

    Raises:
        TypeError: The value (or its ``"score"``) is not a number.
        ValueError: It is NaN or infinite, or a dict lacks ``"score"``.
    """
    if isinstance(value, (tuple, list)):
        if reward_manager != POSITIONAL_MANAGER:
            raise TypeError(
                f"{_describe(value)}, not a number (veRL's prime manager reads the first "
                "element of a tuple or list: reward_model.reward_manager=prime; its naive and "
                "dapo managers do not)"
            )
        if not value:
            raise ValueError(f"an empty {type(value).__name__}, no score")
        return finite_number(value[0], f"{type(value).__name__}[0] = "), {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"dict without a 'score' key (keys: {sorted(map(str, value))})")
        score = finite_number(value["score"], "dict['score'] = ")
        parts = {}
        for key, part in value.items():
            if key == "score" or part is None or isinstance(part, (str, bytes)):
                continue
            name = str(key)
            if len(name) > MAX_SHORT_STR:  # a trajectory could not carry it: its group was lost
                shown = name[:64] + "..."
                why = f"its name has {len(name)} characters"
                _drop_part(shown, part, why, f"name it in at most {MAX_SHORT_STR}")
                continue
            try:
                parts[name] = finite_number(part)
            except Exception as exc:
                _drop_part(name, part, str(exc))
        return score, parts
    return finite_number(value), {}
