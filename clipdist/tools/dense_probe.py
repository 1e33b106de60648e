"""A built-in dense task for image towers: generated scenes of shapes with a label per pixel, and a linear probe on
the tower's patch tokens (`clipdist eval TARGET --dense`).

    scenes(count, size, seed)      uint8 images (count, size, size, 3) and labels (count, size, size)
    dense_probe(model, ...)        {"dense/miou": ..., "dense/patch_accuracy": ...} on held-out scenes

A scene is a background of one random colour with pixel noise and 1-3 shapes (circle, square, triangle: classes
1-3, background 0) of random colours, sizes (15-45% of the side) and places, later shapes over earlier ones. The
shapes' colours say nothing of their class, so a probe must read their form from the patch tokens. Each patch is
labelled with its pixels' most common class; a logistic regression (L-BFGS, standardized features, L2 1e-4) is fit
on the train scenes' patch tokens and scored on the test scenes': mean intersection over union over the four
classes, and patch accuracy. Everything is seeded: the same model gives the same figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from clipdist.data.images import PixelNormalize
from clipdist.model.timm_towers import naflex_trunk

CLASSES = ("background", "circle", "square", "triangle")


def scenes(count: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`count` scenes of `size`² pixels: (images uint8 (count, size, size, 3), labels int64 (count, size, size))."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:size, 0:size] + 0.5
    images = np.empty((count, size, size, 3), np.uint8)
    labels = np.zeros((count, size, size), np.int64)
    for index in range(count):
        image = rng.integers(0, 256, 3) + rng.normal(0, 12, (size, size, 3))
        for _ in range(rng.integers(2, 5)):
            kind, side = int(rng.integers(1, 4)), rng.uniform(0.3, 0.6) * size
            cy, cx = rng.uniform(side / 2, size - side / 2, 2)
            dy, dx = ys - cy, xs - cx
            if kind == 1:
                inside = dy**2 + dx**2 <= (side / 2) ** 2
            elif kind == 2:
                inside = (np.abs(dy) <= side / 2) & (np.abs(dx) <= side / 2)
            else:  # apex up: below the apex, within the two slanted edges
                inside = (dy >= -side / 2) & (dy <= side / 2) & (np.abs(dx) <= (dy + side / 2) / 2)
            image[inside] = rng.integers(0, 256, 3)
            labels[index][inside] = kind
        images[index] = np.clip(image, 0, 255).astype(np.uint8)
    return images, labels


def patch_labels(labels: np.ndarray, grid: int) -> np.ndarray:
    """Each patch's most common class (ties: the lower class), (count, grid²)."""
    count, size, _ = labels.shape
    side = size // grid
    blocks = labels[:, : grid * side, : grid * side].reshape(count, grid, side, grid, side).transpose(0, 1, 3, 2, 4)
    blocks = blocks.reshape(count, grid * grid, side * side)
    votes = np.stack([(blocks == kind).sum(-1) for kind in range(len(CLASSES))], -1)
    return votes.argmax(-1)


def grid_of(model: torch.nn.Module) -> tuple[int, int]:
    """(the image side the tower takes, patches along it); a ValueError for a tower without a fixed patch grid."""
    visual: Any = model.visual
    if naflex_trunk(model) is not None:
        raise ValueError("--dense: a NaFlex tower has no fixed patch grid (not yet supported)")
    trunk = getattr(visual, "trunk", None)
    if trunk is not None and hasattr(trunk, "patch_embed"):  # a timm ViT
        size, grid = trunk.patch_embed.img_size, trunk.patch_embed.grid_size
        return int(size[0]), int(grid[0])
    if hasattr(visual, "grid_size") and hasattr(visual, "output_tokens"):  # open_clip's VisionTransformer
        return int(visual.image_size[0]), int(visual.grid_size[0])
    raise ValueError(f"--dense needs a ViT image tower (patch tokens); {type(visual).__name__} has none")


@torch.no_grad()
def patch_tokens(model: torch.nn.Module, images: torch.Tensor, grid: int) -> torch.Tensor:
    """The image tower's last-layer patch tokens, (B, grid², width): open_clip's after ln_post, timm's features."""
    visual: Any = model.visual
    trunk = getattr(visual, "trunk", None)
    if trunk is not None and hasattr(trunk, "forward_features"):
        tokens = trunk.forward_features(images)[:, getattr(trunk, "num_prefix_tokens", 0) :]
    else:
        visual.output_tokens, before = True, visual.output_tokens
        try:
            _, tokens = visual(images)
        finally:
            visual.output_tokens = before
    if tokens.shape[1] != grid * grid:
        raise ValueError(f"--dense: the tower gives {tokens.shape[1]} tokens, not its {grid}² patches (attention pool)")
    return tokens.float()


def _features(model, images: np.ndarray, grid: int, batch_size: int) -> torch.Tensor:
    normalize = PixelNormalize(model.visual.preprocess_cfg["mean"], model.visual.preprocess_cfg["std"])
    dtype = next(model.parameters()).dtype
    out = []
    for start in range(0, len(images), batch_size):
        pixels = normalize(torch.from_numpy(images[start : start + batch_size]))
        out.append(patch_tokens(model, pixels.to(dtype), grid))
    return torch.cat(out).flatten(0, 1)


def fit_probe(features: torch.Tensor, labels: torch.Tensor, classes: int, l2: float = 1e-4) -> torch.nn.Linear:
    """A logistic regression from standardized features to classes (full-batch L-BFGS, 100 iterations)."""
    torch.manual_seed(0)
    probe = torch.nn.Linear(features.shape[1], classes, dtype=torch.float64)
    torch.nn.init.zeros_(probe.weight)
    torch.nn.init.zeros_(probe.bias)
    optimizer = torch.optim.LBFGS(probe.parameters(), max_iter=100, line_search_fn="strong_wolfe")
    inputs = features.double()

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(probe(inputs), labels) + l2 * probe.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return probe


def dense_probe(
    model: torch.nn.Module, train_scenes: int = 256, test_scenes: int = 128, batch_size: int = 64, seed: int = 0
) -> dict[str, float]:
    """A linear probe's mIoU and patch accuracy on held-out shape scenes (the module docstring)."""
    size, grid = grid_of(model)
    model.eval()
    split = {}
    for name, count, offset in (("train", train_scenes, 0), ("test", test_scenes, 1)):
        images, labels = scenes(count, size, seed * 2 + offset)
        targets = torch.from_numpy(patch_labels(labels, grid)).flatten()
        split[name] = (_features(model, images, grid, batch_size), targets)
    mean, std = split["train"][0].mean(0), split["train"][0].std(0) + 1e-6
    probe = fit_probe((split["train"][0] - mean) / std, split["train"][1], len(CLASSES))
    with torch.no_grad():
        predicted = probe(((split["test"][0] - mean) / std).double()).argmax(-1)
    truth = split["test"][1]
    ious = []
    for kind in range(len(CLASSES)):
        union = ((predicted == kind) | (truth == kind)).sum().item()
        if union:
            ious.append(((predicted == kind) & (truth == kind)).sum().item() / union)
    return {"dense/miou": float(np.mean(ious)), "dense/patch_accuracy": (predicted == truth).double().mean().item()}
