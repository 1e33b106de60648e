"""The size of the clipdist package at a git revision: its modules, their non-blank non-comment lines, and the same
without docstrings (the house issue's measure).

Usage: python scripts/package_size.py [REV ...]   (default HEAD; e.g. `python scripts/package_size.py f333aaa HEAD`)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def counts(source: str) -> tuple[int, int]:
    """(non-blank non-comment lines, the same less the lines of module, class and function docstrings)."""
    lines = source.splitlines()
    code = {number for number, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#")}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return len(code), len(code)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(code), len(code - docstrings)


def package_size(revision: str) -> tuple[int, int, int]:
    """(modules, lines, lines without docstrings) of clipdist/ at `revision`."""
    git = ["git", "-C", str(REPO)]
    files = subprocess.run(
        [*git, "ls-tree", "-r", "--name-only", revision, "clipdist"], capture_output=True, text=True, check=True
    ).stdout.split()
    modules = [name for name in files if name.endswith(".py")]
    total = bare = 0
    for name in modules:
        source = subprocess.run([*git, "show", f"{revision}:{name}"], capture_output=True, text=True, check=True).stdout
        lines, without = counts(source)
        total, bare = total + lines, bare + without
    return len(modules), total, bare


if __name__ == "__main__":
    for revision in sys.argv[1:] or ["HEAD"]:
        modules, lines, bare = package_size(revision)
        print(f"{revision}: {modules} modules, {lines:,} non-blank non-comment lines, {bare:,} without docstrings")
