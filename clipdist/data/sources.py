"""Which shards a run reads: a built-in dataset's cache, or the user's shard specs — resolved once, before any rank starts."""
from __future__ import annotations

from dataclasses import dataclass, field

from clipdist.data.builtin import builtin_shards, classnames_of
from clipdist.data.pipeline import expand_shards


@dataclass(frozen=True)
class Shards:
    """Local paths / URLs of the training and validation shards, and the zero-shot class names."""

    train: list[str]
    val: list[str] | None = None
    classnames: list[str] = field(default_factory=list)


def resolve_shards(data) -> Shards:
    """Shards for a DataConfig: a built-in source is written to its cache on first use (race-free);
    user specs are brace-expanded and checked to exist. Raises ValueError / FileNotFoundError."""
    if data.source:
        train_pattern, val_pattern = builtin_shards(data.source, data.cache_dir, data.source_dir)
        classnames = list(data.classnames) or classnames_of(data.source)
    else:
        train_pattern, val_pattern, classnames = data.train_shards, data.val_shards, list(data.classnames)
    train = expand_shards(train_pattern, "data.train_shards")
    val = expand_shards(val_pattern, "data.val_shards") if val_pattern else None
    return Shards(train, val, classnames)
