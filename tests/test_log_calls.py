"""Every logging call in the project passes as many arguments as its message has ``%``
placeholders.

A mismatch does not raise where it is written: ``logging`` reports it when the record is
formatted, as a "--- Logging error ---" traceback in the role's log, and the line itself is
lost. The learner's "resumed from ..." line did that on every resume (four arguments, three
placeholders) until this test. Read from the source (no role has to run the call).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("asyncrl", "buffer", "learner", "rollout_servers", "benchmarks")
METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
LOGGERS = {"log", "logger", "_log", "LOG"}
# A conversion: %%, or %[flags][width][.precision]type (no mapping keys are used here).
PLACEHOLDER = re.compile(r"%%|%[-+ #0]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa]")


def _placeholders(msg: str) -> int:
    return sum(m.group() != "%%" for m in PLACEHOLDER.finditer(msg))


def _logging_calls(path: Path):
    """``(line, message, argument count)`` of each call ``<logger>.<method>("...", ...)``
    with a literal message and no ``*args``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in METHODS or not node.args:
            continue
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        first = node.args[0]
        if name not in LOGGERS or not isinstance(first, ast.Constant):
            continue
        if not isinstance(first.value, str) or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        yield node.lineno, first.value, len(node.args) - 1


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_the_scan_finds_the_projects_logging_calls():
    """The scan is not vacuous: it reads the 150-odd calls, and counts a known one right."""
    calls = [c for p in _sources() for c in _logging_calls(p)]
    assert len(calls) > 100
    restore = ROOT / "learner" / "restore.py"
    resumed = [c for c in _logging_calls(restore) if c[1].startswith("resumed from %s")]
    assert [(_placeholders(m), n) for _, m, n in resumed] == [(4, 4)]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_logging_call_has_as_many_arguments_as_placeholders(path):
    bad = [
        f"line {line}: {n} argument(s) for {_placeholders(msg)} placeholder(s) in {msg!r}"
        for line, msg, n in _logging_calls(path)
        if _placeholders(msg) != n
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("msg", "count"),
    [("a %s b %d", 2), ("100%% of %s", 1), ("%-8s|%5.2f|%r", 3), ("no placeholder", 0)],
)
def test_placeholders_are_counted_as_logging_formats_them(msg, count):
    assert _placeholders(msg) == count
    args = (1.0,) * count
    assert isinstance(msg % args, str)  # as many arguments as counted: it formats
    with pytest.raises(TypeError):  # one more: what logging reports as a logging error
        _ = msg % (*args, 1.0)
