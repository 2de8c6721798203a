"""Two demo tools, exact integer ``add`` and ``mul``: the smallest useful multi-turn setup.

A model that cannot multiply big numbers in its head can learn to call ``mul`` instead.
Arguments ``a`` and ``b`` are integers or integer strings (models often quote numbers);
anything else gets an error text back, which the model sees and can learn from.
"""

from __future__ import annotations

import re
from typing import Any

from asyncrl.tools.base import BaseTool

#: Digits allowed per argument: keeps a product far below Python's int-to-str limit.
MAX_DIGITS = 1000
_INTEGER = re.compile(r"[+-]?\d+")


def parse_integer(value: Any, name: str) -> int:
    """``value`` as an int if it is one (or an integer string); ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name} must be an integer, got {value!r:.40}")
    text = str(value).strip()
    if not _INTEGER.fullmatch(text):
        raise ValueError(f"{name} must be an integer, got {value!r:.40}")
    if len(text.lstrip("+-")) > MAX_DIGITS:
        raise ValueError(f"{name} has more than {MAX_DIGITS} digits")
    return int(text)


class _IntegerPairTool(BaseTool):
    """A tool computing an exact integer from arguments ``a`` and ``b``."""

    def compute(self, a: int, b: int) -> int:
        raise NotImplementedError

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str | dict, float, dict]:
        """Return the result as text, or an ``Error: ...`` text for bad arguments."""
        try:
            a = parse_integer(parameters.get("a"), "a")
            b = parse_integer(parameters.get("b"), "b")
        except ValueError as exc:
            return f"Error: {exc}", 0.0, {}
        return str(self.compute(a, b)), 0.0, {}


class AddTool(_IntegerPairTool):
    """``a + b``, exactly."""

    def compute(self, a: int, b: int) -> int:
        return a + b


class MulTool(_IntegerPairTool):
    """``a * b``, exactly."""

    def compute(self, a: int, b: int) -> int:
        return a * b
