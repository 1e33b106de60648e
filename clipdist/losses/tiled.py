"""`tiled`: the softmax CLIP loss in tiles with an online log-sum-exp, the other ranks' features passed
around a ring — no b×B logit block and no gathered features: O(b·d) kept per rank."""

from __future__ import annotations

import torch

from clipdist.defaults import DEFAULT_TILE
from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.ring import RingKernel, check_tile, logits, ring_sum


class RowLogSumExp(RingKernel):
    """Σ_{i∈r} LSE_j(x_ij), x_ij = s·r_i·c_j: a running LSE per row, merged across blocks with logaddexp;
    backward weights P_ij = exp(x_ij − LSE_i), the softmax."""

    def partial(self, scaled_rows, block, bias, tile, companion=None):
        lse = torch.empty(scaled_rows.shape[0], dtype=scaled_rows.dtype, device=scaled_rows.device)
        for r in range(0, scaled_rows.shape[0], tile):
            running = None
            for c in range(0, block.shape[0], tile):
                tile_lse = torch.logsumexp(logits(scaled_rows[r : r + tile], block[c : c + tile]), dim=1)
                running = tile_lse if running is None else torch.logaddexp(running, tile_lse)
            lse[r : r + tile] = running if running is not None else -torch.inf  # an empty block: LSE over nothing
        return lse

    def merge(self, first, second):
        return torch.logaddexp(first, second)

    def value(self, partial):
        return partial.sum()

    def weights(self, tile_logits, partial, rows, columns, companion=None):
        return tile_logits.sub_(partial[rows, None]).exp_()


ROW_LSE = RowLogSumExp()


class TiledLoss(DistributedContrastiveLoss):
    """DisCo's split of the loss, without DisCo's 2·b·B logits and without gathering: memory O(b·d).

    Per rank, over the global batch's images I and texts T and the rank's rows:
        l_r = N/(2B) · [Σ_{i∈r} LSE_j(s·I_i·T_j) + Σ_{i∈r} LSE_j(s·T_i·I_j) − 2s·Σ_{i∈r} I_i·T_i]
    which is DisCo's l_r term by term (CE_i = LSE_i − positive logit), so it is exact for the same
    reasons: each feature block's gradient sums every rank's term (N·∂L/∂f after DDP's average becomes
    ∂L/∂f) and the scale gets ∂l_r/∂s on rank r (average ∂L/∂s). Each LSE is a `ring_sum` of `RowLogSumExp`: the
    other ranks' features come by, block by block, in tiles of `tile` rows and columns; kept for backward
    are the rank's own features and 2·b row LSEs, the largest transient is tile² logits, and in flight
    are one feature block and one gradient block. The scale's gradient comes out of the same tiles as the
    features' (counted once: the point where Inf-CL's published code is reported to be N× off).
    """

    def __init__(self, tile: int = DEFAULT_TILE, group=None):
        super().__init__(group)
        self.tile = check_tile(tile)

    def compute(self, image_features, text_features, logit_scale, layout):
        image_lse = ring_sum(ROW_LSE, image_features, text_features, logit_scale, None, self.tile, layout)
        text_lse = ring_sum(ROW_LSE, text_features, image_features, logit_scale, None, self.tile, layout)
        positives = logit_scale * (image_features * text_features).sum()
        return (image_lse + text_lse - 2 * positives) * (layout.world_size / (2 * layout.global_batch))

    def transient_bytes(self, local_batch: int, global_batch: int, dim: int, element_size: int) -> float:
        """Backward of one direction (fp32): the rows' gradient, the block held and the one arriving, this
        rank's column term, the accumulator being sent and the one arriving, the scaled rows (7·b·d), and two tile²
        logit blocks (probs and their product). No term grows with B."""
        tile = min(self.tile, global_batch)
        return 7 * local_batch * dim * 4 + 2 * tile * tile * 4

    def sent_bytes_per_rank(self, local_batch: int, world_size: int, dim: int, element_size: int) -> float:
        """Per modality: N − 1 feature blocks forward; N − 1 feature blocks and N gradient blocks backward."""
        if world_size == 1:
            return 0.0
        return 2 * (3 * world_size - 2) * local_batch * dim * element_size
