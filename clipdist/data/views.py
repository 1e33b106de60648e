"""Local views: K crops of every image of a batch, drawn on the device and seeded by the sample, not by the rank.

    views = local_views(images, crops=4, size=(96, 96), scale=(0.05, 0.4), seed=0, step=17)   # (b, K, C, 96, 96)
    masks = patch_masks(images, patches=196, ratio=0.5, seed=0, step=17)                    # (b, 196) bool

Self-distillation (SILC, and SigLIP 2 after it) has a student see local crops of an image whose whole the teacher
sees. Here the crops are cut from the batch's images as the step holds them (on the device, after the loader's
augmentation; SigLIP's own images are resized, not cropped, so a crop of them is a crop of the photograph), so the
loader, its workers and what travels to the device are unchanged.

Each crop's box is drawn as torchvision's `RandomResizedCrop.get_params` draws one — an area fraction uniform in
`scale`, a log-uniform aspect ratio in `ratio`, ten tries, then the whole image clipped to the ratio's range — and
is flipped left-right with probability 1/2, from a generator seeded by (seed, step, the sample's key). The key is
an exact integer function of the image's pixels (`sample_keys`), so a sample gets the same crops at a step on any
number of ranks, in any gradient-caching chunk, at any row of the batch, and after a resume on another world size;
nothing is drawn from the rank's RNG. All crops of the batch are resampled in one call of torchvision's
`roi_align` (bilinear, pixel-aligned, each output pixel the mean of ⌈box / output⌉² samples: a box the size of its
output is copied exactly). A NaFlex batch's views (`local_patch_views`) are boxes of each image's patch grid drawn the
same way in patch units, at the patches' own resolution, keyed by the patches (a batch's padding adds nothing to a
key), so they too are the sample's own on any world size.
"""

from __future__ import annotations

import functools
import hashlib
import math
import weakref

import torch
from torch.nn.utils.rnn import pad_sequence
from torchvision.ops import roi_align

_KEY_WEIGHT_SEED = 0x5EED  # the fixed weights of sample_keys


def sample_keys(images: torch.Tensor) -> list[int]:
    """An integer per image (b, C, H, W), from its pixels alone and exactly: Σ round(256·x)·w over its values with
    fixed integer weights w < 2²⁰ (int64 arithmetic: no rounding, no dependence on the batch or the device's order
    of summation). Images that differ in a pixel by 1/256 or more get different keys but for a 2⁻⁶⁴ chance. The
    last batch's keys are kept while that tensor lives unchanged: the terms of a step each ask for them."""
    if _last_keys and _last_keys[0]() is images and _last_keys[1] == images._version:
        return list(_last_keys[2])
    flat = images.detach().flatten(1)
    quantized = (flat.float() * 256).round().to(torch.int64)
    keys = (quantized * _key_weights(flat.shape[1], flat.device)).sum(1).tolist()
    _last_keys[:] = [weakref.ref(images), images._version, keys]
    return list(keys)


_last_keys: list = []  # [a weak reference to the last images, their version counter, their keys]


@functools.lru_cache(maxsize=4)
def _key_weights(length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_KEY_WEIGHT_SEED)
    return torch.randint(1, 1 << 20, (length,), generator=generator, dtype=torch.int64).to(device)


def view_seed(seed: int, step: int, key: int, purpose: str = "") -> int:
    """The generator seed of one sample's views (or, for another `purpose`, its patch mask) at one step: BLAKE2b of
    the numbers, the same everywhere."""
    digest = hashlib.blake2b(f"{purpose}{seed}:{step}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def crop_box(
    generator: torch.Generator, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """(top, left, h, w) as torchvision's RandomResizedCrop.get_params draws it, from `generator`."""
    area = height * width
    low, high = torch.log(torch.tensor(ratio)).tolist()  # float32 logs, as torchvision takes them
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(low, high, generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = width / height  # the whole image, clipped to the ratio range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def local_views(
    images: torch.Tensor,
    *,
    crops: int,
    size: tuple[int, int],
    scale: tuple[float, float] = (0.05, 0.4),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    seed: int = 0,
    step: int = 0,
) -> torch.Tensor:
    """`crops` local views of each of `images` (b, C, H, W), as (b, crops, C, *size) in the images' dtype."""
    rows, channels, height, width = images.shape
    boxes, flips = [], []
    for row, key in enumerate(sample_keys(images)):
        generator = torch.Generator().manual_seed(view_seed(seed, step, key))
        for _ in range(crops):
            top, left, h, w = crop_box(generator, height, width, scale, ratio)
            boxes.append((row, left, top, left + w, top + h))
            flips.append(bool(torch.rand(1, generator=generator).item() < 0.5))
    box_tensor = torch.tensor(boxes, dtype=torch.float32, device=images.device)
    views = roi_align(images.float(), box_tensor, output_size=size, sampling_ratio=-1, aligned=True)
    flipped = torch.tensor([view for view, flip in enumerate(flips) if flip], dtype=torch.long, device=images.device)
    if len(flipped):
        views[flipped] = views[flipped].flip(-1)
    return views.to(images.dtype).reshape(rows, crops, channels, *size)


def local_patch_views(
    images: dict[str, torch.Tensor],
    *,
    crops: int,
    patch_size: int,
    scale: tuple[float, float] = (0.05, 0.4),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    seed: int = 0,
    step: int = 0,
) -> dict[str, torch.Tensor]:
    """`crops` local views of each image of a NaFlex batch ({patches (b, L, P·P·C), patch_coord (b, L, 2) as (y, x),
    patch_valid (b, L)}), as a NaFlex batch of b·crops rows (image i's views at rows i·crops …): each view the patches
    of a box of the image's grid, drawn (and flipped) as local_views draws its boxes but in patch units, at the
    patches' own resolution (nothing resampled), its coordinates from (0, 0). Padded to the longest view."""
    patches, coord, valid = images["patches"], images["patch_coord"].cpu(), images["patch_valid"].cpu()
    rows, length, dim = patches.shape
    views: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (flat source index, coordinates, flipped) a view
    for row, key in enumerate(sample_keys(patches)):
        generator = torch.Generator().manual_seed(view_seed(seed, step, key))
        own = valid[row].nonzero()[:, 0]
        yx = coord[row, own]
        height, width = int(yx[:, 0].max()) + 1, int(yx[:, 1].max()) + 1
        where = torch.full((height, width), -1, dtype=torch.long)  # each grid cell's flat source index (-1: none)
        where[yx[:, 0], yx[:, 1]] = row * length + own
        for _ in range(crops):
            top, left, h, w = crop_box(generator, height, width, scale, ratio)
            flipped = bool(torch.rand(1, generator=generator).item() < 0.5)
            box = where[top : top + h, left : left + w]
            box = box.flip(1) if flipped else box
            present = box >= 0
            views.append((box[present], present.nonzero(), flipped))  # the view's raster order, from (0, 0)
    sizes = torch.tensor([len(source) for source, _, _ in views])
    longest = int(sizes.max())
    index = pad_sequence([source for source, _, _ in views], batch_first=True)
    view_coord = pad_sequence([at for _, at, _ in views], batch_first=True)
    view_valid = torch.arange(longest) < sizes[:, None]
    device = patches.device
    cut = patches.reshape(rows * length, dim)[index.to(device)]  # (views, longest, P·P·C), a copy: changed in place
    mirrored = torch.tensor([view for view, (_, _, flip) in enumerate(views) if flip], dtype=torch.long, device=device)
    if len(mirrored):  # each patch's pixels mirrored too (its columns), in the mirrored views only
        cut[mirrored] = (
            cut[mirrored].view(len(mirrored), longest, patch_size, patch_size, -1).flip(3).reshape(-1, longest, dim)
        )
    valid_on_device = view_valid.to(device)
    return {
        "patches": cut.masked_fill_(~valid_on_device[..., None], 0),  # padding zero, as a NaFlex batch's
        "patch_coord": view_coord.to(device),
        "patch_valid": valid_on_device,
    }


def patch_masks(
    images: torch.Tensor,
    patches: int,
    ratio: float,
    seed: int = 0,
    step: int = 0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which of each image's `patches` patches are masked, (b, patches) bool: max(1, round(ratio · n)) of its n
    patches (`valid` (b, patches): a NaFlex row's own, its padding never masked; else all), a uniform draw without
    replacement seeded as its views are (the same mask for a sample everywhere: `images` are the pixels keyed,
    a NaFlex batch's patches, whose padding adds nothing to a key)."""
    masks = torch.zeros(len(images), patches, dtype=torch.bool)
    valid = valid.cpu() if valid is not None else None  # one copy from the device, not one a row
    counts = valid.sum(1).tolist() if valid is not None else [patches] * len(images)
    for row, key in enumerate(sample_keys(images)):
        generator = torch.Generator().manual_seed(view_seed(seed, step, key, "mask:"))
        count, chosen = max(1, round(ratio * counts[row])), torch.randperm(counts[row], generator=generator)
        positions = chosen if valid is None else valid[row].nonzero()[:, 0][chosen]
        masks[row, positions[:count]] = True
    return masks.to(images.device)
