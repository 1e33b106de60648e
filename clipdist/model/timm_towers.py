"""timm image towers beyond what open_clip 3.3 builds, and NaFlex towers' inputs.

- `vision_cfg.timm_model_kwargs` (open_clip main's key, refused by open_clip 3.3's config class): keyword arguments
  for `timm.create_model`, e.g. a NaFlexVit's width and depth (clipdist-naflex-tiny). Kept apart when a config is
  registered (`take_tower_kwargs`) and passed on while open_clip builds the tower (`timm_tower`).
- `model.image_tower`: another timm model in the place of a config's timm image tower, as timm defines it.
- NaFlex (timm's NaFlexVit, SigLIP 2's native-resolution ViT): the tower takes a mapping instead of an image batch,
  {"patches": (B, L, P·P·3), "patch_coord": (B, L, 2) (y, x), "patch_valid": (B, L) bool}: each image at its own
  aspect ratio, L patches at most, padded to L. Padding is masked out of attention and pooling, so a row's
  features do not depend on how far its batch is padded.

A config is data: the keyword arguments are checked (`check_tower_kwargs`) before any model is built.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import open_clip.timm_model
import timm
import torch

from clipdist.checkpoint.weights import UnsafeFileError

KWARGS_KEY = "timm_model_kwargs"
# Keyword arguments that could make timm read a file or fetch one: a tower's weights come from model.* settings only.
_REFUSED_WORDS = ("pretrained", "checkpoint", "cache", "file", "url", "hub", "path")

TOWER_KWARGS: dict[str, dict] = {}  # model config name -> its vision_cfg.timm_model_kwargs


def check_tower_kwargs(kwargs, where: str) -> dict:
    """`kwargs` (a config's timm_model_kwargs) as plain settings, or an UnsafeFileError in one line: a mapping of
    names to numbers, strings, booleans or lists of them — nothing that names weights, a file or a hub."""
    if not isinstance(kwargs, dict):
        raise UnsafeFileError(f"{where}: vision_cfg.{KWARGS_KEY} must be a mapping of timm.create_model's arguments")
    scalar = (bool, int, float, str, type(None))
    for key, value in kwargs.items():
        if not isinstance(key, str) or any(word in key.lower() for word in _REFUSED_WORDS):
            raise UnsafeFileError(
                f"{where}: refused: vision_cfg.{KWARGS_KEY}.{key} could make timm read or fetch weights; "
                "a tower's starting weights come from model.pretrained_image, model.checkpoint or "
                "model.pretrained"
            )
        if not (isinstance(value, scalar) or isinstance(value, list) and all(isinstance(v, scalar) for v in value)):
            raise UnsafeFileError(
                f"{where}: refused: vision_cfg.{KWARGS_KEY}.{key} is a {type(value).__name__}: only numbers, "
                "strings, booleans and lists of them are passed to timm"
            )
    return dict(kwargs)


def take_tower_kwargs(name: str, model_cfg: dict, where: str) -> None:
    """Move a config's vision_cfg.timm_model_kwargs out of it (open_clip 3.3 refuses the key) into TOWER_KWARGS."""
    vision = model_cfg.get("vision_cfg") or {}
    if KWARGS_KEY in vision:
        TOWER_KWARGS[name] = check_tower_kwargs(vision.pop(KWARGS_KEY), where)


def tower_settings(name: str, model_cfg: dict, image_tower: str | None) -> dict:
    """`model_cfg` (open_clip's, as registered) with the timm tower it is built with: `image_tower` in the place of
    its timm_model_name (and then timm's own definition: no keyword arguments), else its kept keyword arguments."""
    vision = dict(model_cfg.get("vision_cfg") or {})
    if image_tower is not None:
        vision["timm_model_name"] = image_tower
    elif name in TOWER_KWARGS:
        vision[KWARGS_KEY] = dict(TOWER_KWARGS[name])
    return {**model_cfg, "vision_cfg": vision}


def check_image_tower(image_tower: str, model_name: str, model_cfg: dict | None) -> None:
    """model.image_tower names a timm model, and the config it goes into has a timm image tower to replace."""
    if image_tower not in timm.list_models():
        raise ValueError(
            f"model.image_tower={image_tower!r} is not a timm model name (timm.list_models(); NaFlex "
            f"towers: {', '.join(timm.list_models('naflexvit_*')[:4])}, ...)"
        )
    if model_cfg is not None and not (model_cfg.get("vision_cfg") or {}).get("timm_model_name"):
        raise ValueError(
            f"model.image_tower={image_tower} replaces a timm image tower, and model.name={model_name}'s "
            "image tower is open_clip's own: start from a config with a timm tower (model=naflex_b16, "
            "model=naflex_tiny, model=timm_tiny)"
        )


@contextmanager
def timm_tower(name: str, image_tower: str | None = None):
    """While open_clip builds model `name`: its TimmModel's `timm.create_model` builds `image_tower` where given,
    else the config's tower with the config's timm_model_kwargs."""
    kwargs = {} if image_tower is not None else TOWER_KWARGS.get(name, {})
    if image_tower is None and not kwargs:
        yield
        return

    def create_model(model_name, **options):
        return timm.create_model(image_tower or model_name, **options, **kwargs)

    module = open_clip.timm_model
    saved, module.timm = module.timm, SimpleNamespace(create_model=create_model)
    try:
        yield
    finally:
        module.timm = saved


def naflex_trunk(model: torch.nn.Module):
    """The timm NaFlexVit of a model's image tower, or None where the tower is another kind."""
    return naflex_trunk_of(getattr(model, "visual", None))


def naflex_trunk_of(visual: Any):
    """The timm NaFlexVit of an image tower, or None where the tower is another kind."""
    trunk = getattr(visual, "trunk", None)
    return trunk if type(trunk).__name__ == "NaFlexVit" else None


def vit_trunk_of(visual: Any):
    """The timm ViT trunk of an image tower — timm's VisionTransformer (SigLIP 2's, with its MAP head) or a
    NaFlexVit: its last norm sees every token, the first `num_prefix_tokens` not patches — or None for another
    tower (open_clip's own ViT, a ResNet)."""
    trunk = getattr(visual, "trunk", None)
    if naflex_trunk_of(visual) is not None:
        return trunk
    return (
        trunk
        if all(hasattr(trunk, name) for name in ("norm", "num_prefix_tokens", "embed_dim", "patch_embed"))
        else None
    )


def patch_projection(trunk: Any) -> torch.nn.Module:
    """A timm ViT trunk's patch embedding layer (a NaFlexVit's linear, a VisionTransformer's convolution)."""
    return trunk.embeds.proj if type(trunk).__name__ == "NaFlexVit" else trunk.patch_embed.proj


def pooled_width(visual: Any) -> int:
    """The width of an image tower's pooled output: open_clip's ViT's `output_dim`, a timm tower's projection's
    output (or its trunk's width where it has no projection)."""
    if hasattr(visual, "output_dim"):
        return int(visual.output_dim)
    linears = [
        module
        for module in getattr(visual, "head", torch.nn.Sequential()).modules()
        if isinstance(module, torch.nn.Linear)
    ]
    return int(linears[-1].out_features if linears else visual.trunk.num_features)


def naflex_patch_size(model: torch.nn.Module) -> int:
    """The square patch side a NaFlex tower's patch embedding takes."""
    size = naflex_trunk(model).embeds.patch_size
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def random_patches(
    rows: int,
    patch_size: int,
    max_patches: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A NaFlex batch of random images, each its own grid (h × w ≤ max_patches, every aspect from 1×L to L×1 drawn),
    padded to max_patches: what gradcheck and the GPU battery feed a NaFlex tower."""
    patches = torch.randn(rows, max_patches, patch_size * patch_size * 3, generator=generator, dtype=dtype)
    coord = torch.zeros(rows, max_patches, 2, dtype=torch.long)
    valid = torch.zeros(rows, max_patches, dtype=torch.bool)
    for row in range(rows):
        height = int(torch.randint(1, max_patches + 1, (), generator=generator))
        width = int(torch.randint(1, max_patches // height + 1, (), generator=generator))
        grid = torch.stack(torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij"), -1).reshape(-1, 2)
        coord[row, : len(grid)], valid[row, : len(grid)] = grid, True
    patches[~valid] = 0
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def full_patches(
    rows: int, patch_size: int, seq_len: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A NaFlex batch whose every image fills its sequence: the squarest grid h × w ≤ seq_len (what memory is
    planned for: the longest sequence, hardly padded)."""
    height = math.isqrt(seq_len)
    width = seq_len // height
    grid = torch.stack(torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij"), -1).reshape(-1, 2)
    coord = torch.zeros(rows, seq_len, 2, dtype=torch.long)
    valid = torch.zeros(rows, seq_len, dtype=torch.bool)
    coord[:, : len(grid)], valid[:, : len(grid)] = grid, True
    return {
        "patches": torch.randn(rows, seq_len, patch_size * patch_size * 3, dtype=dtype),
        "patch_coord": coord,
        "patch_valid": valid,
    }


def float32_parameters(model: torch.nn.Module) -> set[str]:
    """The parameters whose gradient a NaFlex tower computes in float32 whatever the weights' dtype: timm resamples
    the position-embedding table to each image's grid in float32 (NaFlexEmbeds' `.float()`), once per grid size in
    the batch — so a float64 check matches them to float32's round-off only: the reference sums a grid's images
    before that rounding, each rank its own."""
    trunk = naflex_trunk(model)
    if trunk is None:
        return set()
    return {
        f"visual.trunk.embeds.{name}" for name, _ in trunk.embeds.named_parameters() if name.startswith("pos_embed")
    }
