"""The data kinds a shard spec can name beside tar shards: each kind's name, the module whose functions read it
(imported when a spec is expanded, data/kinds.py) and its options — a dataclass whose fields become the keys of its
own section, `data.<kind>.<field>` (open_clip's `--csv-separator` is `data.table.separator`), handed to that kind alone.

    from clipdist.registry.kinds import KINDS
    KINDS["table"].options     # TableOptions: data.table.separator, data.table.image_key, ...

A kind's module defines SCHEME (the prefix of its part URLs) and `names_it(item)`, `expand(item, options, what)`,
`members(url)`, `size(url)` and, where a part can be read in pieces cheaply, `narrow(url, first, count)`.
`members` yields (name, bytes) pairs as a tar shard's members: `<key>.<image extension>` and `<key>.txt` (or what
data.caption_keys names); a sample it cannot give yields `<key>.missing` (its file is gone) or `<key>.bad` (its
bytes are not what they should be) with the reason as bytes, and the reader skips and counts it as it does an
undecodable image. A new kind is its module, its entry here (or a plug-in's, group `clipdist.kinds`) and its test
(docs/architecture.md walks through one)."""

from __future__ import annotations

from dataclasses import dataclass

from clipdist.defaults import TABLE_CAPTION_KEY, TABLE_IMAGE_KEY, TABLE_SEPARATOR, positive
from clipdist.registry import Registry, plugged


@dataclass
class TableOptions:
    """How open_clip's CSV/TSV tables are read (--csv-separator, --csv-img-key, --csv-caption-key)."""

    separator: str = TABLE_SEPARATOR  # the column separator (\t, ','); default a tab
    image_key: str = TABLE_IMAGE_KEY  # the column of image paths (relative to the table, or absolute)
    caption_key: str = TABLE_CAPTION_KEY  # the column of captions
    rows_per_part: int = positive(1000)  # a table is read in parts of this many rows, each a shard


@dataclass(frozen=True)
class KindSpec:
    name: str  # its section, data.<name>
    module: str  # the module that reads it (the functions above)
    summary: str  # one line for menus and errors
    options: type | None = None  # a dataclass: the keys of data.<name>


KINDS: Registry[KindSpec] = plugged(
    "clipdist.kinds",
    KindSpec,
    (
        KindSpec("table", "clipdist.data.tables", "open_clip's CSV/TSV of image paths and captions", TableOptions),
        KindSpec("folder", "clipdist.data.folders", "an ImageFolder: one subfolder of images per class"),
    ),
)
