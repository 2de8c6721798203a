"""House rules that are cheaper to check than to review: the coordinator is reached only
through its public methods."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("asyncrl", "buffer", "learner", "rollout_servers", "benchmarks", "tests")
CONTROL = ROOT / "asyncrl" / "control"
# A coordinator's insides: its state (registry, ledger, budget) lives behind its lock.
PRIVATE = {"_state", "_loop", "_lock"}


def _private_reads(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            owner = ast.unparse(node.value)
            if owner != "self" and "coord" in owner.lower():
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Attribute) and node.attr in ("state", "ledger"):
            owner = ast.unparse(node.value)
            if "coord" in owner.lower():
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_control_package_reads_a_coordinators_insides():
    files = [
        p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if CONTROL not in p.parents and p != Path(__file__).resolve()
    ]
    assert len(files) > 50
    found = [line for p in files for line in _private_reads(p)]
    assert not found, "use the coordinator's public methods instead:\n" + "\n".join(found)


def test_the_check_finds_a_private_read(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("def f(coordinator):\n    return coordinator.state.ledger.source\n")
    assert _private_reads(bad, tmp_path) == [
        "probe.py:2: coordinator.state.ledger",
        "probe.py:2: coordinator.state",
    ]
