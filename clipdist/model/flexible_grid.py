"""Fixed-size image towers at other sizes than their own, for progressive resolution (data.resolution_schedule:
FLIP and CLIPA pretrain small and finish at full size).

open_clip's VisionTransformer adds a position table of its own grid (G×G patches + the class token). At another
size s its grid is g = s / P; the table's grid part is resampled to g×g on every forward (bicubic, with antialias
when shrinking: what open_clip's resize_pos_embed does to a checkpoint), the class token's row kept — a function of
the one stored table, so its gradient reaches it from every size and the checkpoint stays the full-size model's.
At the tower's own size nothing is resampled: the forward is open_clip's, bit for bit.

A timm ViT trunk (SigLIP 2's towers in open_clip) does the same by timm's own `dynamic_img_size` mode: its patch
embedding keeps the grid, and its table (any prefix tokens' rows kept) is resampled to the grid on every forward
(bicubic, antialiased), the stored one used as is at its own grid.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer, _expand_token
from timm.layers import Format
from timm.models.vision_transformer import VisionTransformer as TimmViT

from clipdist.model.class_swap import swap_class
from clipdist.model.timm_towers import vit_trunk_of


def resizes_exactly(model: torch.nn.Module) -> str | None:
    """None where the image tower can take other sizes (open_clip's ViT or a timm ViT trunk with a learned table);
    else why not."""
    tower = getattr(model, "visual", None)
    trunk = getattr(tower, "trunk", None)
    if isinstance(trunk, TimmViT):
        return None if trunk.pos_embed is not None else "its timm trunk has no learned position table"
    if not isinstance(tower, VisionTransformer):
        return f"its image tower is {type(tower).__name__}, not open_clip's VisionTransformer"
    if tower.positional_embedding.shape[0] != tower.grid_size[0] * tower.grid_size[1] + 1:
        return "its position table is not a grid and a class token"
    return None


class FlexibleGridViT(VisionTransformer):
    """open_clip's VisionTransformer whose _embeds takes any image size that is a multiple of its patch."""

    def _embeds(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)  # [*, width, g_h, g_w]
        grid = (x.shape[-2], x.shape[-1])
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        x = torch.cat([_expand_token(self.class_embedding, x.shape[0]).to(x.dtype), x], dim=1)
        x = x + self.table(grid).to(x.dtype)
        x = self.patch_dropout(x)
        return self.ln_pre(x)

    def table(self, grid: tuple[int, int]) -> torch.Tensor:
        """The position table for a grid: the stored one at the tower's own grid, else its grid part resampled."""
        table = self.positional_embedding
        if grid == tuple(self.grid_size):
            return table
        own = table[1:].reshape(1, *self.grid_size, -1).permute(0, 3, 1, 2)
        shrinking = grid[0] < self.grid_size[0] or grid[1] < self.grid_size[1]
        resampled = F.interpolate(own, size=grid, mode="bicubic", antialias=shrinking, align_corners=False)
        return torch.cat([table[:1], resampled.permute(0, 2, 3, 1).reshape(grid[0] * grid[1], -1)])


def patch_side(model: Any) -> int:  # an open_clip model
    """The side in pixels of a fixed-size ViT tower's square patches (open_clip's, or any timm ViT trunk's:
    timm_towers.vit_trunk_of, the towers the teacher terms take)."""
    trunk = vit_trunk_of(model.visual)
    if trunk is not None:
        return int(trunk.patch_embed.patch_size[0])
    return int(model.visual.conv1.kernel_size[0])


def allow_other_sizes(model: torch.nn.Module) -> bool:
    """Make the model's image tower take other sizes where it can (resizes_exactly); whether it does."""
    if resizes_exactly(model) is not None:
        return False
    trunk = getattr(model.visual, "trunk", None)
    if isinstance(trunk, TimmViT):
        # what timm's constructor sets with dynamic_img_size=True, on the built trunk (Final for TorchScript alone)
        setattr(trunk, "dynamic_img_size", True)  # noqa: B010
        trunk.patch_embed.strict_img_size, trunk.patch_embed.flatten = False, False
        trunk.patch_embed.output_fmt = Format.NHWC
        return True
    return swap_class(cast(torch.nn.Module, model.visual), VisionTransformer, FlexibleGridViT)  # _embeds: any grid
