"""The mutations :mod:`tests.mutation_check` runs: each breaks one recovery or correctness
feature by replacing one line, and names the tests that must then fail. A new feature's row
goes in the module of the package its line is in (its ``old`` line must occur exactly once
in its file)."""

from __future__ import annotations

from tests.mutations import (
    benchmarks,
    buffer,
    config,
    control,
    launch,
    learner,
    net,
    prepare,
    rollout,
    sandbox,
    sync,
)
from tests.mutations.row import Mutation

MUTATIONS: tuple[Mutation, ...] = (
    *control.ROWS,
    *sync.ROWS,
    *net.ROWS,
    *buffer.ROWS,
    *learner.ROWS,
    *rollout.ROWS,
    *sandbox.ROWS,
    *config.ROWS,
    *launch.ROWS,
    *prepare.ROWS,
    *benchmarks.ROWS,
)

__all__ = ["MUTATIONS", "Mutation"]
