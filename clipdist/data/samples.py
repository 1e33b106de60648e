"""One WebDataset sample (a dict of raw bytes by extension) → image, captions and label.

Layouts read: img2dataset (`.jpg`/`.png`/`.webp` + `.txt` [+ `.json`]), webdataset's and
clip_benchmark's classification sets (image + `.cls`, no text), clip_benchmark's retrieval
sets (`.txt` holding one caption per line). Every failure is a SampleError naming the shard,
the sample key and the reason, so a skip warning says what to fix.
"""

from __future__ import annotations

import hashlib
import io
import random
import warnings
from typing import NamedTuple

import numpy as np
import simplejpeg
from PIL import Image

from clipdist.files import json_of

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif", "0.webp")  # first found wins
BACKGROUND = (255, 255, 255)  # transparent pixels are composited onto white
DCT_SCALES = (8, 4, 2)  # the reductions PIL's draft mode decodes a JPEG at (1/8, 1/4, 1/2), largest first


class SampleError(ValueError):
    """A sample that cannot be used: which shard, which key, why."""

    def __init__(self, sample: dict, reason: str):
        self.url, self.key, self.reason = sample.get("__url__", "?"), sample.get("__key__", "?"), reason
        super().__init__(f"{self.url}: sample {self.key!r}: {reason}")


IMAGE_FILE_BYTES = 256 << 20  # one image file a table row or an image folder names (files.read_bounded)


def to_rgb(image: Image.Image, background=BACKGROUND) -> Image.Image:
    """8-bit RGB for any PIL mode.

    16- and 32-bit integer greyscale (I;16*, I: PNG/TIFF depth 16) is scaled from 0..65535,
    float greyscale (F) is clipped to 0..255 as PIL does, palette images keep their colours,
    and any alpha (RGBA, LA, PA, palette transparency) is composited onto `background`
    instead of being dropped (PIL's convert("RGB") would show what the transparent pixels
    happen to hold, often black).
    """
    if image.mode.startswith("I;16") or image.mode == "I":
        image = _grey16_to_l(image)
    elif image.mode == "F":
        image = Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        flat = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(flat, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _grey16_to_l(image: Image.Image, rows: int = 512) -> Image.Image:
    """round(clip(v, 0, 65535) / 257) as 8-bit greyscale, in integers and a block of rows at a time: a 9400² 16-bit
    PNG (170 KB on disk) takes one uint8 copy beside PIL's own, not a float64 one of 700 MB."""
    values = np.asarray(image)
    out = np.empty(values.shape, np.uint8)
    for start in range(0, values.shape[0], rows):
        block = np.clip(values[start : start + rows].astype(np.int64), 0, 65535)
        out[start : start + rows] = (block + 128) // 257
    return Image.fromarray(out, "L")


class EncodedImage(NamedTuple):
    """An image read from its header only: the file's bytes and PIL's lazily opened view of them (format,
    mode, size); load_rgb decodes it, at the size it is needed."""

    data: bytes
    opened: Image.Image

    @property
    def size(self) -> tuple[int, int]:
        return self.opened.size


class SampleKeys(NamedTuple):
    """Where a sample's caption and image are (data.caption_keys, data.caption_probs, data.image_keys).

    A caption key is a member's extension (`txt`) or a path into its JSON (`json:caption`, `json:captions.0`,
    `json:captions`: a list, one of whose strings is drawn). Without probabilities the first key the sample has is
    used; with them, one of the keys it has is drawn by probability (renormalised over those present) — every draw
    seeded by (seed, shard, key), so a resume draws the same. Image keys: extensions, first found; () for any."""

    caption_keys: tuple[str, ...] = ("txt",)
    caption_probs: tuple[float, ...] | None = None
    image_keys: tuple[str, ...] = ()
    seed: int = 0

    def draw(self, sample: dict) -> random.Random:
        """This sample's own generator (a stable hash: Python's str hash differs between processes)."""
        name = f"{self.seed}/{sample.get('__url__', '')}/{sample.get('__key__', '')}".encode()
        return random.Random(int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little"))

    def caption(self, sample: dict) -> str:
        """The sample's caption by these keys; a SampleError naming the keys it has where none matches."""
        meta = _Meta(sample)
        found = [(key, value) for key in self.caption_keys if (value := _caption_at(sample, key, meta)) is not None]
        if not found:
            try:
                fields = meta() if "json" in sample else None
            except SampleError:  # a .json that does not parse has no fields to name
                fields = None
            empty = [f".{key}" for key in self.caption_keys if not key.startswith("json:") and key in sample]
            raise SampleError(
                sample,
                (f"{', '.join(empty)} holds no text" if empty else f"no caption at {', '.join(self.caption_keys)}")
                + f"; it has {_extensions(sample)}"
                + (f" (.json fields: {', '.join(sorted(fields))})" if isinstance(fields, dict) else ""),
            )
        chooser = None  # the sample's generator, drawn from in order: which key, then which of a key's captions
        if self.caption_probs is not None and len(found) > 1:
            weights = [self.caption_probs[self.caption_keys.index(key)] for key, _ in found]
            chooser = self.draw(sample)
            _, value = chooser.choices(found, weights=weights)[0]
        else:
            _, value = found[0]
        if isinstance(value, list):
            value = (chooser or self.draw(sample)).choice(value)
        caption = " ".join(line.strip() for line in value.splitlines() if line.strip())
        if not caption:
            raise SampleError(sample, "empty caption")
        return caption


class _Meta:
    """A sample's .json, parsed once however many caption keys look into it."""

    def __init__(self, sample: dict):
        self.sample, self.parsed = sample, None

    def __call__(self):
        if self.parsed is None:
            self.parsed = (parsed_json(self.sample),)
        return self.parsed[0]


def parsed_json(sample: dict):
    """A sample's .json, or a SampleError (the sample skipped): not JSON, or nested deeper than the parser recurses
    (`[[[…` 100,000 deep raised RecursionError, which ended the loader)."""
    try:
        return json_of(sample["json"])
    except ValueError as exn:
        raise SampleError(sample, f".json does not parse ({str(exn)[:200]})") from None


def _caption_at(sample: dict, key: str, meta: _Meta):
    """The text (or list of texts) at caption key `key`, or None where the sample has none there."""
    if not key.startswith("json:"):
        if key not in sample:
            return None
        if key == "txt":
            return "\n".join(captions_of(sample)) or None
        try:
            return sample[key].decode("utf-8")
        except UnicodeDecodeError as exn:
            raise SampleError(sample, f".{key} is not UTF-8 ({exn})") from None
    if "json" not in sample:
        return None
    value = meta()
    for part in key[len("json:") :].split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    if isinstance(value, list):
        value = [item for item in value if isinstance(item, str) and item.strip()]
        return value or None
    return value if isinstance(value, str) and value.strip() else None


def open_image(sample: dict, keys: SampleKeys = SampleKeys()) -> EncodedImage:  # noqa: B008
    """The sample's first image (by `keys.image_keys`, else IMAGE_EXTENSIONS), its header read, its pixels not
    decoded yet. The format is the file's own, whatever the extension says (a PNG or WebP named .jpg opens as
    what it is). EXIF orientation is not applied, as in open_clip's loader (webdataset's "pilrgb" decoder): an
    image is used as it is stored."""
    ext = next((ext for ext in keys.image_keys or IMAGE_EXTENSIONS if ext in sample), None)
    for note in ("missing", "bad"):  # a table row whose image could not be read, or whose fields do not fit
        if ext is None and note in sample:
            raise SampleError(sample, sample[note].decode("utf-8", "replace"))
    if ext is None:
        raise SampleError(
            sample, f"no image ({', '.join(keys.image_keys or IMAGE_EXTENSIONS)}); it has {_extensions(sample)}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DecompressionBombWarning: load_rgb decides
            return EncodedImage(sample[ext], Image.open(io.BytesIO(sample[ext])))
    except Exception as exn:  # noqa: BLE001 -- any decoder failure is this sample's problem
        raise undecodable(sample, exn) from None


def undecodable(sample: dict, exn: Exception) -> SampleError:
    """The SampleError for a sample whose image fails to open or decode."""
    ext = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), "image")
    return SampleError(sample, f".{ext} does not decode ({type(exn).__name__}: {exn})")


def load_rgb(image: EncodedImage | Image.Image, min_size: tuple[int, int] = (0, 0)) -> tuple[Image.Image, float]:
    """Decode as 8-bit RGB at the smallest size libjpeg can decode to that is at least `min_size`
    (width, height); returns the image and its scale (decoded size / stored size, at most 1).

    A JPEG in YCbCr or greyscale is decoded by libjpeg-turbo (simplejpeg) with its DCT scaling, which
    reduces by any M/8 (an IDCT of fewer points: a low-pass, not a subsampling), converting straight to
    RGB; other JPEGs (CMYK) by PIL, which reduces by 1/2, 1/4, 1/8 (its draft mode); other formats in
    full. An image that would still decode to more pixels than PIL's MAX_IMAGE_PIXELS is refused with
    that reason: the memory one image takes stays bounded, and a huge JPEG is read at the size needed."""
    if isinstance(image, Image.Image):  # decoded already, or opened without its bytes
        image = EncodedImage(b"", image)
    data, opened = image
    width, height = opened.size
    eighths = dct_eighths(opened.size, min_size)
    if data and opened.format == "JPEG" and opened.mode in ("RGB", "L"):
        size = (-(-width * eighths // 8), -(-height * eighths // 8))  # libjpeg rounds up
        _check_pixels(*size)
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=size[0], min_height=size[1])
        decoded = Image.frombuffer("RGB", (pixels.shape[1], pixels.shape[0]), pixels, "raw", "RGB", 0, 1)
        return decoded, eighths / 8 if decoded.size == size else decoded.size[0] / width
    scale = 1.0
    power = next((step for step in DCT_SCALES if step * eighths <= 8), 1)
    if power > 1 and opened.format == "JPEG":
        drafted = opened.draft(None, (width // power, height // power))
        if drafted is not None:
            scale = drafted[1][2] / width
    _check_pixels(*opened.size)
    _check_decoded_bytes(opened)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "Palette images with Transparency..."
        opened.load()
    return to_rgb(opened), scale


def dct_eighths(size: tuple[int, int], min_size: tuple[int, int]) -> int:
    """The fewest eighths M (1..8) of `size` at which both sides are still at least `min_size` (libjpeg
    decodes a side s at M/8 as ceil(s·M/8) pixels); 8 (whole) for no `min_size`, or where the image is
    smaller than that already."""
    width, height = size
    if not any(min_size):
        return 8
    return next((m for m in range(1, 8) if -(-width * m // 8) >= min_size[0] and -(-height * m // 8) >= min_size[1]), 8)


def _check_pixels(width: int, height: int) -> None:
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise Image.DecompressionBombError(
            f"{width}x{height} pixels to decode exceed the limit of {limit} (PIL's MAX_IMAGE_PIXELS), which "
            "guards against a decompression bomb"
        )


MAX_DECODE_BYTES = 512 << 20  # one image's decode and conversion to RGB, at most (a loader worker holds a few)
MODE_BYTES = {
    "1": 1,
    "L": 1,
    "P": 1,
    "LA": 2,
    "PA": 2,
    "I;16": 2,
    "I;16B": 2,
    "I;16L": 2,
    "RGB": 3,
    "YCbCr": 3,
    "LAB": 3,
    "HSV": 3,
    "RGBA": 4,
    "RGBa": 4,
    "CMYK": 4,
    "I": 4,
    "F": 4,
}


def _check_decoded_bytes(opened: Image.Image) -> None:
    """Refuse (DecompressionBombError) an image whose decode and conversion to RGB would take more than
    MAX_DECODE_BYTES: its pixels × (its mode's bytes + RGB's 3 + 4 for compositing an alpha channel). PIL's pixel
    limit alone lets an 89-Mpixel RGBA PNG of 470 KB cost ~2.5 GB in one process."""
    width, height = opened.size
    alpha = 4 if "A" in opened.mode or "transparency" in opened.info else 0
    needed = width * height * (MODE_BYTES.get(opened.mode, 4) + 3 + alpha)
    if needed > MAX_DECODE_BYTES:
        raise Image.DecompressionBombError(
            f"{width}x{height} {opened.mode} would take {needed >> 20} MiB to decode and convert, more than "
            f"{MAX_DECODE_BYTES >> 20} MiB (a decompression bomb guard)"
        )


def decode_image(sample: dict) -> Image.Image:
    """The sample's first image, fully decoded, as RGB."""
    image = open_image(sample)
    try:
        return load_rgb(image)[0]
    except Exception as exn:  # noqa: BLE001 -- any decoder failure is this sample's problem
        raise undecodable(sample, exn) from None


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
        meta = parsed_json(sample)
        label = meta.get("label") if isinstance(meta, dict) else None
        if isinstance(label, int) and not isinstance(label, bool):
            return label
    return None


def training_pair(sample: dict, keys: SampleKeys = SampleKeys()) -> tuple[EncodedImage, str]:  # noqa: B008
    """(image, caption) for training: the image opened, not yet decoded (ImageBatcher decodes it at the
    size its crop needs); the caption by `keys` (default: the whole .txt), which must not be blank."""
    if keys.caption_keys == ("txt",) and "txt" not in sample:
        raise SampleError(sample, f"no .txt caption; it has {_extensions(sample)}")
    caption = keys.caption(sample)
    return open_image(sample, keys), caption


def eval_record(sample: dict) -> tuple[Image.Image, list[str], int]:
    """(image, captions, label) for evaluation; label -1 when unlabelled. A sample must have a
    caption (for retrieval) or a label (for zero-shot), or it is of no use."""
    captions, label = captions_of(sample), label_of(sample)
    if not captions and label is None:
        raise SampleError(
            sample, f"neither a .txt caption nor a label (.cls or .json 'label'); it has {_extensions(sample)}"
        )
    return decode_image(sample), captions, -1 if label is None else label


def _extensions(sample: dict) -> str:
    found = sorted(key for key in sample if not key.startswith("__"))
    return ", ".join(f".{key}" for key in found) or "nothing"
