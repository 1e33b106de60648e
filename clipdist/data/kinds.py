"""The kinds of data a shard spec can name, in one registry: how an item of the spec expands into shard URLs, and how
a URL of the kind yields its members (the (name, bytes) pairs a tar shard holds, so everything after reads them
alike).

    tar shards   files, URLs, `pipe:` commands, directories and globs of .tar (the default: webdataset opens them)
    tables       open_clip's CSV/TSV of image paths and captions, cut into `table:` parts (data/tables.py)
    folders      an ImageFolder, one `folder:` part per class subfolder (data/folders.py)

A new kind is one module with its functions (expand, members, size; narrow where a part can be read in pieces
cheaply) and one line in KINDS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from clipdist.data import folders, tables


@dataclass(frozen=True)
class DataKind:
    name: str
    scheme: str  # the prefix of its part URLs
    names_it: Callable[[str], bool]  # whether an item of a spec (a path, after brace expansion) is of this kind
    expand: Callable[[str, tables.TableFormat, str], list[str]]  # (item, table format, config key) -> part URLs
    members: Callable[[str], Iterator[tuple[str, bytes]]]  # a part URL -> (name, bytes) as a tar shard's members
    size: Callable[[str], int]  # a part URL -> its samples (known before reading)
    narrow: Callable[[str, int, int], str] | None = None  # (URL, first, count) -> a URL of those samples only


def _table_parts(item: str, table: tables.TableFormat, what: str) -> list[str]:
    if not Path(item).expanduser().is_file():
        raise FileNotFoundError(f"{what}: no such table {item}")
    return tables.table_parts(item, table, what)


TABLES = DataKind(
    "table", tables.SCHEME, tables.is_table, _table_parts, tables.part_members, tables.part_rows, tables.narrow
)
FOLDERS = DataKind(
    "folder",
    folders.SCHEME,
    lambda item: bool(folders.class_folders(Path(item).expanduser())),
    lambda item, table, what: folders.folder_parts(Path(item).expanduser()),
    folders.class_members,
    folders.class_size,
)
KINDS = (TABLES, FOLDERS)


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
