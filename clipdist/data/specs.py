"""The data kinds' one registry, torch-free: each kind a spec item can name (beside tar shards), the module whose
functions read it (imported when a spec is expanded, data/kinds.py), and its options — a dataclass whose fields
become flat `data.<field>` keys (open_clip's `--csv-*` flags are `data.csv_*`), handed to that kind alone.

    from clipdist.data.specs import KIND_SPECS
    KIND_SPECS[0].options     # TableOptions: data.csv_separator, data.csv_image_key, ...

A kind's module defines SCHEME (the prefix of its part URLs) and `names_it(item)`, `expand(item, options, what)`,
`members(url)`, `size(url)` and, where a part can be read in pieces cheaply, `narrow(url, first, count)`. A new
kind is its module, its entry here and its test (docs/architecture.md walks through one)."""

from __future__ import annotations

from dataclasses import dataclass

from clipdist.defaults import TABLE_CAPTION_KEY, TABLE_IMAGE_KEY, TABLE_SEPARATOR, positive


@dataclass
class TableOptions:
    """How open_clip's CSV/TSV tables are read (--csv-separator, --csv-img-key, --csv-caption-key)."""

    csv_separator: str = TABLE_SEPARATOR  # CSV/TSV tables: the column separator (\t, ','); default a tab
    csv_image_key: str = TABLE_IMAGE_KEY  # the column of image paths (relative to the table, or absolute)
    csv_caption_key: str = TABLE_CAPTION_KEY  # the column of captions
    # a table is read in parts of this many rows, each a shard (shuffled, dealt, resumed)
    csv_rows_per_part: int = positive(1000)


@dataclass(frozen=True)
class KindSpec:
    name: str
    module: str  # the module that reads it (the functions above)
    summary: str  # one line for menus and errors
    options: type | None = None  # a dataclass of its data.<field> keys


KIND_SPECS: tuple[KindSpec, ...] = (
    KindSpec("table", "clipdist.data.tables", "open_clip's CSV/TSV of image paths and captions", TableOptions),
    KindSpec("folder", "clipdist.data.folders", "an ImageFolder: one subfolder of images per class"),
)
