"""One mutation row: the feature, the line that breaks it, and the tests that must fail."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    feature: str
    broken: str  # what the mutation does, in words
    path: str
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


#: The recovery tests many rows name.
T_RECOVERY = "tests/test_recovery_faults.py"
