"""Does a test fail when the feature it claims breaks? Each mutation (:mod:`tests.mutations`)
breaks one recovery or correctness feature in a scratch worktree of ``HEAD`` (one line
replaced) and runs the tests named for it; the feature counts as caught when at least one
of them fails.

Run from the repository root (prints the table ``tests/README.md`` records; a few minutes)::

    .venv/bin/python -m tests.mutation_check            # every mutation
    .venv/bin/python -m tests.mutation_check lag dedup  # those whose name contains a word

Exit status 1 when a mutation was not caught (or its line is gone: update the list), so a
new feature's row can be added to :mod:`tests.mutations` and checked the same way. Not collected
by pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.mutations import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parent.parent


def _run(m: Mutation) -> tuple[str, float]:
    """Apply ``m`` in a scratch worktree and run its tests: (the outcome, seconds)."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        tree = Path(scratch) / "tree"
        git = ["git", "-C", str(ROOT)]
        subprocess.run([*git, "worktree", "add", "--detach", "-q", str(tree), "HEAD"], check=True)
        try:
            target = tree / m.path
            text = target.read_text()
            if text.count(m.old) != 1:
                return "line not found (update the mutation)", 0.0
            target.write_text(text.replace(m.old, m.new))
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
            start = time.monotonic()
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            took = time.monotonic() - start
            failed = [
                ln
                for ln in proc.stdout.splitlines()
                if ln.startswith(("FAILED tests/", "ERROR tests/"))
            ]
            if proc.returncode == 0:
                return "NOT CAUGHT", took
            return (failed[0].split(" - ")[0] if failed else f"exit {proc.returncode}"), took
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=False)


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or any(w in m.feature for w in argv)]
    print("| feature | what was broken | test that failed | seconds |")
    print("|---|---|---|---|")
    missed = 0
    for m in chosen:
        outcome, took = _run(m)
        missed += outcome.startswith(("NOT CAUGHT", "line not found"))
        print(f"| {m.feature} | {m.broken} | {outcome} | {took:.0f} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
