"""`siglip`: the sigmoid loss, text blocks passed around a ring of neighbours (no all_gather)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.collectives import neighbour_exchange_with_grad
from clipdist.losses.reference import siglip_loss


def _sigmoid_terms(scaled_images, text_features, logit_bias, own_block: bool) -> torch.Tensor:
    """Σ_ij −log σ(z_ij·((s·I_i)·T_j + t)) over one b×b' block; z = +1 only on the own block's diagonal."""
    logits = scaled_images @ text_features.T + logit_bias
    signs = -torch.ones_like(logits)
    if own_block:
        signs.diagonal().fill_(1)
    return -F.logsigmoid(signs * logits).sum()


class SigLipLoss(DistributedContrastiveLoss):
    """Rank r's images against every rank's texts, the texts arriving from the neighbours.

    Bidirectional ring as in open_clip: each round sends the current blocks one rank left
    and one rank right, so after ⌊(N−1)/2⌋ rounds (plus one one-way step when N is even)
    every text block has visited every rank. Per rank
        l_r = N/B · Σ_{i∈r} Σ_j −log σ(z_ij·(s·I_i·T_j + t))
    so (1/N)·Σ_r l_r = L. The exchange's backward sends every received block's gradient
    back along the ring to its owner, so rank r's texts get Σ_q ∂l_q/∂T_r = N·∂L/∂T_r and
    DDP's average is exact; scale and bias get ∂l_r/∂(s, t) on rank r, averaging to
    ∂L/∂(s, t). Weighting by N/B (open_clip: 1/b) keeps unequal local batches exact.
    Logits kept: b×B per rank, in N blocks of b×b_q.
    """

    init_logit_scale = math.log(10.0)  # the SigLIP paper's t' = log 10 and b = −10
    init_logit_bias = -10.0

    uses_logit_bias = True
    exchanged_modalities = 1  # texts travel, images stay
    reference = staticmethod(siglip_loss)

    def transient_bytes(self, local_batch: int, global_batch: int, dim: int, element_size: int) -> float:
        """Backward: one b×b_q block's logit gradient (fp32), and two text blocks with their gradients in flight."""
        return local_batch * local_batch * 4 + 4 * local_batch * dim * 4

    def compute(self, image_features, text_features, logit_scale, layout, logit_bias):
        scaled_images = logit_scale * image_features  # once, not once per text block

        def terms(texts, own_block=False):
            return _sigmoid_terms(scaled_images, texts, logit_bias, own_block)

        total = terms(text_features, own_block=True)
        rank, world_size = layout.rank, layout.world_size
        to_left = to_right = text_features
        rounds, one_way = divmod(world_size - 1, 2)
        for step in range(1, rounds + 1):
            from_right, from_left = neighbour_exchange_with_grad(
                [to_left, to_right], [-1, +1], [(rank + step) % world_size, (rank - step) % world_size], layout
            )
            total = total + terms(from_right) + terms(from_left)
            to_left, to_right = from_right, from_left
        if one_way:
            (from_left,) = neighbour_exchange_with_grad([to_right], [+1], [(rank - rounds - 1) % world_size], layout)
            total = total + terms(from_left)
        return total * (world_size / layout.global_batch)
