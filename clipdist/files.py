"""Reading a file that a user or another file named, bounded: a regular file of at most a given size, checked
before anything is read from it — a FIFO would hang the reader, a device (`/dev/zero`) never ends, a huge file
exhausts memory. Model and tokenizer configs (weights.read_small_json), table and ImageFolder images
(data/tables.py, data/folders.py), an evaluation set's class names and templates (data/sources.py) all read so."""
from __future__ import annotations

import errno
import stat
from pathlib import Path


class UnboundedFileError(OSError):
    """A path that is not a regular file, or one larger than its bound: refused before a byte is read."""


def read_bounded(path: str | Path, limit: int) -> bytes:
    """The bytes of `path` (through symlinks: what would be read), a regular file of at most `limit` bytes;
    UnboundedFileError (its strerror says which) otherwise, and OSError as opening and reading raise it."""
    path = Path(path)
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise UnboundedFileError(errno.EINVAL, "not a regular file")
    if info.st_size > limit:
        raise UnboundedFileError(errno.EFBIG, f"larger than {limit >> 20} MiB")
    with path.open("rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:  # grew since the stat
        raise UnboundedFileError(errno.EFBIG, f"larger than {limit >> 20} MiB")
    return data
