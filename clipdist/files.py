"""Reading a file that a user or another file named, bounded: a regular file of at most a given size, checked
before anything is read from it — a FIFO would hang the reader, a device (`/dev/zero`) never ends, a huge file
exhausts memory. Model and tokenizer configs (weights.read_small_json), table and ImageFolder images
(data/tables.py, data/folders.py), an evaluation set's class names and templates (data/sources.py) all read so.

A run's own files read back (train_log.jsonl, metrics.jsonl: `read_lines`) are opened without following a link,
line by line with a bound per line and in all; files clipdist writes into a folder it shares with others (a
run directory's report and rewound logs: `write_atomic`) are written to a new private name and renamed over the
old, so a link planted at either name is replaced, never written through."""

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


def open_own(path: str | Path):
    """`path` opened for reading as a binary file, refusing (UnboundedFileError) a symbolic link at that name and
    anything but a regular file — without blocking on a FIFO."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnboundedFileError(
                errno.ELOOP, "a symbolic link, not read (a run's own files are its own)", str(path)
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise UnboundedFileError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def read_lines(path: str | Path, line_limit: int = 1 << 20, total_limit: int = 1 << 30):
    """The lines of a run's own log, each as bytes without its newline, or None for a line over `line_limit` (not
    kept: read past in pieces); reading stops after `total_limit` bytes. Memory stays within a line's bound
    whatever the file holds (a 10 GB sparse file, one endless line)."""
    with open_own(path) as file:
        read = 0
        while read < total_limit:
            line = file.readline(line_limit + 1)
            if not line:
                return
            read += len(line)
            if len(line) > line_limit and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n") and read < total_limit:  # the rest of the long line
                    line = file.readline(line_limit)
                    read += len(line)
                yield None
            elif len(line) > line_limit + 1:
                yield None
            else:
                yield line.rstrip(b"\n")


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """`data` as the file `path`: written to a new private file beside it (mkstemp: never an existing name, so never
    through a link someone placed), then renamed over `path` (which replaces a link, not its target)."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
