"""DINO's local-view augmentation, which SILC (and SigLIP 2 after it) uses, for a batch of views at once on the device:

    augmented = augment(views, uniforms, mean, std)     # views (n, 3, h, w) normalised; uniforms (n, DRAWS)

After the crop and flip (views.local_views), each view gets, as DINO's `flip_and_color_jitter` and local transform:
torchvision's ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1) with probability 0.8, its four
adjustments in a random order of their own; RandomGrayscale with probability 0.2; a Gaussian blur with probability
0.5, σ uniform in [0.1, 2] pixels. Every choice is one of the view's `uniforms` (views.draws: the sample's own at a
step on any rank), so a view is augmented the same everywhere and nothing reads back to the host. The adjustments
work on pixels in [0, 1]: the views are un-normalised with the model's mean and std, adjusted, and normalised back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

JITTER, BRIGHTNESS, CONTRAST, SATURATION, HUE = 0.8, 0.4, 0.4, 0.2, 0.1  # DINO's ColorJitter and its probability
GRAYSCALE, BLUR, SIGMA = 0.2, 0.5, (0.1, 2.0)  # DINO's local views: grayscale, blur and its σ range
DINO_SIDE = 224  # SIGMA is in pixels of an image this size: blur_scale = the image's side / DINO_SIDE
DRAWS = 13  # uniforms a view takes: jitter?, 4 factors, 4 order scores, grayscale?, blur?, σ, spare
_GRAY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


def augment(
    views: torch.Tensor,
    uniforms: torch.Tensor,
    mean,
    std,
    blur_scale: float | torch.Tensor = 1.0,
    extent: tuple[torch.Tensor, torch.Tensor] | None = None,
    most_blur: float | None = None,
) -> torch.Tensor:
    """`views` (n, 3, h, w), normalised by `mean` and `std`, augmented as the module docstring says by the choices
    in `uniforms` (n, DRAWS), in (0, 1); float32 in, float32 out. The blur's σ is DINO's times `blur_scale` (the
    images' side / 224: DINO's σ of 0.1-2 px is for 224-px images, and blurs a 32-px one's digits away). `extent`
    ((n,) heights, widths): each view is only its top-left extent (a NaFlex image on a canvas), augmented as that
    alone would be — the contrast's mean over it, the blur reflected at its edges — the rest left to be cut away.
    `blur_scale` may be one a view ((n,): each NaFlex image's own side), with `most_blur` its largest possible value
    (a Python number: how many taps the blur's convolution takes, with no read back)."""
    shape = (1, 3, 1, 1)
    mean_t = torch.as_tensor(mean, dtype=views.dtype, device=views.device).view(shape)
    std_t = torch.as_tensor(std, dtype=views.dtype, device=views.device).view(shape)
    pixels = (views * std_t + mean_t).clamp(0, 1)
    pixels = colour_jitter(pixels, uniforms[:, :9], _inside(pixels, extent))
    gray = grayscale(pixels).expand_as(pixels)
    pixels = torch.where(_each(uniforms[:, 9] < GRAYSCALE), gray, pixels)
    sigma = (SIGMA[0] + (SIGMA[1] - SIGMA[0]) * uniforms[:, 11]) * blur_scale
    if isinstance(blur_scale, torch.Tensor):
        widest, reach = SIGMA[1] * float(most_blur or 1.0), SIGMA[1] * blur_scale
    else:
        widest, reach = SIGMA[1] * blur_scale, None
    blurred = gaussian_blur(pixels, sigma, widest, extent, reach)
    pixels = torch.where(_each(uniforms[:, 10] < BLUR), blurred, pixels)
    return (pixels - mean_t) / std_t


def _inside(pixels: torch.Tensor, extent: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """(n, 1, h, w) weights: 1 inside each view's top-left extent, 0 past it; None without an extent."""
    if extent is None:
        return None
    height, width = pixels.shape[-2:]
    down = torch.arange(height, device=pixels.device)[None, :, None] < extent[0][:, None, None]
    across = torch.arange(width, device=pixels.device)[None, None, :] < extent[1][:, None, None]
    return (down & across).unsqueeze(1).to(pixels.dtype)


def colour_jitter(pixels: torch.Tensor, uniforms: torch.Tensor, inside: torch.Tensor | None = None) -> torch.Tensor:
    """ColorJitter(0.4, 0.4, 0.2, 0.1) applied where uniforms[:, 0] < 0.8: its factors from uniforms[:, 1:5], its
    order (torchvision's randperm of the four) the ranks of uniforms[:, 5:9]. `inside` (_inside): the contrast's mean
    over those pixels alone."""
    factor = lambda u, spread: 1 - spread + 2 * spread * u  # noqa: E731 -- uniform in [1 − s, 1 + s]
    brightness, contrast = factor(uniforms[:, 1], BRIGHTNESS), factor(uniforms[:, 2], CONTRAST)
    saturation, hue = factor(uniforms[:, 3], SATURATION), HUE * (2 * uniforms[:, 4] - 1)
    order = uniforms[:, 5:9].argsort(1)  # order[:, k]: the adjustment made k-th
    adjustments = (
        lambda x: (x * _each(brightness).to(x.dtype)).clamp(0, 1),
        lambda x: _blend(x, _mean_gray(x, inside), contrast),
        lambda x: _blend(x, grayscale(x), saturation),
        lambda x: adjust_hue(x, hue),
    )
    jittered = pixels
    for position in range(4):
        for index, adjust in enumerate(adjustments):
            jittered = torch.where(_each(order[:, position] == index), adjust(jittered), jittered)
    return torch.where(_each(uniforms[:, 0] < JITTER), jittered, pixels)


def _mean_gray(pixels: torch.Tensor, inside: torch.Tensor | None) -> torch.Tensor:
    """(n, 1, 1, 1): each view's mean luma (torchvision's adjust_contrast's), over `inside` where given."""
    gray = grayscale(pixels)
    if inside is None:
        return gray.mean((1, 2, 3), keepdim=True)
    return (gray * inside).sum((1, 2, 3), keepdim=True) / inside.sum((1, 2, 3), keepdim=True)


def _each(values: torch.Tensor) -> torch.Tensor:
    """(n,) → (n, 1, 1, 1): one value a view."""
    return values.view(-1, 1, 1, 1)


def _blend(pixels: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """torchvision's _blend: ratio · pixels + (1 − ratio) · other, clamped to [0, 1]."""
    ratio = _each(ratio).to(pixels.dtype)
    return (ratio * pixels + (1 - ratio) * other).clamp(0, 1)


def grayscale(pixels: torch.Tensor) -> torch.Tensor:
    """(n, 1, h, w): torchvision's luma of (n, 3, h, w) RGB."""
    weights = torch.tensor(_GRAY, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    return (pixels * weights).sum(1, keepdim=True)


def adjust_hue(pixels: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue with a shift a view (in turns, [−0.5, 0.5]): to HSV, the hue rotated, back to RGB."""
    r, g, b = pixels.unbind(1)
    value, _ = pixels.max(1)
    low, _ = pixels.min(1)
    flat = value == low
    chroma = value - low
    ones = torch.ones_like(value)
    saturation = chroma / torch.where(flat, ones, value)
    divisor = torch.where(flat, ones, chroma)
    rc, gc, bc = (value - r) / divisor, (value - g) / divisor, (value - b) / divisor
    hue = (value == r) * (bc - gc) + ((value == g) & (value != r)) * (2.0 + rc - bc)
    hue = hue + ((value != g) & (value != r)) * (4.0 + gc - rc)
    hue = ((hue / 6.0 + 1.0) % 1.0 + shift.to(pixels.dtype).view(-1, 1, 1)) % 1.0
    sector = torch.floor(hue * 6.0)
    fraction = hue * 6.0 - sector
    sector = sector.to(torch.int64) % 6
    p = (value * (1.0 - saturation)).clamp(0, 1)
    q = (value * (1.0 - saturation * fraction)).clamp(0, 1)
    t = (value * (1.0 - saturation * (1.0 - fraction))).clamp(0, 1)
    choices = torch.stack(
        [
            torch.stack(row, 1)
            for row in ((value, q, p, p, t, value), (t, value, value, q, p, p), (p, p, t, value, value, q))
        ],
        1,
    )  # (n, 3, 6, h, w): each channel's value in each of the six sectors
    return choices.gather(2, sector[:, None, None].expand(-1, 3, 1, -1, -1)).squeeze(2)


def gaussian_blur(
    pixels: torch.Tensor,
    sigma: torch.Tensor,
    widest: float = SIGMA[1],
    extent: tuple[torch.Tensor, torch.Tensor] | None = None,
    reach: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each view blurred by a Gaussian of its own σ (pixels), separable, over 2⌈3·widest⌉ + 1 taps (widest: the
    largest σ drawn; fewer where the view is narrower), edges reflected. `reach` ((n,)): each view's own largest σ,
    its taps 2⌈3·reach⌉ + 1. With `extent` ((n,) heights, widths), each view as its top-left extent alone: its taps as
    many as that allows, the pixels past it its reflection."""
    n, channels, height, width = pixels.shape
    radius = min(math.ceil(3 * widest), (min(height, width) - 1))
    taps = torch.arange(-radius, radius + 1, dtype=pixels.dtype, device=pixels.device)
    kernel = torch.exp(-(taps[None] ** 2) / (2 * sigma.to(pixels.dtype)[:, None] ** 2))
    after = radius  # the right and bottom padding F.pad reflects; with an extent, its own reflection instead
    if extent is not None or reach is not None:  # each view's own radius
        sides = torch.minimum(*extent) if extent is not None else torch.tensor(min(height, width), device=taps.device)
        most = torch.ceil(3 * reach).long() if reach is not None else torch.tensor(math.ceil(3 * widest))
        own = torch.minimum(sides - 1, most.to(sides.device)).expand(n)
        kernel = torch.where(taps.abs()[None] <= own[:, None].to(pixels.dtype), kernel, 0)
    if extent is not None:  # past its extent, its own pixels reflected (as F.pad's)
        pixels, after = _reflected_past(F.pad(pixels, (0, radius, 0, radius)), *extent), 0
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(channels, 0)  # (n·3, taps)
    flat = pixels.reshape(1, n * channels, *pixels.shape[-2:])
    flat = F.conv2d(F.pad(flat, (radius, after, 0, 0), mode="reflect"), kernel[:, None, None, :], groups=n * channels)
    flat = F.conv2d(F.pad(flat, (0, 0, radius, after), mode="reflect"), kernel[:, None, :, None], groups=n * channels)
    return flat.reshape(n, channels, height, width)


def _reflected_past(pixels: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """`pixels` (n, C, H, W) with each view's rows and columns past its extent (`heights`, `widths` (n,)) its own
    reflected about its last row and column (F.pad's "reflect": index e − 1 − k at e − 1 + k), clamped inside it."""

    def index(size: int, ends: torch.Tensor) -> torch.Tensor:
        at = torch.arange(size, device=pixels.device)[None]
        return torch.where(at < ends[:, None], at, (2 * (ends[:, None] - 1) - at).clamp(min=0))

    return remapped(pixels, index(pixels.shape[2], heights), index(pixels.shape[3], widths))


def remapped(pixels: torch.Tensor, down: torch.Tensor, across: torch.Tensor) -> torch.Tensor:
    """`pixels` (n, C, H, W), each view's row i read from its row down[v, i] and column j from across[v, j] ((n, H),
    (n, W) indices): a per-view flip, edge repeat or reflection in two gathers."""
    n, channels, height, width = pixels.shape
    pixels = pixels.gather(3, across[:, None, None, :].expand(n, channels, height, width))
    return pixels.gather(2, down[:, None, :, None].expand(n, channels, height, width))
