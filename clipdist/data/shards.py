"""Write (image, caption) pairs as WebDataset shards in the img2dataset layout."""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import webdataset as wds
from PIL import Image

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


def write_shards(pairs: Iterable[tuple[Image.Image | bytes, str, dict]], out_dir: str | Path, prefix: str,
                 samples_per_shard: int = 1000) -> list[Path]:
    """Write pairs (image, caption, extra json) to out_dir/prefix-000000.tar, ... ; return the paths.

    Images given as PIL are stored as PNG; bytes are stored as they are (with their suffix
    guessed from the header). Shards are written under a temporary name and renamed when done.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pattern = str(out_dir / f".{prefix}-%06d.tar.partial")
    with wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as sink:
        for index, (image, caption, extra) in enumerate(pairs):
            sample = {"__key__": f"{index:09d}", "txt": caption, "json": json.dumps(extra)}
            if isinstance(image, bytes):
                sample["jpg" if image[:2] == b"\xff\xd8" else "png"] = image
            else:
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                sample["png"] = buffer.getvalue()
            sink.write(sample)
    written = []
    for partial in sorted(out_dir.glob(f".{prefix}-*.tar.partial")):
        final = out_dir / partial.name[1:].removesuffix(".partial")
        os.replace(partial, final)
        written.append(final)
    return written


def pairs_from_folder(folder: str | Path) -> Iterator[tuple[bytes, str, dict]]:
    """Images under folder; caption from a same-name .txt beside the image, else 'a photo of a <parent dir>'."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    found = False
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        found = True
        caption_file = path.with_suffix(".txt")
        caption = caption_file.read_text().strip() if caption_file.exists() else f"a photo of a {path.parent.name}"
        yield path.read_bytes(), caption, {"source": str(path.relative_to(folder))}
    if not found:
        raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {folder}")


def pairs_from_csv(table: str | Path, path_column: str = "path", caption_column: str = "caption") -> Iterator[tuple[bytes, str, dict]]:
    """Rows of a CSV with an image path column and a caption column (paths relative to the CSV)."""
    table = Path(table)
    with open(table, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {path_column, caption_column} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{table}: missing column(s) {sorted(missing)}; found {reader.fieldnames}")
        for row in reader:
            path = (table.parent / row[path_column]).resolve()
            yield path.read_bytes(), row[caption_column], {"source": row[path_column]}


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a finished tmp_dir into place atomically; if another process got there first, keep theirs.

    A crash never leaves a half-written folder under the final name; a final folder without its
    `done` marker (left by an older version) is replaced.
    """
    if final_dir.exists() and not (final_dir / "done").exists():
        shutil.rmtree(final_dir, ignore_errors=True)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:  # the folder exists: another rank wrote the same shards first
        shutil.rmtree(tmp_dir, ignore_errors=True)
