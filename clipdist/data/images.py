"""A batch's images and captions to tensors: each image decoded no larger than its crop needs, and
what can run once per batch run once per batch."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms.functional import pil_modes_mapping

from clipdist.data.device_decode import check_transform, encode, encoded_rows
from clipdist.data.samples import EncodedImage, load_rgb

_BYTE_MODES = ("L", "RGB", "RGBA")  # PIL modes whose pixels are uint8, one byte per channel


def decode_whole(image: EncodedImage | Image.Image) -> Image.Image:
    return load_rgb(image)[0]


class ReducedDecodeCrop:
    """torchvision's RandomResizedCrop applied to an image not decoded yet: the crop box is drawn first,
    exactly as RandomResizedCrop draws it (the same generator calls, from the size in the image's header),
    then the image is decoded at the smallest size at which the box still spans the output size
    (load_rgb: libjpeg's DCT scaling, by eighths), and the box is resampled to the output size straight
    from that (PIL's resize with `box`: no cropped copy), with the transform's interpolation.

    So the augmentation distribution is the transform's, box for box under the same seed; only the
    resampling differs — from an image the IDCT has already low-passed, never below the output size
    (mean |difference| ~1 of 255 levels). On 256-512 px web JPEGs at 224 px: decode + crop + resize
    4.3 -> 3.1 ms an image (PIL decode + RandomResizedCrop against this; README has the loader's figures)."""

    def __init__(self, crop: T.RandomResizedCrop):
        self.crop = crop
        self.height, self.width = crop.size
        self.resample = pil_modes_mapping[crop.interpolation]

    def __call__(self, image: EncodedImage | Image.Image) -> Image.Image:
        opened = image.opened if isinstance(image, EncodedImage) else image
        top, left, height, width = self.crop.get_params(opened, self.crop.scale, self.crop.ratio)
        # the whole image at the scale that maps the box onto at least the output size
        scale = max(self.width / width, self.height / height)
        decoded, scale = load_rgb(image, (math.ceil(opened.size[0] * scale), math.ceil(opened.size[1] * scale)))
        box = (left * scale, top * scale, (left + width) * scale, (top + height) * scale)
        return decoded.resize((self.width, self.height), self.resample, box=box)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.crop})"


class ImageBatcher:
    """`transform` (a torchvision Compose, e.g. open_clip.image_transform's) over a batch of images,
    each given as its header and bytes (samples.open_image) or as a PIL image: decoding, as 8-bit RGB, is
    the batcher's.

    When it starts with a RandomResizedCrop (open_clip's training transform), the crop decodes the
    image no larger than the crop needs (ReducedDecodeCrop); otherwise the image is decoded in full.
    When it ends with ToTensor + Normalize, as open_clip's and torchvision's usual pipelines do, the
    steps before them run per image (crops, resizes: PIL), and the two last ones run once on the
    stacked uint8 batch: x = (u8 / 255 − mean) / std with the same float32 operations, element for
    element, as ToTensor and Normalize do per image — the result is bit-identical (tested), without
    ~200 small tensor ops per image (loader, batch of 128: 21 → 2 ms). Any other transform, or an
    image that is not 8-bit L/RGB/RGBA after the per-image steps, takes the per-image path.

    `encoded` (data.decode_on=device): a JPEG is not decoded here; its bytes and its crop box are handed over
    (device_decode), and the batch is an encoded one. The transform must then only crop and normalise.
    """

    def __init__(self, transform, encoded: bool = False):
        steps = list(transform.transforms) if isinstance(transform, T.Compose) else [transform]
        self.encoded_crop = check_transform(steps) if encoded else None
        self.decode = decode_whole
        if isinstance(steps[0], T.RandomResizedCrop) and steps[0].interpolation in pil_modes_mapping:
            self.decode = ReducedDecodeCrop(steps[0])
            steps = steps[1:]
            transform = T.Compose(steps)
        if len(steps) >= 2 and isinstance(steps[-2], T.ToTensor) and isinstance(steps[-1], T.Normalize):
            self.per_image, self.to_tensor, self.normalize = T.Compose(steps[:-2]), steps[-2], steps[-1]
            self.pixel_normalize = PixelNormalize(self.normalize.mean, self.normalize.std)
        else:
            self.per_image, self.to_tensor, self.normalize = transform, None, None

    def __call__(self, image: EncodedImage | Image.Image):
        """Decode, then the per-image steps: a uint8 (H, W, C) tensor where the batch conversion applies,
        else the transform's own output; encoded, a device_decode.EncodedCrop."""
        if self.encoded_crop is not None:  # a JPEG's bytes and box; any other image decoded here, as below
            return encode(self.encoded_crop, image, self._decoded)
        return self._decoded(image)

    def _decoded(self, image: EncodedImage | Image.Image):
        """The host path: decoded, then the per-image steps (an encoded batch's image: load_rgb's RGB, cropped and
        resized, as (H, W, 3) uint8)."""
        out = self.per_image(self.decode(image))
        if self.normalize is None:
            return out
        if isinstance(out, Image.Image) and out.mode in _BYTE_MODES:
            pixels = torch.from_numpy(np.array(out, dtype=np.uint8, copy=True))
            return pixels.unsqueeze(-1) if pixels.ndim == 2 else pixels
        return self.normalize(self.to_tensor(out))

    def stack(self, images: list, pixels: bool = False) -> torch.Tensor | dict[str, torch.Tensor]:
        """What __call__ returned for each image, as one batch: (B, C, H, W) float32, normalized. With
        `pixels`, where every image is 8-bit, (B, H, W, C) uint8 instead, for PixelNormalize on the device.
        Made in place in a batch_tensor: no intermediate batch-sized tensor, nothing copied to hand it over.
        Encoded: device_decode.encoded_rows."""
        if self.encoded_crop is not None:
            return encoded_rows(images, tuple(self.encoded_crop.size))  # type: ignore[arg-type]
        if all(map(self._is_pixels, images)):
            height, width, channels = images[0].shape
            if pixels:
                return torch.stack(images, out=batch_tensor((len(images), height, width, channels), torch.uint8))
            out = batch_tensor((len(images), channels, height, width), torch.float32)
            return self.pixel_normalize(torch.stack(images), out=out)
        return torch.stack(
            [self.normalize(self.to_tensor(image.numpy())) if self._is_pixels(image) else image for image in images]
        )

    @staticmethod
    def empty() -> torch.Tensor:
        """The images of an item with no rows (a worker none of whose readers' samples are this rank's)."""
        return torch.empty(0)

    def _is_pixels(self, image) -> bool:
        """Whether `image` is __call__'s uint8 (H, W, C), left for the batch conversion."""
        return self.normalize is not None and image.dtype == torch.uint8 and image.ndim == 3


class PixelNormalize:
    """(B, H, W, C) uint8 pixels -> the normalized (B, C, H, W) float32 batch, on the pixels' device:
    x = (u8 / 255 − mean) / std, the float32 operations ToTensor and Normalize do, element for element
    (bit-identical on the CPU, tested; a GPU kernel may round a division differently in the last bit).
    A float batch (normalized where it was made) is returned as it is.

    Where it runs is data.normalize_on: by default in the rank, after the copy — a quarter of float32's bytes
    through shared (and on CUDA pinned) memory, no float conversion in the workers, and on a CPU rank the
    floats written into memory its malloc reuses instead of fresh shared pages each batch."""

    def __init__(self, mean, std, device: torch.device | str = "cpu"):
        self.mean = torch.as_tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def __call__(self, batch: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`batch` normalized into `out` (a new (B, C, H, W) float32 tensor where None)."""
        if not isinstance(batch, torch.Tensor) or batch.dtype != torch.uint8:  # normalized, or a NaFlex mapping
            return batch
        size, height, width, channels = batch.shape
        if out is None:
            out = torch.empty(size, channels, height, width, dtype=torch.float32, device=batch.device)
        # the layout change as an exact uint8 -> float32 copy, then the arithmetic in place on contiguous floats:
        # one strided division (its uint8 -> float promotion per element) took 58 ms a 224-px batch of 128, this 21
        return out.copy_(batch.permute(0, 3, 1, 2)).div_(255).sub_(self.mean).div_(self.std)


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor for a batch. In a DataLoader worker it is made in shared memory, as default_collate
    makes its batches, so that handing it to the trainer copies nothing (a 128 x 224 px float32 batch is
    77 MB: made fresh, then copied into shared memory, it cost ~1 ms a sample)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    tensor = torch.empty(0, dtype=dtype)
    storage = tensor._typed_storage()._new_shared(math.prod(shape), device="cpu")
    return tensor.set_(storage, 0, shape)  # type: ignore[call-overload]  # a TypedStorage: torch types only the untyped


class CaptionTokens:
    """`tokenizer` over a batch of captions: the new ones in one call, each distinct caption tokenized
    once and remembered (up to `capacity`, the oldest forgotten first). Tokenizing is a pure function
    of the string, so the rows are the tokenizer's own; repeated captions (templated or class-name
    captions, duplicates in web data) cost a lookup instead of ~100 us of text cleaning and BPE."""

    def __init__(self, tokenizer, capacity: int = 1 << 14):
        self.tokenizer, self.capacity = tokenizer, capacity
        self.known: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __call__(self, captions: list[str]) -> torch.Tensor:
        new = list(dict.fromkeys(caption for caption in captions if caption not in self.known))
        if new:
            self.known.update(zip(new, self.tokenizer(new)))
        rows = torch.stack([self.known[caption] for caption in captions])
        while len(self.known) > self.capacity:
            self.known.popitem(last=False)
        return rows


def normalize_on_device(setting: str) -> tuple[bool, str]:
    """Whether the loader hands over uint8 pixels for the rank to normalize on its device (data.normalize_on), and
    why."""
    if setting != "auto":
        return setting == "device", f"data.normalize_on={setting}"
    # CPU ranks too: web_photos at 224 px, 1 rank 353 -> 438 samples/s, 2 ranks 404 -> 444 (docs/performance.md)
    return True, "data.normalize_on=auto: uint8 through shared memory, a quarter of float32's bytes"
