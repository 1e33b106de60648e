"""Reading a file that a user or another file named, bounded: a regular file of at most a given size, checked
before anything is read from it — a FIFO would hang the reader, a device (`/dev/zero`) never ends, a huge file
exhausts memory. Model and tokenizer configs (weights.read_small_json), table and ImageFolder images
(data/tables.py, data/folders.py), an evaluation set's class names and templates (data/sources.py) all read so."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
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


def publish(
    out: str | Path, write, *, overwrite: bool = False, hint: str = "give another --out, or --overwrite"
) -> Path:
    """`write(path)` makes a file or folder at a new path beside `out`, which then becomes `out` in one rename:
    `out` appears whole or not at all. An `out` that exists (but for an empty folder) is refused unless
    `overwrite` (the FileExistsError ends with `hint`)."""
    out = Path(out).expanduser()
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(f"{out} already exists{' and is not empty' if out.is_dir() else ''}; {hint}")
    out.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # private: only `staging` leaves it
    staging = holder / out.name
    try:
        write(staging)
        _as_new_files_are(staging)
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return out


def _as_new_files_are(path: Path) -> None:
    """Permissions as the umask gives new files (some writers, e.g. safetensors, make theirs private)."""
    umask = os.umask(0)
    os.umask(umask)
    for each in (path, *(path.rglob("*") if path.is_dir() else ())):
        if not each.is_symlink():
            each.chmod((0o777 if each.is_dir() else 0o666) & ~umask)
