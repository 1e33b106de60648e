"""Local views: K crops of every image of a batch, drawn on the device and seeded by the sample, not by the rank.

    views = local_views(images, crops=4, size=(96, 96), scale=(0.05, 0.4), seed=0, step=17)   # (b, K, C, 96, 96)
    masks = patch_masks(images, patches=196, ratio=0.5, seed=0, step=17)                    # (b, 196) bool

Self-distillation (SILC, and SigLIP 2 after it) has a student see local crops of an image whose whole the teacher
sees. Here the crops are cut from the batch's images as the step holds them (on the device, after the loader's
augmentation; SigLIP's own images are resized, not cropped, so a crop of them is a crop of the photograph), so the
loader, its workers and what travels to the device are unchanged.

Each crop's box is drawn as torchvision's `RandomResizedCrop.get_params` draws one — an area fraction uniform in
`scale`, a log-uniform aspect ratio in `ratio`, ten tries, then the whole image clipped to the ratio's range — and
is flipped left-right with probability 1/2. The draws are a counter-based hash of (seed, step, the sample's key, the
draw's index) (`draws`), made for the whole batch at once on the device: no host sync and no Python loop over the
samples. The key is an exact integer function of the image's pixels (`key_tensor`), so a sample gets the same crops
at a step on any number of ranks, in any gradient-caching chunk, at any row of the batch, and after a resume on
another world size; nothing is drawn from the rank's RNG. All crops of the batch are resampled in one call of
torchvision's
`roi_align` (bilinear, pixel-aligned, each output pixel the mean of ⌈box / output⌉² samples: a box the size of its
output is copied exactly). A NaFlex batch's views (`local_patch_views`) are boxes of each image's patch grid drawn the
same way in patch units, at the patches' own resolution, keyed by the patches (a batch's padding adds nothing to a
key), so they too are the sample's own on any world size; their boxes are cut on the host, one image at a time.
"""

from __future__ import annotations

import functools
import hashlib
import weakref

import torch
from torch.nn.utils.rnn import pad_sequence
from torchvision.ops import roi_align

from clipdist.data import view_augment

_KEY_WEIGHT_SEED = 0x5EED  # the fixed weights of sample_keys


def key_tensor(images: torch.Tensor) -> torch.Tensor:
    """An integer per image (b, ...), from its pixels alone and exactly, as an int64 tensor where the images are (no
    host sync): Σ round(256·x)·w over its values with fixed integer weights w < 2²⁰ (int64 arithmetic: no rounding,
    no dependence on the batch or the device's order of summation). Images that differ in a pixel by 1/256 or more
    get different keys but for a 2⁻⁶⁴ chance. The last batch's keys are kept while that tensor lives unchanged: the
    terms of a step each ask for them."""
    if _last_keys and _last_keys[0]() is images and _last_keys[1] == images._version:
        return _last_keys[2]
    flat = images.detach().flatten(1)
    quantized = (flat.float() * 256).round().to(torch.int64)
    keys = (quantized * _key_weights(flat.shape[1], flat.device)).sum(1)
    _last_keys[:] = [weakref.ref(images), images._version, keys]
    return keys


_last_keys: list = []  # [a weak reference to the last images, their version counter, their keys]


@functools.lru_cache(maxsize=4)
def _key_weights(length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_KEY_WEIGHT_SEED)
    return torch.randint(1, 1 << 20, (length,), generator=generator, dtype=torch.int64).to(device)


_M32 = 0xFFFFFFFF


def _mix(x):
    """A 32-bit integer hash (Wellons' lowbias32 with multipliers below 2³¹: every product fits in int64), the same
    on a Python int and on an int64 tensor of values in [0, 2³²)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _absorb(state, word):
    return _mix(((state ^ word) + 0x9E3779B9) & _M32)


def draws(keys: torch.Tensor, seed: int, step: int, purpose: str, count: int) -> torch.Tensor:
    """`count` numbers uniform in (0, 1) for each sample, (b, count) float64 where `keys` (b,) are: a hash of (purpose,
    seed, step, the sample's key, the draw's index) — counter-based, so they are made for the whole batch at once
    on the device, with no host sync, and are the sample's own on any rank, row or chunk."""
    state = int.from_bytes(hashlib.blake2b(purpose.encode(), digest_size=4).digest(), "little")
    for word in (seed & _M32, (seed >> 32) & _M32, step & _M32, (step >> 32) & _M32):
        state = _absorb(state, word)
    state = _absorb(_absorb(torch.full_like(keys, state), keys & _M32), (keys >> 32) & _M32)
    index = torch.arange(count, dtype=torch.int64, device=keys.device)
    return (_absorb(state[:, None], index[None, :]).double() + 0.5) / 2.0**32


TRIES = 10  # torchvision's RandomResizedCrop tries a box this many times, then takes the whole image


def crop_boxes(
    uniforms: torch.Tensor, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top, left, h, w) of boxes drawn as torchvision's RandomResizedCrop.get_params draws one, from `uniforms`
    (..., TRIES, 4): each try's area fraction uniform in `scale`, log aspect uniform in log `ratio`, top and left
    uniform where the box fits; the first try that fits, else the whole image clipped to the ratio's range. Tensor
    operations only: no host sync."""
    area = height * width
    low, high = torch.log(torch.tensor(ratio)).tolist()  # float32 logs, as torchvision takes them
    fraction = (scale[0] + (scale[1] - scale[0]) * uniforms[..., 0]).float().double()  # its draws are float32
    aspect = torch.exp((low + (high - low) * uniforms[..., 1]).float()).double()
    target = area * fraction
    w, h = torch.round(torch.sqrt(target * aspect)), torch.round(torch.sqrt(target / aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.to(torch.uint8).argmax(-1, keepdim=True)  # the first try that fits (the first of equal maxima)

    def chosen(values: torch.Tensor) -> torch.Tensor:
        return values.gather(-1, first).squeeze(-1)

    h, w = chosen(h), chosen(w)
    top = torch.floor(chosen(uniforms[..., 2]) * (height - h + 1))
    left = torch.floor(chosen(uniforms[..., 3]) * (width - w + 1))
    whole = crop_box_whole(height, width, ratio)
    found = fits.any(-1)
    return tuple(torch.where(found, ours, float(theirs)) for ours, theirs in zip((top, left, h, w), whole))  # type: ignore[return-value]


def crop_box_whole(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision's box after its tries: the whole image, clipped to the ratio range, centred."""
    in_ratio = width / height
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
    normalised: tuple | None = None,
) -> torch.Tensor:
    """`crops` local views of each of `images` (b, C, H, W), as (b, crops, C, *size) in the images' dtype: the
    boxes (crop_boxes) and flips drawn for the whole batch where the images are (draws), no host sync; with
    `normalised` (the images' mean and std), each view then colour-jittered, grayed and blurred as DINO's local views
    are (view_augment)."""
    rows, channels, height, width = images.shape
    box_draws = 4 * TRIES + 1
    count = box_draws + (view_augment.DRAWS if normalised else 0)
    uniforms = draws(key_tensor(images), seed, step, "view:", crops * count).view(rows, crops, count)
    top, left, h, w = crop_boxes(uniforms[..., : box_draws - 1].unflatten(-1, (TRIES, 4)), height, width, scale, ratio)
    row = torch.arange(rows, device=images.device, dtype=top.dtype)[:, None].expand(rows, crops)
    boxes = torch.stack([row, left, top, left + w, top + h], -1).flatten(0, 1).float()
    views = roi_align(images.float(), boxes, output_size=size, sampling_ratio=-1, aligned=True)
    flips = (uniforms[..., box_draws - 1] < 0.5).flatten()
    views = torch.where(flips[:, None, None, None], views.flip(-1), views)
    if normalised:
        views = view_augment.augment(views, uniforms[..., box_draws:].flatten(0, 1), *normalised)
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
    uniforms = draws(key_tensor(patches), seed, step, "view:", crops * (4 * TRIES + 1)).view(rows, crops, -1).cpu()
    views: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (flat source index, coordinates, flipped) a view
    for row in range(rows):
        own = valid[row].nonzero()[:, 0]
        yx = coord[row, own]
        height, width = int(yx[:, 0].max()) + 1, int(yx[:, 1].max()) + 1
        where = torch.full((height, width), -1, dtype=torch.long)  # each grid cell's flat source index (-1: none)
        where[yx[:, 0], yx[:, 1]] = row * length + own
        boxes = crop_boxes(uniforms[row, :, :-1].unflatten(-1, (TRIES, 4)), height, width, scale, ratio)
        for k, (top, left, h, w) in enumerate(zip(*(part.long().tolist() for part in boxes))):
            flipped = bool(uniforms[row, k, -1] < 0.5)
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
    """Which of each image's `patches` patches are masked, (b, patches) bool where the images are: max(1,
    round(ratio · n)) of its n patches (`valid` (b, patches): a NaFlex row's own, its padding never masked; else all),
    a uniform draw without replacement — the n lowest of a score per patch (draws) — seeded as its views are (the
    same mask for a sample everywhere: `images` are the pixels keyed, a NaFlex batch's patches, whose padding adds
    nothing to a key). No host sync."""
    scores = draws(key_tensor(images), seed, step, "mask:", patches)
    counts = torch.full((len(images),), patches, device=images.device) if valid is None else valid.sum(1)
    if valid is not None:
        scores = scores.masked_fill(~valid, 2.0)  # after every valid patch
    chosen = torch.round(ratio * counts.double()).clamp_min(1)
    return scores.argsort(1).argsort(1) < chosen[:, None]
