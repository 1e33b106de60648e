"""Data the tests make: images, tar shards in the layouts people have (webdataset captions, clip_benchmark's
zero-shot folders). One builder per layout, shared by unit and integration tests."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Callable


def image_bytes(value: int = 128, fmt: str = "PNG", mode: str = "RGB", size: int = 8) -> bytes:
    """A small flat image encoded as `fmt`."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (size, size), value if mode in ("L", "I", "I;16") else (value,) * len(mode)).save(buffer, format=fmt)
    return buffer.getvalue()


def write_tar(path: Path, members) -> Path:
    """A tar file of (name, bytes) members, in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_samples(path: Path, samples: list[dict]) -> Path:
    """A shard of samples given as {"__key__": ..., ext: bytes, ...}."""
    return write_tar(path, [(f"{sample['__key__']}.{ext}", data) for sample in samples
                            for ext, data in sample.items() if ext != "__key__"])


def caption_shards(folder: Path, shards: int = 2, per_shard: int = 16, *,
                   pixel: Callable[[int, int], int] = lambda shard, i: i * 7 % 256,
                   caption: Callable[[int], bytes] = lambda i: f"a grey square number {i}".encode(),
                   label: Callable[[int], int] | None = None, bad_first: bool = False) -> Path:
    """`folder`/{0..shards-1}.tar in the img2dataset layout: keys '<shard>-<i>', a flat PNG of `pixel(shard, i)`,
    a .txt caption, a .json label where `label` is given; `bad_first`: each shard starts with an undecodable image."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        samples = [{"__key__": f"{shard}-bad", "png": b"not a png", "txt": b"a caption"}] if bad_first else []
        samples += [{"__key__": f"{shard}-{i:03d}", "png": image_bytes(pixel(shard, i)), "txt": caption(i),
                     **({"json": f'{{"label": {label(i)}}}'.encode()} if label else {})} for i in range(per_shard)]
        write_samples(folder / f"{shard}.tar", samples)
    return folder


def clip_benchmark_set(root: Path, shards: list[list[dict]], classnames: list[str], templates: list[str]) -> Path:
    """clip_benchmark's webdataset layout: test/{0..n}.tar of the given samples (an image + .cls each),
    nshards.txt, classnames.txt and zeroshot_classification_templates.txt beside."""
    (root / "test").mkdir(parents=True)
    for number, samples in enumerate(shards):
        write_samples(root / "test" / f"{number}.tar", samples)
    (root / "test" / "nshards.txt").write_text(f"{len(shards)}\n")
    (root / "classnames.txt").write_text("\n".join(classnames) + "\n")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    return root


def pets(root: Path, samples_per_shard: int = 3, shards: int = 2) -> Path:
    """A small clip_benchmark set: .webp images labelled cat/dog alternately, two templates ({c} style)."""
    return clip_benchmark_set(root, [[{"__key__": f"s{shard}{i}", "webp": image_bytes(40 * i, "WEBP"),
                                       "cls": str(i % 2).encode()} for i in range(samples_per_shard)]
                                     for shard in range(shards)],
                              ["cat", "dog"], ["a photo of a {c}.", "a drawing of a {c}."])
