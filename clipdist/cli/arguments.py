"""Argument types and helpers the subcommands share."""

from __future__ import annotations


def csv(cast):
    return lambda text: [cast(part) for part in text.split(",")]


def chunk_counts(text: str) -> list[int]:
    """--chunks: counts, or 'auto' (plan.AUTO, 0)."""
    return [0 if part.strip() == "auto" else int(part) for part in text.split(",")]


def batch_sizes(text: str) -> int | list[int]:
    sizes = csv(int)(text)
    return sizes[0] if len(sizes) == 1 else sizes
