"""Shared front end of every distributed contrastive loss backend."""
from __future__ import annotations

import torch
from torch import nn

from clipdist.losses.collectives import WorldLayout, world_layout


class DistributedContrastiveLoss(nn.Module):
    """Validates the inputs, computes in float32 or wider, and hands a `WorldLayout` on.

    Subclasses implement ``compute(image_features, text_features, logit_scale, layout)``.
    Called on every rank with that rank's L2-normalised local features (b, d) and the
    logit scale as a multiplier (already exp-ed). The mean over ranks of the returned value
    is the global-batch loss, and DDP-averaged gradients equal the single-process ones.
    """

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale) -> torch.Tensor:
        layout = world_layout(image_features, text_features, self.group)
        # bf16 logits lose the differences the softmax depends on: always at least float32.
        dtype = torch.promote_types(torch.promote_types(image_features.dtype, text_features.dtype), torch.float32)
        logit_scale = torch.as_tensor(logit_scale, device=image_features.device)
        with torch.autocast(image_features.device.type, enabled=False):
            return self.compute(
                image_features.to(dtype), text_features.to(dtype), logit_scale.to(dtype), layout
            )

    def compute(self, image_features, text_features, logit_scale, layout: WorldLayout) -> torch.Tensor:
        raise NotImplementedError
