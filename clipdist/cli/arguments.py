"""Argument types and helpers the subcommands share."""

from __future__ import annotations

import argparse


def csv(cast):
    return lambda text: [cast(part) for part in text.split(",")]


def chunk_counts(text: str) -> list[int]:
    """--chunks: counts, or 'auto' (plan.AUTO, 0)."""
    return [0 if part.strip() == "auto" else int(part) for part in text.split(",")]


def batch_sizes(text: str) -> int | list[int]:
    sizes = csv(int)(text)
    return sizes[0] if len(sizes) == 1 else sizes


def given(args: argparse.Namespace, *names: str) -> dict:
    """The options the user gave (argparse.SUPPRESS leaves the others out): the called function's own
    defaults apply to the rest, so no default is written twice."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
