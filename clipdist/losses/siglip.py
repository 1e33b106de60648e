"""`siglip`: the sigmoid loss on the ring, O(b·d) kept per rank — no b×B logits, no gathered features."""

from __future__ import annotations

import math

import torch.nn.functional as F

from clipdist.defaults import DEFAULT_TILE
from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.ring import TileSum, check_tile, logits, ring_sum


class Softplus(TileSum):
    """Σ_{i∈r} Σ_j softplus(x_ij) = −Σ log σ(−x_ij), x_ij = s·r_i·c_j + t (every pair taken as a negative);
    backward weights σ(x_ij)."""

    def tile_total(self, scaled_rows, block, bias, rows, companion):
        return -F.logsigmoid(logits(scaled_rows.neg(), block, bias.neg())).sum()  # −x straight out of the matmul

    def weights(self, tile_logits, partial, rows, columns, companion=None):
        return tile_logits.sigmoid_()


SOFTPLUS = Softplus()


class SigLipLoss(DistributedContrastiveLoss):
    """The sigmoid loss (open_clip's SigLipLoss) with O(b·d) kept per rank: no logit block outlives its tile.

    −log σ(x) = softplus(x) − x, so with every pair first taken as a negative, per rank
        l_r = N/B · [Σ_{i∈r} Σ_j softplus(s·I_i·T_j + t) − Σ_{i∈r} (s·I_i·T_i + t)]
    and (1/N)·Σ_r l_r = L. The double sum is a `ring_sum` of `Softplus`: the text blocks travel a
    one-way ring and every tile's logits are recomputed in the backward, whose second ring pass brings
    each text block's gradient home summed over every rank's terms (Σ_q ∂l_q/∂T_r = N·∂L/∂T_r, exact after
    DDP's average). Scale and bias get ∂l_r/∂(s, t) on rank r only — once, from the rank's own rows —
    averaging to ∂L/∂(s, t). Weighting by N/B (open_clip: 1/b) keeps unequal local batches exact.
    Kept for backward: the rank's own features, the two scalars and one number; the largest transient is
    tile² logits; in flight, one text block and one gradient block.
    """

    init_logit_scale = math.log(10.0)  # the SigLIP paper's t' = log 10 and b = −10
    init_logit_bias = -10.0

    uses_logit_bias = True
    exchanged_modalities = 1  # texts travel, images stay

    def __init__(self, tile: int = DEFAULT_TILE, group=None):
        super().__init__(group)
        self.tile = check_tile(tile)

    def compute(self, image_features, text_features, logit_scale, layout, logit_bias):
        pairs = ring_sum(SOFTPLUS, image_features, text_features, logit_scale, logit_bias, self.tile, layout)
        positives = logit_scale * (image_features * text_features).sum() + logit_bias * image_features.shape[0]
        return (pairs - positives) * (layout.world_size / layout.global_batch)

    def transient_bytes(self, local_batch: int, global_batch: int, dim: int, element_size: int) -> float:
        """Backward (fp32): the rows' gradient and scaled copy, the text block held and the one arriving, this
        rank's block term, the accumulator being sent and the one arriving (7·b·d), two tile² logit blocks."""
        tile = min(self.tile, global_batch)
        return 7 * local_batch * dim * 4 + 2 * tile * tile * 4

    def sent_bytes_per_rank(self, local_batch: int, world_size: int, dim: int, element_size: int) -> float:
        """Texts only: N − 1 blocks forward; N − 1 blocks and N gradient blocks backward."""
        if world_size == 1:
            return 0.0
        return (3 * world_size - 2) * local_batch * dim * element_size
