"""One WebDataset sample (a dict of raw bytes by extension) → image, captions and label.

Layouts read: img2dataset (`.jpg`/`.png`/`.webp` + `.txt` [+ `.json`]), webdataset's and
clip_benchmark's classification sets (image + `.cls`, no text), clip_benchmark's retrieval
sets (`.txt` holding one caption per line). Every failure is a SampleError naming the shard,
the sample key and the reason, so a skip warning says what to fix.
"""
from __future__ import annotations

import io
import json
import warnings

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "0.webp")  # first found wins
BACKGROUND = (255, 255, 255)  # transparent pixels are composited onto white


class SampleError(ValueError):
    """A sample that cannot be used: which shard, which key, why."""

    def __init__(self, sample: dict, reason: str):
        self.url, self.key, self.reason = sample.get("__url__", "?"), sample.get("__key__", "?"), reason
        super().__init__(f"{self.url}: sample {self.key!r}: {reason}")


def to_rgb(image: Image.Image, background=BACKGROUND) -> Image.Image:
    """8-bit RGB for any PIL mode.

    16- and 32-bit integer greyscale (I;16*, I: PNG/TIFF depth 16) is scaled from 0..65535,
    float greyscale (F) is clipped to 0..255 as PIL does, palette images keep their colours,
    and any alpha (RGBA, LA, PA, palette transparency) is composited onto `background`
    instead of being dropped (PIL's convert("RGB") would show what the transparent pixels
    happen to hold, often black).
    """
    if image.mode.startswith("I;16") or image.mode == "I":
        values = np.asarray(image, dtype=np.float64)
        image = Image.fromarray((np.clip(values, 0, 65535) / 257.0).round().astype(np.uint8), "L")
    elif image.mode == "F":
        image = Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(flat, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(sample: dict) -> Image.Image:
    """The sample's first image (by IMAGE_EXTENSIONS), fully decoded, as RGB."""
    for ext in IMAGE_EXTENSIONS:
        if ext in sample:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # e.g. "Palette images with Transparency..."
                    image = Image.open(io.BytesIO(sample[ext]))
                    image.load()
                    return to_rgb(image)
            except Exception as exn:  # noqa: BLE001 -- any decoder failure is this sample's problem
                raise SampleError(sample, f".{ext} does not decode ({type(exn).__name__}: {exn})") from None
    raise SampleError(sample, f"no image ({', '.join(IMAGE_EXTENSIONS)}); it has {_extensions(sample)}")


def captions_of(sample: dict) -> list[str]:
    """Non-empty lines of the sample's .txt (one caption, or clip_benchmark's several); [] if none."""
    if "txt" not in sample:
        return []
    try:
        text = sample["txt"].decode("utf-8")
    except UnicodeDecodeError as exn:
        raise SampleError(sample, f".txt is not UTF-8 ({exn})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def label_of(sample: dict) -> int | None:
    """The class index from .cls, else from .json's "label"; None when the sample has neither."""
    if "cls" in sample:
        try:
            return int(sample["cls"].decode("utf-8").strip())
        except ValueError:
            raise SampleError(sample, f".cls is not an integer: {sample['cls'][:20]!r}") from None
    if "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except ValueError as exn:
            raise SampleError(sample, f".json does not parse ({exn})") from None
        label = meta.get("label") if isinstance(meta, dict) else None
        if isinstance(label, int) and not isinstance(label, bool):
            return label
    return None


def training_pair(sample: dict) -> tuple[Image.Image, str]:
    """(image, caption) for training: the whole .txt is the caption; it must not be blank."""
    if "txt" not in sample:
        raise SampleError(sample, f"no .txt caption; it has {_extensions(sample)}")
    captions = captions_of(sample)
    if not captions:
        raise SampleError(sample, "empty caption")
    return decode_image(sample), " ".join(captions)


def eval_record(sample: dict) -> tuple[Image.Image, list[str], int]:
    """(image, captions, label) for evaluation; label -1 when unlabelled. A sample must have a
    caption (for retrieval) or a label (for zero-shot), or it is of no use."""
    captions, label = captions_of(sample), label_of(sample)
    if not captions and label is None:
        raise SampleError(sample, f"neither a .txt caption nor a label (.cls or .json 'label'); it has {_extensions(sample)}")
    return decode_image(sample), captions, -1 if label is None else label


def _extensions(sample: dict) -> str:
    found = sorted(key for key in sample if not key.startswith("__"))
    return ", ".join(f".{key}" for key in found) or "nothing"
