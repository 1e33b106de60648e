"""`tiled`: the softmax CLIP loss in tiles with an online log-sum-exp — no b×B logit block kept."""
from __future__ import annotations

import torch

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.collectives import all_gather_with_grad


class _SummedRowLogSumExp(torch.autograd.Function):
    """Σ_i LSE_j(s·r_i·c_j) over rows r (b, d) and columns c (B, d), tile by tile.

    Forward keeps a running log-sum-exp per row (logaddexp of each tile's LSE), so at most
    one tile×tile block of logits exists at a time and only the b row LSEs are saved.
    Backward recomputes each tile's probabilities P_ij = exp(s·r_i·c_j − LSE_i) and
    accumulates ∂/∂r_i = s·Σ_j P_ij c_j, ∂/∂c_j = s·Σ_i P_ij r_i, ∂/∂s = Σ_ij P_ij (r_i·c_j).
    """

    @staticmethod
    def forward(ctx, rows, columns, logit_scale, tile):
        row_lse = torch.empty(rows.shape[0], dtype=rows.dtype, device=rows.device)
        for r in range(0, rows.shape[0], tile):
            running = torch.full((min(tile, rows.shape[0] - r),), -torch.inf, dtype=rows.dtype, device=rows.device)
            for c in range(0, columns.shape[0], tile):
                logits = logit_scale * (rows[r : r + tile] @ columns[c : c + tile].T)
                running = torch.logaddexp(running, torch.logsumexp(logits, dim=1))
            row_lse[r : r + tile] = running
        ctx.save_for_backward(rows, columns, logit_scale, row_lse)
        ctx.tile = tile
        return row_lse.sum()

    @staticmethod
    def backward(ctx, grad_output):
        rows, columns, logit_scale, row_lse = ctx.saved_tensors
        tile = ctx.tile
        grad_rows, grad_columns = torch.zeros_like(rows), torch.zeros_like(columns)
        for r in range(0, rows.shape[0], tile):
            row_block = rows[r : r + tile]
            for c in range(0, columns.shape[0], tile):
                column_block = columns[c : c + tile]
                probs = (row_block @ column_block.T).mul_(logit_scale).sub_(row_lse[r : r + tile, None]).exp_()
                grad_rows[r : r + tile] += probs @ column_block
                grad_columns[c : c + tile] += probs.T @ row_block
        # ∂/∂s = Σ_ij P_ij r_i·c_j = Σ_i r_i·(Σ_j P_ij c_j): the row gradient already holds the inner sum.
        grad_scale = (rows * grad_rows).sum()
        scale = grad_output * logit_scale
        return grad_rows * scale, grad_columns * scale, grad_scale * grad_output, None


DEFAULT_TILE = 1024  # the default of loss.tile too (config.TiledLossConfig reads it)


class TiledLoss(DistributedContrastiveLoss):
    """DisCo's split of the loss, without DisCo's 2·b·B logits: memory O((b + B)·d).

    Per rank, with I, T = all_gather_with_grad(local) and the rank's rows I_r, T_r:
        l_r = N/(2B) · [Σ_{i∈r} LSE_j(s·I_i·T_j) + Σ_{i∈r} LSE_j(s·T_i·I_j) − 2s·Σ_{i∈r} I_i·T_i]
    which is DisCo's l_r term by term (CE_i = LSE_i − positive logit), so it is exact for
    the same reasons: the gather's backward sums over ranks (N·∂L/∂f after DDP's average
    becomes ∂L/∂f) and the scale gets ∂l_r/∂s on rank r (average ∂L/∂s). Each LSE is a
    `_SummedRowLogSumExp` over tiles of `tile` rows and columns: kept for backward are the
    gathered features (2·B·d) and 2·b row LSEs; the largest transient is tile² logits.
    The scale's gradient comes out of the same tiles as the features' (∂/∂s above), so it is
    counted once — the point where Inf-CL's published code is reported to be N× off.
    """

    def __init__(self, tile: int = DEFAULT_TILE, group=None):
        super().__init__(group)
        if tile < 1:
            raise ValueError(f"tile must be a positive number of rows, got {tile}")
        self.tile = tile

    def compute(self, image_features, text_features, logit_scale, layout):
        all_image = all_gather_with_grad(image_features, layout)
        all_text = all_gather_with_grad(text_features, layout)
        image_lse = _SummedRowLogSumExp.apply(image_features, all_text, logit_scale, self.tile)
        text_lse = _SummedRowLogSumExp.apply(text_features, all_image, logit_scale, self.tile)
        positives = logit_scale * (image_features * text_features).sum()
        return (image_lse + text_lse - 2 * positives) * (layout.world_size / (2 * layout.global_batch))
