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
output is copied exactly). A NaFlex batch's views (`local_patch_views`) are drawn, resampled and augmented the same
way, from each image put back together from its patches (keyed by the patches: a batch's padding adds nothing to a
key), each a full grid of a quarter of the side of a square image of the batch's sequence length (4 × 4 patches
at 256: view_grid), so they too are the sample's own on any world size, and a batch of views has no padding.
"""

from __future__ import annotations

import functools
import hashlib
import math
import weakref
from typing import NamedTuple

import torch
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
    uniforms: torch.Tensor, height, width, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top, left, h, w) of boxes drawn as torchvision's RandomResizedCrop.get_params draws one, from `uniforms`
    (..., TRIES, 4): each try's area fraction uniform in `scale`, log aspect uniform in log `ratio`, top and left
    uniform where the box fits; the first try that fits, else the whole image clipped to the ratio's range. The
    image's `height` and `width`: ints, or tensors that broadcast to uniforms.shape[:-2] (each box its own image's).
    Tensor operations only: no host sync."""
    per_image = isinstance(height, torch.Tensor)
    if per_image:
        height, width = (torch.as_tensor(side, dtype=torch.float64, device=uniforms.device) for side in (height, width))
    tall, wide = (height[..., None], width[..., None]) if per_image else (height, width)  # over the tries
    low, high = torch.log(torch.tensor(ratio)).tolist()  # float32 logs, as torchvision takes them
    fraction = (scale[0] + (scale[1] - scale[0]) * uniforms[..., 0]).float().double()  # its draws are float32
    aspect = torch.exp((low + (high - low) * uniforms[..., 1]).float()).double()
    target = tall * wide * fraction
    w, h = torch.round(torch.sqrt(target * aspect)), torch.round(torch.sqrt(target / aspect))
    fits = (w > 0) & (w <= wide) & (h > 0) & (h <= tall)
    first = fits.to(torch.uint8).argmax(-1, keepdim=True)  # the first try that fits (the first of equal maxima)

    def chosen(values: torch.Tensor) -> torch.Tensor:
        return values.gather(-1, first).squeeze(-1)

    h, w = chosen(h), chosen(w)
    top = torch.floor(chosen(uniforms[..., 2]) * (height - h + 1))
    left = torch.floor(chosen(uniforms[..., 3]) * (width - w + 1))
    found = fits.any(-1)
    whole = crop_box_whole(height, width, ratio)
    return tuple(torch.where(found, ours, theirs) for ours, theirs in zip((top, left, h, w), whole))  # type: ignore[return-value]


def crop_box_whole(height, width, ratio: tuple[float, float]) -> tuple:
    """torchvision's box after its tries: the whole image, clipped to the ratio range, centred; of ints (Python
    numbers out, as torchvision computes them) or of float64 tensors of the images' sides (tensors out: Python's
    round and torch's both round half to even)."""
    low, high = min(ratio), max(ratio)
    in_ratio = width / height
    if not isinstance(height, torch.Tensor):
        w = round(height * high) if in_ratio > high else width
        h = round(width / low) if in_ratio < low else height
        return float((height - h) // 2), float((width - w) // 2), float(h), float(w)
    w = torch.where(in_ratio > high, torch.round(height * high), width)
    h = torch.where(in_ratio < low, torch.round(width / low), height)
    return torch.div(height - h, 2, rounding_mode="floor"), torch.div(width - w, 2, rounding_mode="floor"), h, w


BOX_DRAWS = 4 * TRIES + 1  # a view's box and flip


def view_uniforms(
    keys: torch.Tensor, crops: int, augmented: bool, seed: int, step: int, purpose: str = "view:"
) -> torch.Tensor:
    """(b, crops, count) draws for each sample's views: its box and flip, then its augmentation's."""
    count = BOX_DRAWS + (view_augment.DRAWS if augmented else 0)
    return draws(keys, seed, step, purpose, crops * count).view(len(keys), crops, count)


def resampled_views(
    pixels: torch.Tensor,
    height,
    width,
    uniforms: torch.Tensor,
    size: tuple[int, int],
    scale: tuple[float, float],
    ratio: tuple[float, float],
    augmentation: tuple | None = None,
    transposed: torch.Tensor | None = None,
    fill: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The views (rows·crops, C, *size) of images in `pixels` (rows, C, H, W), each image `height` × `width` (ints,
    or (rows, 1) tensors: image i in the top left of its canvas): each box drawn (crop_boxes) from `uniforms` (rows,
    crops, count: view_uniforms), all resampled in one roi_align, flipped, and with `augmentation`
    (view_augment.augment's mean, std, blur scale — a float, or (rows,) one an image with its largest after it)
    augmented; in float32, or float64 where the pixels are.
    `transposed` (rows,) bool: those images lie transposed in `pixels` (their boxes drawn in the image's own
    orientation, cut from the transposed canvas, the views transposed back where there is no `fill`; square views
    only). `fill` ((rows, 1) heights, widths, in the canvas's orientation): each view is its image's own size,
    resampled into the top left `fill` of the output (its box stretched by size / fill: the same samples as a
    resize to `fill` alone) and flipped and augmented there as on its own (view_augment.augment's `extent`); the
    output stays in the canvas's orientation."""
    rows, crops = uniforms.shape[:2]
    top, left, h, w = crop_boxes(uniforms[..., : BOX_DRAWS - 1].unflatten(-1, (TRIES, 4)), height, width, scale, ratio)
    if transposed is not None:
        turn = transposed[:, None]
        top, left, h, w = (torch.where(turn, a, b) for a, b in ((left, top), (top, left), (w, h), (h, w)))
    if fill is not None:
        h, w = h * size[0] / fill[0], w * size[1] / fill[1]
    row = torch.arange(rows, device=pixels.device, dtype=top.dtype)[:, None].expand(rows, crops)
    boxes = torch.stack([row, left, top, left + w, top + h], -1).flatten(0, 1)
    exact = pixels if pixels.dtype in (torch.float32, torch.float64) else pixels.float()
    views = roi_align(exact, boxes.to(exact.dtype), output_size=size, sampling_ratio=-1, aligned=True)
    flips = (uniforms[..., BOX_DRAWS - 1] < 0.5).flatten()
    extent: tuple[torch.Tensor, torch.Tensor] | None = None
    if fill is None:
        if transposed is not None:
            views = torch.where(transposed.repeat_interleave(crops)[:, None, None, None], views.mT, views)
        views = torch.where(flips[:, None, None, None], views.flip(-1), views)
    else:
        extent = (fill[0].expand(rows, crops).flatten(), fill[1].expand(rows, crops).flatten())
        turned = transposed.repeat_interleave(crops) if transposed is not None else torch.zeros_like(flips)
        views = _flipped_within(views, flips, turned, extent)
    if augmentation:
        blur = augmentation[2] if len(augmentation) > 2 else 1.0  # (mean, std[, blur scale[, its largest]])
        if isinstance(blur, torch.Tensor):  # one an image: one a view
            blur = blur.repeat_interleave(crops)
        most = augmentation[3] if len(augmentation) > 3 else None
        picks = uniforms[..., BOX_DRAWS:].flatten(0, 1)
        views = view_augment.augment(
            views, picks, augmentation[0], augmentation[1], blur, extent=extent, most_blur=most
        )
    return views


def _flipped_within(
    views: torch.Tensor, flips: torch.Tensor, turned: torch.Tensor, extent: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Each view (n, C, H, W) whose image fills its top-left `extent` ((n,) heights, widths) flipped left-right
    within it where `flips`: along the rows for a `turned` (transposed) image, the columns otherwise."""
    heights, widths = extent
    across = torch.arange(views.shape[3], device=views.device)
    down = torch.arange(views.shape[2], device=views.device)
    flip_x = flips & ~turned
    flip_y = flips & turned
    x = torch.where(flip_x[:, None] & (across < widths[:, None]), widths[:, None] - 1 - across, across)
    y = torch.where(flip_y[:, None] & (down < heights[:, None]), heights[:, None] - 1 - down, down)
    return view_augment.remapped(views, y, x)


def local_views(
    images: torch.Tensor,
    *,
    crops: int,
    size: tuple[int, int],
    scale: tuple[float, float] = (0.05, 0.4),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    seed: int = 0,
    step: int = 0,
    augmentation: tuple | None = None,
) -> torch.Tensor:
    """`crops` local views of each of `images` (b, C, H, W), as (b, crops, C, *size) in the images' dtype: the
    boxes (crop_boxes) and flips drawn for the whole batch where the images are (draws), no host sync; with
    `augmentation` (view_augment.augment's mean, std and blur scale), each view then colour-jittered, grayed and
    blurred as DINO's local views are."""
    rows, channels, height, width = images.shape
    uniforms = view_uniforms(key_tensor(images), crops, augmentation is not None, seed, step)
    views = resampled_views(images, height, width, uniforms, size, scale, ratio, augmentation)
    return views.to(images.dtype).reshape(rows, crops, channels, *size)


GLOBAL_SCALE = (0.4, 1.0)  # DINO's global crops: 40-100% of the area


def global_views(
    images: torch.Tensor,
    *,
    seed: int = 0,
    step: int = 0,
    augmentation: tuple | None = None,
    scale: tuple[float, float] = GLOBAL_SCALE,
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """Each of `images` (b, C, H, W) as a global view at its own size, (b, C, H, W) in its dtype: a box of `scale`
    of its area (DINO's global crop) resized back, flipped, and with `augmentation` augmented as the local views are;
    drawn as local_views draws (another purpose: other draws), on the device, the sample's own on any rank."""
    rows, channels, height, width = images.shape
    uniforms = view_uniforms(key_tensor(images), 1, augmentation is not None, seed, step, "global:")
    views = resampled_views(images, height, width, uniforms, (height, width), scale, ratio, augmentation)
    return views.to(images.dtype)


SILC_VIEW = 96 / 224  # SILC's (and DINO's) local views: 96 pixels for a 224-pixel image


NAFLEX_VIEW = 1 / 4  # a NaFlex view's side: a quarter of a square image's (SILC's is 96/224 ≈ 0.43)


def view_grid(length: int) -> int:
    """A NaFlex view's side in patches at a batch's sequence length: a quarter of the side of a square image of that
    many patches (4 at 256 patches, 6 at 576, 8 at 1024), one patch at least. Each view is then 1/16 of the image's
    tokens and 8 views half of them, where SILC's fraction makes 8 views 1.5× the image's (the teacher terms on
    NaFlex are our extension; `crop_size` sets SILC's, e.g. 112 for patch 16 at 256)."""
    return max(1, round(math.sqrt(length) * NAFLEX_VIEW))


class _Canvas(NamedTuple):
    """A NaFlex batch's images put back together (patch_canvas)."""

    pixels: torch.Tensor  # (rows, C, H·P, W·P): each image in its top left, its edge pixels repeated past it
    heights: torch.Tensor  # (rows,) each image's grid, in patches
    widths: torch.Tensor
    wide: torch.Tensor  # (rows,) bool: the image lies transposed on the canvas
    down: torch.Tensor  # (rows,) its rows and columns on the canvas, in patches (max and min of its sides)
    across: torch.Tensor
    at: tuple[torch.Tensor, torch.Tensor]  # (rows, L) the canvas cell of each patch slot (padding's: (H, 0))
    patch: int  # the patches' side in pixels


def patch_canvas(images: dict[str, torch.Tensor], patch_size: int) -> _Canvas:
    """The images of a NaFlex batch ({patches (b, L, P·P·C), patch_coord (b, L, 2) as (y, x), patch_valid (b, L)})
    put back together from their patches on one canvas, each in its top left — a wide image transposed, so the canvas
    is at most L × √L patches whatever the batch's aspect ratios — its edge pixels repeated past it (a box at its
    edge samples as on the image alone). One read back: the canvas's size."""
    patches, coord, valid = images["patches"], images["patch_coord"], images["patch_valid"]
    rows, length, _ = patches.shape
    side = patch_size
    y, x = torch.where(valid, coord[..., 0], -1), torch.where(valid, coord[..., 1], -1)
    heights, widths = y.amax(1) + 1, x.amax(1) + 1  # each image's grid
    wide = widths > heights
    down, across = torch.maximum(heights, widths), torch.minimum(heights, widths)  # the canvas's, wide ones turned
    canvas_h, canvas_w = torch.stack([down.max(), across.max()]).tolist()
    cells = patches.view(rows, length, side, side, -1)
    cells = torch.where(wide[:, None, None, None, None], cells.transpose(2, 3), cells)
    canvas = cells.new_zeros(rows, canvas_h + 1, canvas_w, side, side, cells.shape[-1])  # the last row: padding's
    at_row = torch.arange(rows, device=patches.device)[:, None].expand(rows, length)
    at_y = torch.where(valid, torch.where(wide[:, None], x, y), canvas_h)
    at_x = torch.where(valid, torch.where(wide[:, None], y, x), 0)
    canvas.index_put_((at_row, at_y, at_x), cells)
    pixels = canvas[:, :canvas_h].permute(0, 5, 1, 3, 2, 4).reshape(rows, -1, canvas_h * side, canvas_w * side)
    pixels = _edges_repeated(pixels, down * side, across * side)
    return _Canvas(pixels, heights, widths, wide, down, across, (at_y, at_x), side)


def local_patch_views(
    images: dict[str, torch.Tensor],
    *,
    crops: int,
    patch_size: int,
    grid: int = 0,
    scale: tuple[float, float] = (0.05, 0.4),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    seed: int = 0,
    step: int = 0,
    augmentation: tuple | None = None,
) -> dict[str, torch.Tensor]:
    """`crops` local views of each image of a NaFlex batch (patch_canvas's), as a NaFlex batch of b·crops rows
    (image i's views at rows i·crops …), each a full `grid` × `grid` of patches (0: view_grid(L)), no padding: their
    boxes drawn in the images' pixels (patch_canvas), as local_views draws them, resampled and augmented as there
    (resampled_views), and cut into patches again."""
    patches, coord = images["patches"], images["patch_coord"]
    rows, length, _ = patches.shape
    side, grid = patch_size, grid or view_grid(length)
    canvas = patch_canvas(images, patch_size)
    uniforms = view_uniforms(key_tensor(patches), crops, augmentation is not None, seed, step)
    shape = (canvas.heights * side)[:, None], (canvas.widths * side)[:, None]
    views = resampled_views(
        canvas.pixels, *shape, uniforms, (grid * side,) * 2, scale, ratio, _own_blur(augmentation, canvas), canvas.wide
    )
    views = views.to(patches.dtype).view(rows * crops, -1, grid, side, grid, side).permute(0, 2, 4, 3, 5, 1)
    yx = torch.stack(torch.meshgrid(*(torch.arange(grid, device=patches.device),) * 2, indexing="ij"), -1)
    return {
        "patches": views.reshape(rows * crops, grid * grid, -1),
        "patch_coord": yx.reshape(1, grid * grid, 2).expand(rows * crops, -1, -1).to(coord.dtype),
        "patch_valid": torch.ones(rows * crops, grid * grid, dtype=torch.bool, device=patches.device),
    }


def global_patch_views(
    images: dict[str, torch.Tensor],
    *,
    patch_size: int,
    seed: int = 0,
    step: int = 0,
    augmentation: tuple | None = None,
    scale: tuple[float, float] = GLOBAL_SCALE,
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> dict[str, torch.Tensor]:
    """Each image of a NaFlex batch as its global view, in its own patches' places (coordinates and validity as
    given): global_views's box of 40-100% of the image, drawn with the same draws, resized back to the image's size
    in one roi_align over the batch's canvas (patch_canvas), flipped and augmented as that image alone would be."""
    patches, valid = images["patches"], images["patch_valid"]
    rows, length, _ = patches.shape
    side = patch_size
    canvas = patch_canvas(images, patch_size)
    uniforms = view_uniforms(key_tensor(patches), 1, augmentation is not None, seed, step, "global:")
    shape = (canvas.heights * side)[:, None], (canvas.widths * side)[:, None]
    fill = (canvas.down * side)[:, None], (canvas.across * side)[:, None]
    size = (canvas.pixels.shape[2], canvas.pixels.shape[3])
    augmented = _own_blur(augmentation, canvas)
    views = resampled_views(canvas.pixels, *shape, uniforms, size, scale, ratio, augmented, canvas.wide, fill=fill).to(
        patches.dtype
    )
    grid_h, grid_w = size[0] // side, size[1] // side
    cells = views.view(rows, -1, grid_h, side, grid_w, side).permute(0, 2, 4, 3, 5, 1)  # (rows, H, W, P, P, C)
    at_y, at_x = canvas.at
    at_row = torch.arange(rows, device=patches.device)[:, None].expand(rows, length)
    taken = cells[at_row, at_y.clamp(max=grid_h - 1), at_x]  # (rows, L, P, P, C)
    taken = torch.where(canvas.wide[:, None, None, None, None], taken.transpose(2, 3), taken)
    return {**images, "patches": torch.where(valid[..., None], taken.reshape(rows, length, -1), patches)}


def _own_blur(augmentation: tuple | None, canvas: _Canvas) -> tuple | None:
    """A NaFlex batch's augmentation (mean, std): the blur's scale each image's own, its side √(h·w) (pixels) over
    DINO's 224 as a fixed-size image's is, and its largest possible (the canvas's longest side's) for the taps."""
    if augmentation is None:
        return None
    own = torch.sqrt((canvas.heights * canvas.widths).double()) * canvas.patch / view_augment.DINO_SIDE
    return (augmentation[0], augmentation[1], own, canvas.pixels.shape[2] / view_augment.DINO_SIDE)


def _edges_repeated(pixels: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """`pixels` (rows, C, H, W) with each image's last row and column (at `heights`, `widths` (rows,)) repeated to
    the canvas's edge: roi_align clamps a sample past an image's edge to it; a canvas's padding must not blend in."""
    down = torch.minimum(torch.arange(pixels.shape[2], device=pixels.device), heights[:, None] - 1)
    across = torch.minimum(torch.arange(pixels.shape[3], device=pixels.device), widths[:, None] - 1)
    return view_augment.remapped(pixels, down, across)


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
