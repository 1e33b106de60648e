"""The docs stay true to the tests: every test function and test file README.md and docs/ name exists."""
from __future__ import annotations

import re

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEST_FILES = sorted((REPO / "tests").rglob("test_*.py"))


def cited(pattern: str) -> dict[str, list[str]]:
    """Each match of `pattern` in the docs, with the pages that cite it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for name in re.findall(pattern, page.read_text()):
            found.setdefault(name, []).append(page.name)
    return found


def test_every_test_named_in_the_docs_exists():
    defined = {name for path in TEST_FILES for name in re.findall(r"(?m)^\s*def (test_\w+)\(", path.read_text())}
    names = cited(r"\b(test_\w+)\b(?!\.py)")
    assert names, "the docs name no test: the pattern is wrong"
    missing = {name: pages for name, pages in names.items() if name not in defined}
    assert not missing, f"the docs name tests that do not exist: {missing}"


def expand(path: str) -> list[str]:
    """'tests/{unit,integration}/test_x.py' -> both paths."""
    match = re.search(r"\{([\w,]+)\}", path)
    if not match:
        return [path]
    return [expanded for part in match.group(1).split(",")
            for expanded in expand(path[:match.start()] + part + path[match.end():])]


def test_every_test_file_named_in_the_docs_exists():
    paths = cited(r"\b(tests/(?:\{[\w,]+\}|[\w/])+\.py)\b")
    assert any("{" in path for path in paths) and paths, "the docs name no test file (or none in both): the pattern is wrong"
    missing = {path: pages for path, pages in paths.items() if not all((REPO / one).is_file() for one in expand(path))}
    assert not missing, f"the docs name test files that do not exist: {missing}"
