"""JPEG decoding on the rank's device (data.decode_on=device): the workers read headers, the device decodes.

    rows = encoded_rows([EncodedCrop(...), ...], (224, 224))   # in a loader worker: the file's bytes and its box
    pixels = decode_rows(rows, device).pixels                   # in the rank: (b, 224, 224, 3) uint8 on the device

A worker opens each image's header only, and draws its RandomResizedCrop box as the host path draws it — the same
generator calls, from the size in the header (images.ReducedDecodeCrop) — so a sample's box is the same whichever side
decodes, and a resume draws the same boxes. It hands over the file's bytes and the box. The rank decodes the batch's
JPEGs in one call of `decode_jpeg` (TorchCodec's, else torchvision's: nvJPEG on CUDA, batched; libjpeg-turbo on the
CPU), and crops and resizes each box on the device with torchvision's `resized_crop` (bicubic, antialiased:
RandomResizedCrop's own tensor path), then the step normalises the uint8 batch as it does the loader's
(images.PixelNormalize).

What differs from the host path is the resampling alone: the host decodes at the smallest DCT scale that still spans
the output and resizes with PIL; here the whole image is decoded and resized with torch. An image that is not an RGB
or greyscale JPEG (PNG, WebP, CMYK JPEG), or a JPEG cut short, is decoded by its worker as on the host path and
travels as pixels in its row (or is skipped, as there); `decode_rows` counts them (`host_decoded`).

A batch's rows: `encoded` (b, W) uint8, each row a file's bytes (or a host-decoded image's pixels) zero-padded to the
widest; `length` (b,) its bytes; `box` (b, 4) (top, left, height, width) in the stored image, (-1, …) for pixels;
`size` (b, 2) the output's (height, width). Every entry has the batch's rows first, so splitting, reordering and
assembling a batch from the workers' pieces treat it as any other input (loader.assemble widens `encoded`).
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Callable
from typing import NamedTuple, cast

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms.v2 import functional as F

from clipdist.data.samples import EncodedImage
from clipdist.errors import ConfigError, words

log = logging.getLogger(__name__)

ENCODED = "encoded"  # the key that marks an encoded batch (a NaFlex batch's is "patches")
DEVICE_DECODABLE = ("RGB", "L")  # JPEG colour modes decode_jpeg turns into RGB on every device (not CMYK)
_RGB_STEPS = ("MaybeConvertMode", "_convert_to_rgb")  # open_clip's steps between the crop and ToTensor: RGB already


class EncodedCrop(NamedTuple):
    """One training image as a worker hands it over: the file's bytes and the crop box drawn for it, or (box None)
    its pixels, decoded and cropped by the worker ((H, W, 3) uint8)."""

    data: torch.Tensor
    box: tuple[int, int, int, int] | None


def check_transform(steps: list) -> T.RandomResizedCrop:
    """The crop of a training transform the device can run after decoding: RandomResizedCrop, RGB conversions,
    ToTensor, Normalize (open_clip's training transform without extra augmentation); a ConfigError otherwise."""
    names = [getattr(step, "__name__", type(step).__name__) for step in steps]
    crop_first = bool(steps) and isinstance(steps[0], T.RandomResizedCrop)
    tail = len(steps) >= 3 and isinstance(steps[-2], T.ToTensor) and isinstance(steps[-1], T.Normalize)
    if not (crop_first and tail and all(name in _RGB_STEPS for name in names[1:-2])):
        raise ConfigError(
            f"data.decode_on=device decodes and crops on the device, after which the training transform may only "
            f"normalise: RandomResizedCrop, ToTensor, Normalize. This run's is {' → '.join(names)}: leave "
            "data.decode_on=host, or drop the extra augmentation (data.augmentation)"
        )
    return steps[0]


def device_decoder(transform, device: torch.device | str) -> Callable:
    """The rank's decode_rows for a run's training `transform` (its crop's interpolation) on `device`."""
    crop = check_transform(list(transform.transforms) if isinstance(transform, T.Compose) else [transform])
    return functools.partial(decode_rows, device=device, interpolation=crop.interpolation)


def encode(crop: T.RandomResizedCrop, image: EncodedImage | Image.Image, decode_on_host) -> EncodedCrop:
    """`image` as its worker hands it over: an RGB or greyscale JPEG as its bytes and its crop box (drawn as
    RandomResizedCrop draws it from the header's size); any other image, or a JPEG cut short (whole_jpeg), through
    `decode_on_host` (the host path: its uint8 (H, W, 3) pixels, or the error that skips the sample there too)."""
    data, opened = image if isinstance(image, EncodedImage) else (b"", image)
    if data and opened.format == "JPEG" and opened.mode in DEVICE_DECODABLE and whole_jpeg(data):
        top, left, height, width = crop.get_params(opened, crop.scale, crop.ratio)
        return EncodedCrop(torch.frombuffer(bytearray(data), dtype=torch.uint8), (top, left, height, width))
    return EncodedCrop(decode_on_host(image), None)


def encoded_rows(images: list[EncodedCrop], size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A worker's images as an encoded batch (the module docstring's rows), output `size` (height, width)."""
    flat = [image.data.reshape(-1) for image in images]
    lengths = torch.tensor([len(row) for row in flat], dtype=torch.int64)
    encoded = torch.zeros(len(flat), int(lengths.max()) if flat else 0, dtype=torch.uint8)
    for row, data in zip(encoded, flat):
        row[: len(data)] = data
    boxes = torch.tensor([image.box or (-1, -1, -1, -1) for image in images], dtype=torch.int64).view(-1, 4)
    return {
        ENCODED: encoded,
        "length": lengths,
        "box": boxes,
        "size": torch.tensor([size], dtype=torch.int64).expand(len(flat), 2).contiguous(),
    }


def is_encoded(images) -> bool:
    """Whether a batch's images are encoded rows (decode_rows makes them pixels)."""
    return isinstance(images, dict) and ENCODED in images


class Decoded(NamedTuple):
    """decode_rows's batch: its pixels, how many rows the workers had decoded, and the rows no decoder could read."""

    pixels: torch.Tensor  # (b, H, W, 3) uint8 on the device
    host_decoded: int
    unreadable: list[int]  # rows left black (their JPEG decoded neither on the device nor by PIL)


def decode_rows(
    rows: dict[str, torch.Tensor],
    device: torch.device | str,
    interpolation: T.InterpolationMode = T.InterpolationMode.BICUBIC,
) -> Decoded:
    """An encoded batch (on the host) as (b, H, W, 3) uint8 pixels on `device`: the JPEGs in one decode_jpeg call on
    the device, each cropped to its box and resized to the output (torchvision's resized_crop with the crop's
    `interpolation`, antialiased); the others' pixels copied as they are. Should the batch's call fail (a JPEG whose
    body is corrupt past what its worker checks), each is decoded on its own, and one the device cannot read is
    decoded by PIL on the host; one nothing reads is left black and named in `unreadable`."""
    lengths, boxes = rows["length"].tolist(), rows["box"].tolist()  # host tensors: no device sync
    count = len(lengths)
    height, width = rows["size"][0].tolist() if count else (0, 0)
    out = torch.zeros(count, height, width, 3, dtype=torch.uint8, device=device)
    jpegs = [row for row in range(count) if boxes[row][0] >= 0]
    files = [rows[ENCODED][row, : lengths[row]] for row in jpegs]
    unreadable: list[int] = []
    for row, data, image in zip(jpegs, files, _decoded(files, device)):
        if image is None:
            image = _decoded_by_pil(data, device)
        if image is None:
            unreadable.append(row)
            continue
        top, left, h, w = boxes[row]
        cropped = F.resized_crop(image, top, left, h, w, [height, width], interpolation=interpolation, antialias=True)
        out[row] = cropped.permute(1, 2, 0)
    on_host = [row for row in range(count) if boxes[row][0] < 0]
    for row in on_host:
        pixels = rows[ENCODED][row, : lengths[row]].view(height, width, 3)
        out[row] = pixels.to(device, non_blocking=True)
    return Decoded(out, len(on_host), unreadable)


def _decoded(files: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor | None]:
    """decode_jpeg's (3, h, w) RGB of each file on `device`, in one call; where it fails, each on its own (None
    where that fails)."""
    decode = jpeg_decoder()[1]
    if not files:
        return []  # decode_jpeg refuses an empty list
    try:
        return list(decode(files, device=device))
    except RuntimeError:
        pass
    each: list[torch.Tensor | None] = []
    for data in files:
        try:
            each.append(cast(torch.Tensor, decode(data, device=device)))
        except RuntimeError:
            each.append(None)
    return each


@functools.cache
def jpeg_decoder() -> tuple[str, Callable[..., torch.Tensor | list[torch.Tensor]]]:
    """(whose, decode_jpeg(source or list of them, device=) -> RGB (3, h, w) uint8): TorchCodec's where it is
    installed and decodes (torchvision deprecated its own in 0.29 for it: the same call, the same pixels), else
    torchvision's, else a ConfigError. A TorchCodec that will not load or decode (built for another torch) is said
    in a warning, once, and torchvision's is used."""
    try:
        from torchcodec.decoders import decode_jpeg as torchcodecs

        decode = functools.partial(torchcodecs, mode="RGB")
        decode(_tiny_jpeg())  # its native library loads, and is this torch's
        return "torchcodec", decode
    except ImportError:
        pass
    except Exception as error:  # noqa: BLE001 -- any failure of an optional decoder: said, and the other one used
        log.warning("TorchCodec's decode_jpeg does not work here (%s); torchvision's decodes instead", words(error))
    try:  # deprecated since torchvision 0.29; imported here so a release without it fails only device decoding
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as error:
        raise ConfigError(
            f"data.decode_on=device needs a JPEG decoder on the device: TorchCodec's (pip install torchcodec, the "
            f"release built for this torch) or torchvision.io.decode_jpeg, which this torchvision lacks ({error}); "
            "or leave data.decode_on=host"
        ) from None
    return "torchvision", functools.partial(decode_jpeg, mode=ImageReadMode.RGB)


def _tiny_jpeg() -> torch.Tensor:
    """An 8×8 JPEG's bytes (a decoder's probe)."""
    encoded = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 64, 32)).save(encoded, format="JPEG")
    return torch.frombuffer(bytearray(encoded.getvalue()), dtype=torch.uint8)


def _decoded_by_pil(data: torch.Tensor, device: torch.device | str) -> torch.Tensor | None:
    """(3, h, w) RGB of a JPEG decode_jpeg refused, decoded by PIL on the host (as the host path would), on `device`;
    None where PIL cannot read it either."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as opened:
            pixels = np.array(opened.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError):
        return None
    return torch.from_numpy(pixels).permute(2, 0, 1).to(device)


def whole_jpeg(data: bytes) -> bool:
    """Whether a JPEG's last scan is followed by its end-of-image marker: a truncated file's is not (entropy-coded
    data stuffs every 0xFF, so the marker cannot occur inside it; an EXIF thumbnail's comes before the scans)."""
    last_scan = data.rfind(b"\xff\xda")
    return last_scan > 0 and data.find(b"\xff\xd9", last_scan) > 0
