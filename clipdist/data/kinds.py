"""The kinds of data a shard spec can name, read from their registry (clipdist.registry.kinds): how an item of the spec
expands into shard URLs, and how a URL of the kind yields its members (the (name, bytes) pairs a tar shard holds, so
everything after reads them alike).

    tar shards   files, URLs, `pipe:` commands, directories and globs of .tar (the default: webdataset opens them)
    tables       open_clip's CSV/TSV of image paths and captions, cut into `table:` parts (data/tables.py)
    folders      an ImageFolder, one `folder:` part per class subfolder (data/folders.py)

Each kind gets its own options (`kind_options`: a table its data.table.* section; a folder none).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from clipdist.registry.kinds import KINDS as SPECS
from clipdist.registry.kinds import KindSpec


@dataclass(frozen=True)
class DataKind:
    name: str
    scheme: str  # the prefix of its part URLs
    names_it: Callable[[str], bool]  # whether an item of a spec (a path, after brace expansion) is of this kind
    expand: Callable[[str, object, str], list[str]]  # (item, its options, config key) -> part URLs
    members: Callable[[str], Iterator[tuple[str, bytes]]]  # a part URL -> (name, bytes) as a tar shard's members
    size: Callable[[str], int]  # a part URL -> its samples (known before reading)
    narrow: Callable[[str, int, int], str] | None = None  # (URL, first, count) -> a URL of those samples only


def _kind(spec: KindSpec) -> DataKind:
    module = importlib.import_module(spec.module)
    narrow = getattr(module, "narrow", None)
    return DataKind(spec.name, module.SCHEME, module.names_it, module.expand, module.members, module.size, narrow)


KINDS = tuple(_kind(spec) for spec in SPECS.values())


def kind_named(name: str) -> DataKind:
    return next(kind for kind in KINDS if kind.name == name)


def kind_options(data=None) -> dict[str, object]:
    """Each kind's options (kind name -> its options dataclass): a DataConfig's `data.<kind>` sections; the
    defaults where `data` is None."""
    return {
        spec.name: getattr(data, spec.name) if data is not None else spec.options()
        for spec in SPECS.values()
        if spec.options is not None
    }


def kind_of_item(item: str) -> DataKind | None:
    """The kind an item of a spec names (a table file, an ImageFolder); None: tar shards."""
    return next((kind for kind in KINDS if kind.names_it(item)), None)


def kind_of_url(url: str) -> DataKind | None:
    """The kind of a part URL (`table:...`, `folder:...`); None: a tar shard."""
    return next((kind for kind in KINDS if url.startswith(kind.scheme)), None)


def members(url: str) -> Iterator[tuple[str, bytes]] | None:
    """A part's members, or None for a tar shard (opened as a stream by the caller)."""
    kind = kind_of_url(url)
    return None if kind is None else kind.members(url)
