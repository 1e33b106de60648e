"""Every file clipdist opens, reads or writes goes through this module (tests/unit/test_file_access.py fails on any
other), so each route is bounded and none follows a link it should not:

    read_bounded(path, limit)   a file a user or another file named (a model config, a table's image, class names):
                                through links, a regular file of at most `limit` bytes, checked before reading
    open_user / read_whole      a file the user named read as a stream (a table, a tar shard) or whole (weights):
                                a regular file only — a FIFO would hang, a device never ends
    open_stream(url)            a shard: a local file (open_user), a URL or a `pipe:` command (webdataset's gopen)
    open_own / read_own /       a run's own records read back (train_log.jsonl, metrics.jsonl, the W&B id): never
    read_lines                  through a link, line by line with a bound per line and in all
    write_atomic                a file in a folder shared with others (reports, rewound logs, outputs): a new
                                private name renamed over the old, so a link planted at the name is replaced
    append_own / open_lock /    a run's own logs appended, its lock, a checkpoint's part: never through a link
    write_durable / write_new
    digest_own                  the SHA-256 of a file of a run's own (the compile cache's): never through a link
    write_once                  a private file made whole or not at all, never replaced (a user's key)
    load_torch / save_torch,    the serializers' file routes, through the above (DCP's own reader and writer work on
    load_safetensors / ...      folders clipdist checks first: checkpoint/weights.py)
    publish(out, write)         a file or folder that appears whole or not at all; --overwrite replaces only a folder
                                publish wrote (it carries PUBLISHED)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
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


# A name a command writes a file under, from an argument (make-shards --prefix, bench loss --tag): letters, digits,
# '.', '_', '-', not starting with '.' or '-' — a '/' or '..' would write elsewhere, '%' and braces break patterns
FILE_STEM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
PUBLISHED = ".clipdist-published"  # in every folder publish writes: what `overwrite` may replace


def json_of(data: bytes | str):
    """json.loads, where a document nested deeper than the parser recurses (`[[[…` 100,000 deep: RecursionError) is
    a ValueError too, as any other JSON that does not parse: every reader of a JSON a file brings refuses it in one
    line."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def check_output(path: str | Path, flag: str, ours, kind: str = "a JSON file", make_folder: bool = False) -> None:
    """Before a command's work: the file `flag` names, which it will replace whole, is new or one `ours(bytes)` says
    a clipdist command wrote (a JSON result, a battery page), a regular file; not a folder, and in a folder that
    exists (or that the command makes: `make_folder`). A ValueError naming the flag otherwise: `--out run/train.log`
    would replace the run's log with a result, after minutes of work."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: name a file (e.g. {path / 'results.json'})")
    if not make_folder and not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: its folder {path.parent} does not exist; make it, or name another file")
    if not (path.exists() or path.is_symlink()):
        return
    try:
        data = b"" if path.is_symlink() else read_bounded(path, 256 << 20)
        written = bool(data) and ours(data)
    except (OSError, ValueError):
        written = False
    if not written:
        raise ValueError(
            f"{flag} {path} exists and is not {kind} a clipdist command wrote (it replaces only its own results): "
            f"name another file, or remove it"
        )


def is_json(data: bytes) -> bool:
    """Whether `data` parses as JSON (what `check_output` lets a JSON result replace)."""
    json_of(data)
    return True


def publish(
    out: str | Path, write, *, overwrite: bool = False, hint: str = "give another --out, or --overwrite"
) -> Path:
    """`write(path)` makes a file or folder at a new path beside `out`, which then becomes `out` in one rename:
    `out` appears whole or not at all. An `out` that exists (but for an empty folder) is refused unless
    `overwrite` (the FileExistsError ends with `hint`), and even then unless it is a folder publish wrote: a run's
    folder, the one an export reads from, a home folder are never replaced."""
    out = Path(out).expanduser()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{out} already exists{' and is not empty' if out.is_dir() else ''}; {hint}")
        if not (out.is_dir() and (out / PUBLISHED).is_file()):
            raise FileExistsError(
                f"{out} is not a folder clipdist wrote (it has no {PUBLISHED}), and --overwrite replaces only "
                "those: give another --out, or remove it yourself"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # private: only `staging` leaves it
    staging = holder / out.name
    try:
        write(staging)
        if staging.is_dir():
            (staging / PUBLISHED).write_text("written by clipdist; --overwrite may replace this folder\n")
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


def _regular_descriptor(path: str | Path, flags: int) -> int:
    """`path` opened with `flags` — without blocking on a FIFO while it opens — where it is a regular file; a
    blocking descriptor, or UnboundedFileError (a FIFO, a device, a socket)."""
    descriptor = os.open(path, flags | os.O_NONBLOCK, 0o666)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise UnboundedFileError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(descriptor, True)
    return descriptor


def _check_regular(path: str | Path) -> None:
    """UnboundedFileError where `path` (through links) is not a regular file: for readers that open it by name."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise UnboundedFileError(errno.EINVAL, "not a regular file", str(path))


def is_remote(url: str) -> bool:
    """A shard that is not a local file: a URL or a `pipe:` command."""
    return url.startswith("pipe:") or "://" in url


def open_own(path: str | Path):
    """`path` opened for reading as a binary file, refusing (UnboundedFileError) a symbolic link at that name and
    anything but a regular file — without blocking on a FIFO."""
    try:
        return os.fdopen(_regular_descriptor(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnboundedFileError(
                errno.ELOOP, "a symbolic link, not read (a run's own files are its own)", str(path)
            ) from None
        raise


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


def read_own(path: str | Path, limit: int) -> bytes:
    """The bytes of a file clipdist wrote and reads back (a run's records: its W&B id, a log), at most `limit`:
    opened without following a link, a regular file only (open_own), UnboundedFileError beyond the bound."""
    with open_own(path) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise UnboundedFileError(errno.EFBIG, f"larger than {limit >> 20} MiB", str(path))
    return data


def open_user(path: str | Path):
    """A file the user named (a table, a tar shard on disk), opened for reading as binary through links — it is
    theirs to name — but only if it is a regular file: a FIFO (which would block), a device or a socket is refused
    at once (UnboundedFileError). What is read from it is bounded by its reader (a line, a tar member)."""
    return os.fdopen(_regular_descriptor(path, os.O_RDONLY), "rb")


def open_stream(url: str):
    """A shard's bytes as a stream: a local file (open_user), or what webdataset opens for a URL or a `pipe:`
    command (the user's to name; tar_samples bounds every member read from it)."""
    if is_remote(url):
        import webdataset

        return webdataset.gopen(url, "rb")
    return open_user(url.removeprefix("file:"))


def _own_descriptor(path: str | Path, flags: int) -> int:
    """A descriptor for writing a file of clipdist's own (never through a link at that name; a regular file)."""
    return _regular_descriptor(path, flags | os.O_NOFOLLOW)


def append_own(path: str | Path):
    """A run's own log opened for appending text lines (created if missing), not through a link at its name."""
    return os.fdopen(_own_descriptor(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def open_lock(path: str | Path):
    """A lock file opened for reading and writing (created if missing), not through a link at its name."""
    return os.fdopen(_own_descriptor(path, os.O_RDWR | os.O_CREAT), "a+", encoding="utf-8")


def write_durable(path: str | Path, data: bytes) -> None:
    """`data` as a new file `path` (an existing name or link is refused), flushed to disk before it returns."""
    with os.fdopen(_own_descriptor(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def digest_own(path: str | Path) -> str:
    """The SHA-256 (hex) of a regular file of clipdist's own, read in pieces, opened without following a link at its
    name (open_own)."""
    digest = hashlib.sha256()
    with open_own(path) as file:
        while piece := file.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def write_once(path: str | Path, data: bytes) -> bool:
    """`data` as the new private file `path` (mode 0600), whole or not at all: written under a private name beside
    it (mkstemp), then linked at `path`. False where `path` exists already (another process made it first): an
    existing file, or a link at that name, is never replaced or written through."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        return True
    finally:
        Path(temporary).unlink(missing_ok=True)


def discard_stdout() -> None:
    """Standard output sent to /dev/null from here on (a reader that closed the pipe: `| head`)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def read_whole(path: str | Path) -> bytes:
    """A regular file the user named, whole (a weights file: its size is what it holds; open_user's checks)."""
    with open_user(path) as file:
        return file.read()


def write_new(path: str | Path, write) -> None:
    """`write(binary file)` makes the file `path` (created or truncated; never written through a link at its name)."""
    with os.fdopen(_own_descriptor(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as file:
        write(file)


def _serializers():
    """(torch, safetensors.torch), imported on first use: this module stays light (the command line's quick
    checks import it)."""
    import safetensors.torch
    import torch

    return torch, safetensors.torch


def load_torch(source, **kwargs):
    """torch.load of bytes in memory (io.BytesIO) or of a regular file (open_user; by name where `mmap`, which
    maps the file: checked to be a regular file first)."""
    torch = _serializers()[0]
    if isinstance(source, (str, Path)):
        if kwargs.get("mmap"):
            _check_regular(source)
            return torch.load(str(source), **kwargs)
        with open_user(source) as file:
            return torch.load(file, **kwargs)
    return torch.load(source, **kwargs)


def save_torch(value, target) -> None:
    """torch.save into memory (io.BytesIO) or as a new file `target` (write_new)."""
    torch = _serializers()[0]
    if isinstance(target, (str, Path)):
        write_new(target, lambda file: torch.save(value, file))
    else:
        torch.save(value, target)


def load_safetensors(path: str | Path):
    """A .safetensors file's tensors (mapped by safetensors; a regular file only)."""
    _check_regular(path)
    return _serializers()[1].load_file(str(path))


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """Tensors as a new .safetensors file `path` (write_new)."""
    data = _serializers()[1].save(tensors, metadata=metadata)
    write_new(path, lambda file: file.write(data))
