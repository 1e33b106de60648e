"""`gather_layer`: autograd all_gather whose backward sums across ranks, full B×B logits."""

from __future__ import annotations

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.collectives import all_gather_with_grad
from clipdist.losses.reference import clip_loss


class GatherLayerLoss(DistributedContrastiveLoss):
    """Every rank computes the global loss L from autograd-gathered features.

    Per rank: I, T = all_gather_with_grad(local) (B×d each), L on the full B×B logits.
    Memory for logits: B² per rank. Communication: all_gather of B×d per modality forward,
    reduce-scatter of B×d per modality backward (an all_reduce on gloo).

    Exact because: all N ranks compute the same L, and the gather's backward sums their
    gradients, so rank r's rows receive Σ_q ∂L/∂f_r = N·∂L/∂f_r; DDP's average over N
    leaves Σ_r ∂L/∂f_r·∂f_r/∂θ, the single-process gradient. The logit scale sees ∂L/∂s on
    every rank. A GatherLayer whose backward returns only grads[rank] (no sum) is 1/N.
    """

    def compute(self, image_features, text_features, logit_scale, layout):
        return clip_loss(
            all_gather_with_grad(image_features, layout),
            all_gather_with_grad(text_features, layout),
            logit_scale,
        )
