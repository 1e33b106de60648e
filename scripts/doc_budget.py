"""How long the docs are: words per page and the median sentence, for README.md and docs/*.md (docs/bench/ holds
measurement records and is not counted). `python scripts/doc_budget.py` prints a page a line; tests/unit/test_docs.py
holds the budget (32,000 words, a median sentence under 25 words).

Words are whitespace-separated tokens of the whole page, code and tables included (what `wc -w` counts). Sentences
are counted in prose only: code blocks, tables and headings are left out, each list item starts a sentence, and a
sentence ends at `.`, `!` or `?` followed by a capital, a backtick, a bracket or a quote."""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = 32_000
MEDIAN_SENTENCE = 25


def pages(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The page without code blocks, tables and headings; every list item a paragraph of its own."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            kept.append("")
        elif fenced or line.lstrip().startswith(("|", "#")):
            kept.append("")
        else:
            kept.append(re.sub(r"^\s*(?:[-*]|\d+\.)\s+", "\n", line))
    return "\n".join(kept)


def sentence_lengths(text: str) -> list[int]:
    lengths = []
    for paragraph in re.split(r"\n\s*\n", prose(text)):
        flat = " ".join(paragraph.split())
        lengths += [len(part.split()) for part in re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"*\[])", flat) if part.split()]
    return lengths


def measure(paths: list[Path]) -> dict[str, tuple[int, list[int]]]:
    texts = {str(path.relative_to(REPO)): path.read_text() for path in paths}
    return {name: (len(text.split()), sentence_lengths(text)) for name, text in texts.items()}


def main() -> int:
    measured = measure(pages())
    for name, (words, lengths) in measured.items():
        print(f"{words:6,d} words, median sentence {statistics.median(lengths):4.1f} words  {name}")
    words = sum(count for count, _ in measured.values())
    median = statistics.median([length for _, lengths in measured.values() for length in lengths])
    print(f"{words:6,d} words (budget {WORDS:,}), median sentence {median} words (under {MEDIAN_SENTENCE})")
    return 0 if words <= WORDS and median < MEDIAN_SENTENCE else 1


if __name__ == "__main__":
    sys.exit(main())
