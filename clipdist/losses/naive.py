"""`naive`: plain all_gather, own slice put back with its graph, full B×B logits."""

from __future__ import annotations

import torch

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.collectives import all_gather_rows, scale_gradient
from clipdist.losses.reference import clip_loss


class NaiveLoss(DistributedContrastiveLoss):
    """The "overwrite your own slice" pattern, made exact.

    Per rank: gather I and T (B×d) without autograd, put the local rows back in with their
    graph, compute the global loss L on the full B×B logits.
    Memory for logits: B² per rank. Communication: one all_gather of B×d per modality.

    Exact because: rank r's backward reaches only its own rows, with ∂L/∂f_r, and DDP
    divides by N — so the gradient into the local rows is multiplied by N on the way back
    (not the loss: L is left as is, so ∂L/∂s is right on every rank and its average is too).
    Without that factor every encoder gradient is 1/N of the true one; multiplying the loss
    by N instead makes the logit scale's gradient N× too large.
    """

    backward_communicates = False  # the gradient stays on the owner's rows

    def compute(self, image_features, text_features, logit_scale, layout):
        def global_rows(local):
            parts = list(all_gather_rows(local, layout).split(list(layout.local_sizes)))
            parts[layout.rank] = scale_gradient(local, layout.world_size)
            return torch.cat(parts)

        return clip_loss(global_rows(image_features), global_rows(text_features), logit_scale)
