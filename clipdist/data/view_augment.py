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


def augment(views: torch.Tensor, uniforms: torch.Tensor, mean, std, blur_scale: float = 1.0) -> torch.Tensor:
    """`views` (n, 3, h, w), normalised by `mean` and `std`, augmented as the module docstring says by the choices
    in `uniforms` (n, DRAWS), in (0, 1); float32 in, float32 out. The blur's σ is DINO's times `blur_scale` (the
    images' side / 224: DINO's σ of 0.1-2 px is for 224-px images, and blurs a 32-px one's digits away)."""
    shape = (1, 3, 1, 1)
    mean_t = torch.as_tensor(mean, dtype=views.dtype, device=views.device).view(shape)
    std_t = torch.as_tensor(std, dtype=views.dtype, device=views.device).view(shape)
    pixels = (views * std_t + mean_t).clamp(0, 1)
    pixels = colour_jitter(pixels, uniforms[:, :9])
    gray = grayscale(pixels).expand_as(pixels)
    pixels = torch.where(_each(uniforms[:, 9] < GRAYSCALE), gray, pixels)
    sigma = (SIGMA[0] + (SIGMA[1] - SIGMA[0]) * uniforms[:, 11]) * blur_scale
    pixels = torch.where(_each(uniforms[:, 10] < BLUR), gaussian_blur(pixels, sigma, SIGMA[1] * blur_scale), pixels)
    return (pixels - mean_t) / std_t


def colour_jitter(pixels: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """ColorJitter(0.4, 0.4, 0.2, 0.1) applied where uniforms[:, 0] < 0.8: its factors from uniforms[:, 1:5], its
    order (torchvision's randperm of the four) the ranks of uniforms[:, 5:9]."""
    factor = lambda u, spread: 1 - spread + 2 * spread * u  # noqa: E731 -- uniform in [1 − s, 1 + s]
    brightness, contrast = factor(uniforms[:, 1], BRIGHTNESS), factor(uniforms[:, 2], CONTRAST)
    saturation, hue = factor(uniforms[:, 3], SATURATION), HUE * (2 * uniforms[:, 4] - 1)
    order = uniforms[:, 5:9].argsort(1)  # order[:, k]: the adjustment made k-th
    adjustments = (
        lambda x: (x * _each(brightness).to(x.dtype)).clamp(0, 1),
        lambda x: _blend(x, grayscale(x).mean((1, 2, 3), keepdim=True), contrast),
        lambda x: _blend(x, grayscale(x), saturation),
        lambda x: adjust_hue(x, hue),
    )
    jittered = pixels
    for position in range(4):
        for index, adjust in enumerate(adjustments):
            jittered = torch.where(_each(order[:, position] == index), adjust(jittered), jittered)
    return torch.where(_each(uniforms[:, 0] < JITTER), jittered, pixels)


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


def gaussian_blur(pixels: torch.Tensor, sigma: torch.Tensor, widest: float = SIGMA[1]) -> torch.Tensor:
    """Each view blurred by a Gaussian of its own σ (pixels), separable, over 2⌈3·widest⌉ + 1 taps (widest: the
    largest σ drawn), edges reflected."""
    n, channels, height, width = pixels.shape
    radius = min(math.ceil(3 * widest), (min(height, width) - 1))
    taps = torch.arange(-radius, radius + 1, dtype=pixels.dtype, device=pixels.device)
    kernel = torch.exp(-(taps[None] ** 2) / (2 * sigma.to(pixels.dtype)[:, None] ** 2))
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(channels, 0)  # (n·3, taps)
    flat = pixels.reshape(1, n * channels, height, width)
    flat = F.conv2d(F.pad(flat, (radius, radius, 0, 0), mode="reflect"), kernel[:, None, None, :], groups=n * channels)
    flat = F.conv2d(F.pad(flat, (0, 0, radius, radius), mode="reflect"), kernel[:, None, :, None], groups=n * channels)
    return flat.reshape(n, channels, height, width)
