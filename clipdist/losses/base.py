"""Shared front end of every distributed contrastive loss backend."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from clipdist.losses.collectives import WorldLayout, loss_dtype, world_layout
from clipdist.losses.reference import clip_loss


class DistributedContrastiveLoss(nn.Module):
    """Validates the inputs, computes in float32 or wider, and hands a `WorldLayout` on.

    Subclasses implement ``compute(image_features, text_features, logit_scale, layout)``
    (``..., layout, logit_bias)`` when `uses_logit_bias`). Called on every rank with that
    rank's L2-normalised local features (b, d) and the logit scale as a multiplier (already
    exp-ed). The mean over ranks of the returned value is `reference` on the global batch,
    and DDP-averaged gradients equal the single-process ones.
    """

    uses_logit_bias = False
    # the definition on one process: the registry entry's `reference`, set by clipdist.losses.build
    reference: Callable[..., torch.Tensor] = staticmethod(clip_loss)
    # The model's initial scalars for this loss: log of the logit scale (None: open_clip's
    # log(1/0.07)) and the logit bias (None: the model has none).
    init_logit_scale: float | None = None
    init_logit_bias: float | None = None

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(
        self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale, logit_bias=None
    ) -> torch.Tensor:
        if self.uses_logit_bias and logit_bias is None:
            raise ValueError(
                f"{type(self).__name__} needs a logit bias: build the model with one "
                "(open_clip: init_logit_bias) and pass it after the logit scale"
            )
        if not self.uses_logit_bias and logit_bias is not None:
            raise ValueError(
                f"{type(self).__name__} is a softmax loss and has no logit bias; build the model "
                "without one, or use loss=siglip"
            )
        layout = world_layout(image_features, text_features, self.group)
        dtype = loss_dtype(image_features, text_features)
        scalars = [logit_scale] + ([logit_bias] if self.uses_logit_bias else [])
        logit_scale, *bias = (torch.as_tensor(t, device=image_features.device).to(dtype) for t in scalars)
        with torch.autocast(image_features.device.type, enabled=False):
            return self.compute(image_features.to(dtype), text_features.to(dtype), logit_scale, layout, *bias)

    def compute(self, image_features, text_features, logit_scale, layout: WorldLayout) -> torch.Tensor:
        raise NotImplementedError

    # Collectives per call, for `clipdist plan`: modalities gathered, and whether the backward
    # sends their gradients back (reduce-scatter). Ring collectives send (N−1)·b·d elements each.
    exchanged_modalities = 2
    backward_communicates = True

    def transient_bytes(self, local_batch: int, global_batch: int, dim: int, element_size: int) -> float:
        """For `clipdist plan`: the most bytes the loss's backward holds beyond what it kept (counted from
        the code, not measured). b×B-logit backends: the logits' gradient, one b×B fp32 block per direction."""
        return 2 * local_batch * global_batch * 4

    def sent_bytes_per_rank(self, local_batch: int, world_size: int, dim: int, element_size: int) -> float:
        one_pass = self.exchanged_modalities * (world_size - 1) * local_batch * dim * element_size
        return one_pass * (2 if self.backward_communicates else 1)
