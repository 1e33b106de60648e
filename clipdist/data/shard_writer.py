"""Write (image, caption) pairs as WebDataset shards in the img2dataset layout."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import webdataset as wds
from PIL import Image

from clipdist.data.epochs import stats_path
from clipdist.data.samples import IMAGE_FILE_BYTES
from clipdist.data.tables import delimiter
from clipdist.defaults import TABLE_CAPTION_KEY, TABLE_IMAGE_KEY, TABLE_SEPARATOR
from clipdist.errors import ConfigError, printable
from clipdist.files import FILE_STEM, open_user, publish, read_bounded, write_atomic

CAPTION_FILE_BYTES = 1 << 20  # a caption .txt beside an image


IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


FORMAT_EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # stored as they are; other formats become PNG


class UnreadableImage(ValueError):
    """An image file that does not decode; make-shards skips it and says so."""


def checked_image(data: bytes, where: str) -> tuple[str, bytes]:
    """(extension, bytes) of an image that decodes: JPEG/PNG/WebP kept byte for byte, any other format
    PIL reads (BMP, TIFF, GIF, ...) converted to PNG."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            extension = FORMAT_EXTENSIONS.get(image.format)
            if extension:
                return extension, data
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            return "png", buffer.getvalue()
    except Exception as exn:  # noqa: BLE001 -- any decoder failure means this file is unusable
        raise UnreadableImage(f"{where}: not a readable image ({type(exn).__name__}: {exn})") from None


SHARD_PREFIX = FILE_STEM


def write_shards(
    pairs: Iterable[tuple[Image.Image | bytes, str, dict]],
    out_dir: str | Path,
    prefix: str,
    samples_per_shard: int = 1000,
    on_unreadable=None,
) -> list[Path]:
    """Write pairs (image, caption, extra json) to out_dir/prefix-000000.tar, ... ; return the paths.

    Each shard gets img2dataset's `<shard>_stats.json` beside it ({"successes": its samples}): training reads
    the sizes from it (data/epochs.py). Images given as PIL are stored as PNG; bytes must decode (checked_image)
    and are stored as they are — one that does not is passed to on_unreadable(message) and left out, or raises
    UnreadableImage when on_unreadable is None. Shards are written under a temporary name and renamed when all
    are done; if writing fails, the temporary files are removed.
    """
    if not SHARD_PREFIX.fullmatch(prefix):  # a '/' or '..' would write elsewhere, '%' and braces break the patterns
        raise ValueError(
            f"--prefix {prefix!r}: the start of the shards' file names (letters, digits, '.', '_', '-'; not starting "
            "with '.' or '-'): they are written as <prefix>-000000.tar in the output folder"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pattern = str(out_dir / f".{prefix}-%06d.tar.partial")
    try:
        with wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as sink:
            index = 0
            for image, caption, extra in pairs:
                sample: dict[str, str | bytes] = {"__key__": f"{index:09d}", "txt": caption, "json": json.dumps(extra)}
                if isinstance(image, bytes):
                    try:
                        extension, data = checked_image(image, extra.get("source", f"sample {index}"))
                    except UnreadableImage as exn:
                        if on_unreadable is None:
                            raise
                        on_unreadable(str(exn))
                        continue
                    sample[extension] = data
                else:
                    buffer = io.BytesIO()
                    image.save(buffer, format="PNG")
                    sample["png"] = buffer.getvalue()
                sink.write(sample)
                index += 1
    except BaseException:
        for partial in out_dir.glob(f".{prefix}-*.tar.partial"):
            partial.unlink()
        raise
    written = []
    partials = sorted(out_dir.glob(f".{prefix}-*.tar.partial"))
    for number, partial in enumerate(partials):
        final = out_dir / partial.name[1:].removesuffix(".partial")
        size = samples_per_shard if number < len(partials) - 1 else index - number * samples_per_shard
        write_atomic(stats_path(str(final)), json.dumps({"successes": size}).encode())  # img2dataset's, for epochs
        os.replace(partial, final)
        written.append(final)
    return written


def make_shards(
    pairs, out_dir: str | Path, prefix: str, samples_per_shard: int, overwrite: bool = False, on_unreadable=None
) -> list[Path]:
    """`clipdist make-shards`: written into a new folder beside out_dir, then moved into place (files.publish), so
    a failure leaves out_dir as it was. A non-empty out_dir is refused unless overwrite=True and clipdist wrote it
    (then its old content is replaced as a whole: never a mix of two runs)."""
    written: list[Path] = []

    def write(folder: Path) -> None:
        written.extend(write_shards(pairs, folder, prefix, samples_per_shard, on_unreadable))
        if not written:
            raise ValueError("no sample to write: every image was unreadable")

    out = publish(out_dir, write, overwrite=overwrite, hint="choose a new --out, or pass --overwrite to replace it")
    return [out / path.name for path in written]


def pairs_from_folder(folder: str | Path) -> Iterator[tuple[bytes, str, dict]]:
    """Images under folder; caption from a same-name .txt beside the image, else 'a photo of a <parent dir>' with
    the folder's `_` read as a space (as an ImageFolder's class names are: data/folders.py)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    found = False
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        found = True
        caption_file = path.with_suffix(".txt")
        caption = (
            read_bounded(caption_file, CAPTION_FILE_BYTES).decode().strip()
            if caption_file.exists()
            else f"a photo of a {path.parent.name.replace('_', ' ')}"
        )
        yield read_bounded(path, IMAGE_FILE_BYTES), caption, {"source": str(path.relative_to(folder))}
    if not found:
        raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {folder}")


def pairs_from_csv(
    table: str | Path,
    path_column: str = TABLE_IMAGE_KEY,
    caption_column: str = TABLE_CAPTION_KEY,
    separator: str = TABLE_SEPARATOR,
) -> Iterator[tuple[bytes, str, dict]]:
    """Rows of a table with an image path column and a caption column (paths relative to the table); by default
    open_clip's TSV (tab, `filepath`, `title`)."""
    table = Path(table)
    with io.TextIOWrapper(open_user(table), newline="") as handle:
        reader = csv.DictReader(handle, delimiter=delimiter(separator))
        missing = {path_column, caption_column} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{table}: missing column(s) {sorted(missing)}; found {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            path = (table.parent / row[path_column]).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"{table}, line {line}: image {row[path_column]!r} not found ({path})")
            yield read_bounded(path, IMAGE_FILE_BYTES), row[caption_column], {"source": row[path_column]}


BUILTIN_FILE = re.compile(r"(train|val)-\d{6}(\.tar|_stats\.json)|\.(train|val)-\d{6}\.tar\.partial")


def stale_cache(final_dir: Path) -> bool:
    """Whether `final_dir` is a built-in set's folder an older version left without its `done` marker (to replace);
    a ConfigError where it holds anything else, before a shard is written."""
    if not final_dir.exists() or (final_dir / "done").exists():
        return False
    foreign = sorted(path.name for path in final_dir.iterdir() if not BUILTIN_FILE.fullmatch(path.name))
    if foreign:
        raise ConfigError(
            f"{final_dir} holds files clipdist did not write ({printable(foreign[0])}, {len(foreign)} in all) where "
            "the built-in shards go: give another data.cache_dir"
        )
    return True


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a finished tmp_dir into place atomically; if another process got there first, keep theirs.

    A crash never leaves a half-written folder under the final name; a final folder without its
    `done` marker (left by an older version) is replaced, but only where it holds nothing else than what that
    version wrote: a folder of the user's own under the cache's name (data.cache_dir=/data beside /data/digits) is
    refused, never removed.
    """
    if stale_cache(final_dir):
        shutil.rmtree(final_dir, ignore_errors=True)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:  # the folder exists: another rank wrote the same shards first
        shutil.rmtree(tmp_dir, ignore_errors=True)
