"""The one error a config that cannot run raises (its own module: the loader and the
override reader both raise it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run; ``str(err)`` lists every problem with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n  - " + "\n  - ".join(problems))
