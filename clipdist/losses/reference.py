"""The single-process CLIP loss: the definition every distributed backend must reproduce."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale) -> torch.Tensor:
    """L = (CE(s·I·Tᵀ, diag) + CE(s·T·Iᵀ, diag)) / 2 over one whole batch (mean over rows).

    Same definition as open_clip's ``ClipLoss()`` with world size 1.
    """
    logits_per_image = logit_scale * image_features @ text_features.T
    labels = torch.arange(image_features.shape[0], device=image_features.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2
