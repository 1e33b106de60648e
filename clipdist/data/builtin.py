"""Real datasets that ship in an installed package, turned into shards on first use.

digits: scikit-learn's 1,797 handwritten digits (8×8, ships inside the wheel).
fashion_mnist: Debian's dataset-fashion-mnist (idx files under /usr/share/datasets/fashion-mnist).
web_photos: web-like JPEGs (256-512 px on the short side, quality 80-95, tens of KB, as img2dataset and
    DataComp shards hold) cut from the photographs that ship inside scikit-image and scikit-learn; the
    label is the photograph a sample was cut from. For loader and 224-px benchmarks (pip install scikit-image).
"""

from __future__ import annotations

import gzip
import io
import os
import random
from pathlib import Path

import numpy as np
from PIL import Image

from clipdist.files import read_bounded, write_atomic

PACKAGED_BYTES = 256 << 20  # a dataset file a Debian package or scikit-image ships (fashion-mnist: 26 MB)
DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
FASHION_NAMES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
CAPTIONS = {
    "digits": [
        "a photo of the digit {}.",
        "a handwritten {}.",
        "the number {}.",
        "a scanned {} written by hand.",
        "a small blurry {}.",
        "an image of a {}.",
    ],
    "fashion_mnist": ["a photo of a {}.", "a grayscale photo of a {}.", "a product photo of a {}.", "a small {}."],
}
VAL_FRACTION = 0.2
SHARDS = {"digits": 4, "fashion_mnist": 8, "web_photos": 8}
# Photographs in scikit-image's data folder (and scikit-learn's two sample images), by what they show.
WEB_PHOTOS = {
    "astronaut.png": "astronaut",
    "chelsea.png": "cat",
    "coffee.png": "cup of coffee",
    "hubble_deep_field.jpg": "galaxy",
    "ihc.png": "microscope slide",
    "motorcycle_left.png": "motorcycle",
    "motorcycle_right.png": "motorcycle",
    "retina.jpg": "retina",
    "rocket.jpg": "rocket",
    "camera.png": "cameraman",
    "coins.png": "coins",
    "moon.png": "moon",
    "brick.png": "brick wall",
    "grass.png": "lawn",
    "gravel.png": "gravel",
    "china.jpg": "temple",
    "flower.jpg": "flower",
}
WEB_SAMPLES = 2560
CAPTIONS["web_photos"] = [
    "a photo of a {}.",
    "a picture of the {}.",
    "a close-up photo of a {}.",
    "a cropped photo of a {}.",
    "{} in a photo.",
]


def _digits(_source_dir):
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images * (255.0 / 16.0)).astype(np.uint8)
    return images, data.target, DIGIT_WORDS


def _fashion_mnist(source_dir):
    root = Path(source_dir or "/usr/share/datasets/fashion-mnist")
    files = [root / "train-images-idx3-ubyte.gz", root / "train-labels-idx1-ubyte.gz"]
    if not all(f.exists() for f in files):
        raise FileNotFoundError(
            f"data=fashion_mnist needs {files[0].name} and {files[1].name} in {root}: "
            "install them with `apt-get install dataset-fashion-mnist`, or set data.source_dir"
        )
    images = np.frombuffer(gzip.decompress(read_bounded(files[0], PACKAGED_BYTES)), np.uint8, offset=16)
    images = images.reshape(-1, 28, 28)
    labels = np.frombuffer(gzip.decompress(read_bounded(files[1], PACKAGED_BYTES)), np.uint8, offset=8)
    return images, labels, FASHION_NAMES


def _web_photos(_source_dir, samples: int = WEB_SAMPLES):
    """`samples` JPEG bytes: a random crop (30-100 % of a photograph's area, aspect 3:4 to 4:3) of a random
    photograph, resized to a short side of 256-512 px and encoded at quality 80-95 (seeded)."""
    try:
        import skimage
    except ImportError:
        raise FileNotFoundError(
            "data.source=web_photos cuts its images from scikit-image's photographs: pip install scikit-image"
        ) from None
    from sklearn.datasets import load_sample_images

    folder = Path(skimage.__file__).parent / "data"
    photos = {
        name: Image.open(io.BytesIO(read_bounded(folder / name, PACKAGED_BYTES))).convert("RGB")
        for name in WEB_PHOTOS
        if (folder / name).exists()
    }
    photos.update(zip(("china.jpg", "flower.jpg"), map(Image.fromarray, load_sample_images().images)))
    names = sorted(set(WEB_PHOTOS.values()))
    files = sorted(photos)
    rng = random.Random(0)
    images, labels = [], []
    for _ in range(samples):
        name = rng.choice(files)
        photo = photos[name]
        area = photo.width * photo.height * rng.uniform(0.3, 1.0)
        aspect = rng.uniform(3 / 4, 4 / 3)
        width = min(photo.width, round((area * aspect) ** 0.5))
        height = min(photo.height, round((area / aspect) ** 0.5))
        left, top = rng.randint(0, photo.width - width), rng.randint(0, photo.height - height)
        crop = photo.crop((left, top, left + width, top + height))
        short = rng.randint(256, 512)
        scale = short / min(crop.size)
        crop = crop.resize((round(crop.width * scale), round(crop.height * scale)), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        crop.save(buffer, format="JPEG", quality=rng.randint(80, 95))
        images.append(buffer.getvalue())
        labels.append(names.index(WEB_PHOTOS[name]))
    return images, np.array(labels), names


LOADERS = {"digits": _digits, "fashion_mnist": _fashion_mnist, "web_photos": _web_photos}
CLASSNAMES = {"digits": DIGIT_WORDS, "fashion_mnist": FASHION_NAMES, "web_photos": sorted(set(WEB_PHOTOS.values()))}


# Zero-shot prompts per built-in source (a few of its captions' phrasings); data.templates replaces them.
ZEROSHOT_TEMPLATES = {
    "digits": ["a photo of the digit {}.", "a handwritten {}.", "the number {}."],
    "fashion_mnist": ["a photo of a {}.", "a grayscale photo of a {}."],
    "web_photos": ["a photo of a {}.", "a picture of the {}.", "a cropped photo of a {}."],
}


def templates_of(source: str) -> list[str]:
    """The zero-shot prompt templates of a built-in source."""
    return list(ZEROSHOT_TEMPLATES[source])


def classnames_of(source: str) -> list[str]:
    """The class names of a built-in source, in label order (its zero-shot classes)."""
    return list(CLASSNAMES[source])


def builtin_shards(source: str, cache_dir: str, source_dir: str | None = None) -> tuple[str, str]:
    """(train pattern, val pattern) for a built-in source, writing the shards once (seeded split)."""
    if source not in LOADERS:
        raise ValueError(f"unknown data.source {source!r}; choose one of {sorted(LOADERS)} or null for your own shards")
    out = Path(cache_dir).expanduser() / source
    shards = SHARDS[source]
    train = str(out / f"train-{{000000..{shards - 1:06d}}}.tar")
    val = str(out / "val-000000.tar")
    if (out / "done").exists():
        return train, val
    from clipdist.data.shard_writer import publish_dir, stale_cache, write_shards  # webdataset, torch: when writing

    stale_cache(out)  # a folder of the user's own there is refused before anything is read or written
    images, labels, names = LOADERS[source](source_dir)
    order = np.random.default_rng(0).permutation(len(labels))
    n_val = int(len(order) * VAL_FRACTION)
    rng = random.Random(0)

    def pairs(indices):
        for i in indices:
            caption = rng.choice(CAPTIONS[source]).format(names[labels[i]])
            image = images[i] if isinstance(images[i], bytes) else Image.fromarray(images[i])
            yield image, caption, {"label": int(labels[i]), "index": int(i)}

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # one per process: concurrent ranks never collide
    n_train = len(order) - n_val

    write_shards(pairs(order[n_val:]), tmp, "train", samples_per_shard=-(-n_train // shards))
    write_shards(pairs(order[:n_val]), tmp, "val", samples_per_shard=n_val)
    write_atomic(tmp / "done", f"{n_train} train, {n_val} val\n")
    publish_dir(tmp, out)
    return train, val
