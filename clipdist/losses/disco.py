"""`disco`: DisCo-CLIP — local rows against all columns, gather backward reduces."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.collectives import all_gather_with_grad


class DiscoLoss(DistributedContrastiveLoss):
    """Each rank computes only its own b rows of both B×B logit matrices.

    Per rank: I, T = all_gather_with_grad(local); logits_i = s·I_r·Tᵀ and
    logits_t = s·T_r·Iᵀ (two b×B blocks), targets offset + arange(b), and
        l_r = N/(2B) · Σ_{i∈r} [CE_i(logits_i) + CE_i(logits_t)]   (summed, not averaged)
    Memory for logits: 2·b·B per rank. Communication as `gather_layer`.

    Exact because: (1/N)·Σ_r l_r = L, the global loss, so the value is right on average; the
    gather's backward sums over ranks, so rank r's rows receive Σ_q ∂l_q/∂f_r = N·∂L/∂f_r and
    DDP's average over N gives the single-process gradient; the logit scale gets ∂l_r/∂s
    on rank r, whose average is ∂L/∂s. Weighting by N/B rather than 1/b keeps this exact
    when local batch sizes differ.

    DisCo-CLIP's published code averages (all_reduce AVG) in the gather's backward
    instead of summing: under DDP that gives every encoder 1/N of the true gradient.
    """

    def compute(self, image_features, text_features, logit_scale, layout):
        all_image = all_gather_with_grad(image_features, layout)
        all_text = all_gather_with_grad(text_features, layout)
        local_batch = image_features.shape[0]
        labels = torch.arange(layout.offset, layout.offset + local_batch, device=image_features.device)
        logits_per_image = logit_scale * image_features @ all_text.T
        logits_per_text = logit_scale * text_features @ all_image.T
        summed = F.cross_entropy(logits_per_image, labels, reduction="sum") + F.cross_entropy(
            logits_per_text, labels, reduction="sum"
        )
        return summed * (layout.world_size / (2 * layout.global_batch))
