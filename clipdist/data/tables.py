"""CSV / TSV tables of (image path, caption) read as shards — open_clip's `--dataset-type csv`.

A table given where shards go (`data.train_shards=/data/train.tsv`, an eval set) is cut into parts of
`data.table.rows_per_part` rows, each part a shard URL `table:<path>#rows=<first>-<last>&at=<byte offset>&...`. A part
yields its rows
as a tar shard yields its members — `<row>.<image extension>` (the image file's bytes, its path relative to the
table unless absolute) and `<row>.txt` (the caption) — so everything a shard has, a table has too: parts shuffled
and dealt over ranks and loader workers, the position saved and resumed exactly, a row whose image is missing or
undecodable skipped and counted, evaluation split over ranks.

One row per line (a caption may not span lines); the first line names the columns. Separator and column names
are open_clip's defaults: tab, `filepath`, `title` (`data.table.separator`, `data.table.image_key`,
`data.table.caption_key`).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlencode

from clipdist.data.samples import IMAGE_EXTENSIONS, IMAGE_FILE_BYTES
from clipdist.files import open_user, read_bounded
from clipdist.registry.kinds import TableOptions

SCHEME = "table:"
LINE_BYTES = 1 << 20  # a row: a path and a caption (open_clip's captions: a few hundred bytes)
SUFFIXES = (".csv", ".tsv")


@dataclass(frozen=True)
class TablePart:
    """Rows `first`..`last` of a table, the first of them at byte `at` after `skip` non-empty lines: a shard. The
    machinery that deals shards holds it as its URL (`url`, made here and read back by `of`, nowhere else)."""

    path: str
    first: int
    last: int
    at: int
    sep: str
    image: str
    caption: str
    skip: int | None = None  # None: the part as the table was cut (its URL names no skip)

    @property
    def rows(self) -> int:
        return self.last - self.first + 1

    def url(self) -> str:
        query = {"sep": self.sep, "image": self.image, "caption": self.caption}
        query |= {"skip": str(self.skip)} if self.skip is not None else {}
        return f"{SCHEME}{quote(self.path)}#rows={self.first}-{self.last}&at={self.at}&{urlencode(query)}"

    @classmethod
    def of(cls, url: str) -> TablePart:
        path, _, fragment = url[len(SCHEME) :].partition("#")
        options = {key: values[0] for key, values in parse_qs(fragment, keep_blank_values=True).items()}
        first, last = (int(number) for number in options["rows"].split("-"))
        return cls(
            unquote(path),
            first,
            last,
            int(options["at"]),
            options["sep"],
            options["image"],
            options["caption"],
            int(options["skip"]) if "skip" in options else None,
        )


def delimiter(separator: str) -> str:
    """data.table.separator as one character: `\\t` (two characters, as a shell passes it) is a tab."""
    return {"\\t": "\t", "tab": "\t", "comma": ","}.get(separator, separator)


def is_table(path: str) -> bool:
    return not path.startswith(SCHEME) and Path(path).suffix.lower() in SUFFIXES


def is_part(url: str) -> bool:
    return url.startswith(SCHEME)


def _row(line: bytes, delimiter: str) -> list[str]:
    return next(csv.reader(io.StringIO(line.decode("utf-8")), delimiter=delimiter), [])


def _line(handle, file: Path, number: int) -> bytes:
    """The next line of a table, at most LINE_BYTES (a ValueError naming it otherwise: no row is that long)."""
    line = handle.readline(LINE_BYTES + 1)
    if len(line) > LINE_BYTES:
        raise ValueError(
            f"{file}: line {number} is longer than {LINE_BYTES >> 10} KiB: not a table of paths and captions"
        )
    return line


def table_parts(path: str, table: TableOptions, what: str) -> list[str]:
    """The part URLs of the table at `path`; a ValueError naming the columns it has where a key is missing."""
    file = Path(path).expanduser().resolve()
    sep = delimiter(table.separator)
    if len(sep) != 1:
        raise ValueError(f"data.table.separator={table.separator!r}: one character (a tab is \\t)")
    with open_user(file) as handle:
        header = _row(_line(handle, file, 1), sep)
        missing = [key for key in (table.image_key, table.caption_key) if key not in header]
        if missing:
            raise ValueError(
                f"{what}: {file} has no column {missing[0]!r} (its columns, split at "
                f"{sep!r}: {header}); set data.table.image_key / data.table.caption_key / "
                "data.table.separator"
            )

        def part(first: int, rows: int, at: int) -> str:
            return TablePart(str(file), first, first + rows - 1, at, sep, table.image_key, table.caption_key).url()

        parts, start, rows, offset, first, number = [], handle.tell(), 0, handle.tell(), 0, 1
        while line := _line(handle, file, number + 1):
            number += 1
            if rows == table.rows_per_part:
                parts.append(part(first, rows, start))
                start, first, rows = offset, first + rows, 0
            offset += len(line)
            if line.strip():
                rows += 1
        if rows:
            parts.append(part(first, rows, start))
    if not parts:
        raise ValueError(f"{what}: {file} has a header and no rows")
    return parts


def part_rows(url: str) -> int:
    """The rows a table part URL holds."""
    return TablePart.of(url).rows


def narrow(url: str, first: int, count: int) -> str:
    """The part URL of `count` rows of a part from its row `first` on (its lines before them skipped unread)."""
    part = TablePart.of(url)
    start = part.first + first
    return replace(part, first=start, last=start + count - 1, skip=(part.skip or 0) + first).url()


def part_members(url: str):
    """(fname, data) of a part's rows, as tar_files gives a shard's members: `<row>.<ext>` and `<row>.txt`; a row
    whose image file cannot be read gives its caption alone (the sample is then skipped as having no image)."""
    part = TablePart.of(url)
    delimiter, first_row, rows, file = part.sep, part.first, part.rows, Path(part.path)
    with open_user(file) as handle:
        columns = _row(_line(handle, file, 1), delimiter)
        image_at, caption_at = columns.index(part.image), columns.index(part.caption)
        handle.seek(part.at)
        skip, taken = part.skip or 0, 0
        while skip and (line := handle.readline(LINE_BYTES + 1)):
            skip -= 1 if line.strip() else 0
        while taken < rows:
            line = handle.readline(LINE_BYTES + 1)
            if not line:
                break
            if not line.strip():
                continue
            number, taken = first_row + taken, taken + 1
            row = _row(line, delimiter)
            key = f"row{number:010d}"
            if len(row) != len(columns):
                yield f"{key}.bad", f"{len(row)} fields where the header has {len(columns)}".encode()
                continue
            image = Path(row[image_at])
            image = image if image.is_absolute() else file.parent / image
            try:
                data = read_bounded(image, IMAGE_FILE_BYTES)
            except OSError as error:
                yield f"{key}.missing", f"image {row[image_at]}: {error.strerror}".encode()
            else:
                extension = image.suffix.lower().lstrip(".")
                yield f"{key}.{extension if extension in IMAGE_EXTENSIONS else 'jpg'}", data  # decoded by content
            yield f"{key}.txt", row[caption_at].encode("utf-8")


def total_rows(urls: list[str]) -> int | None:
    """The rows of a shard list when every shard is a table part (the only kind whose size is known before
    reading), else None."""
    if not urls or not all(url.startswith(SCHEME) for url in urls):
        return None
    return sum(part_rows(url) for url in urls)


# The data-kind interface (clipdist.registry.kinds)
names_it, size, members = is_table, part_rows, part_members


def expand(item: str, options: TableOptions, what: str) -> list[str]:
    """A table file's parts, read as `options` say (data.table.*)."""
    if not Path(item).expanduser().is_file():
        raise FileNotFoundError(f"{what}: no such table {item}")
    return table_parts(item, options, what)
