"""Distillation from a teacher over the global batch, on the ring: O(b·d) kept, exact at any world size.

open_clip's DistillClipLoss (at world size 1) is, for student logits x = s·I·Tᵀ and teacher logits y = s'·I'·T'ᵀ
over the whole batch of B pairs,
    D = ½ · [ (1/B) Σ_i CE(softmax(y_i·), x_i·) + (1/B) Σ_j CE(softmax(y_·j), x_·j) ],
    CE(p, x_i·) = −Σ_j p_j log softmax(x_i·)_j = LSE_j(x_ij) − Σ_j p_j x_ij   (Σ_j p_j = 1).
open_clip computes it on each rank's own local logits; here every row meets every column of the global batch.
"""

from __future__ import annotations

import torch

from clipdist.defaults import DEFAULT_TILE
from clipdist.losses.collectives import loss_dtype, world_layout
from clipdist.losses.ring import TileSum, check_tile, logits, ring_partial, ring_sum
from clipdist.losses.tiled import ROW_LSE


class TeacherWeighted(TileSum):
    """Σ_{i∈r} Σ_j p_ij x_ij, p_ij = exp(y_ij − LSE_j'(y_ij')) the teacher's softmax of row i: the teacher's columns
    travel beside the student's (the companion block), its rows (scaled) and row LSEs stay on this rank.
    Backward weights: p_ij, constants."""

    def __init__(self, teacher_rows, teacher_lse):
        self.teacher_rows, self.teacher_lse = teacher_rows, teacher_lse  # (b, d'), scaled by s'; (b,)

    def _probabilities(self, rows: slice, teacher_block):
        return logits(self.teacher_rows[rows], teacher_block).sub_(self.teacher_lse[rows, None]).exp_()

    def tile_total(self, scaled_rows, block, bias, rows, companion):
        return (self._probabilities(rows, companion) * logits(scaled_rows, block)).sum()

    def weights(self, tile_logits, partial, rows, columns, companion=None):
        return self._probabilities(rows, companion[columns])


class DistillationLoss(torch.nn.Module):
    """Rank r's share of the distillation term (the module docstring's D), as a backend's share of its loss:
        l_r = N/(2B) · Σ_{i∈r} [LSE_j(x_ij) − Σ_j p_ij x_ij + LSE_j(x_ji) − Σ_j q_ij x_ji]
    with p (q) the teacher's softmax over the rows (columns) of y, so (1/N)·Σ_r l_r = D. Every sum over j is a
    ring pass (`ring_sum`): the student's LSEs with `RowLogSumExp`, the cross terms with `TeacherWeighted`, whose
    teacher LSEs come from two forward-only passes over the teacher's features first. Gradients: each pass brings
    every column block's gradient home summed over all ranks' terms (N·∂D/∂f after DDP's average becomes ∂D/∂f),
    the student's scale gets ∂l_r/∂s on rank r; the teacher gets none. Kept for backward: the rank's own features
    (student and teacher) and 4·b row numbers; in flight, a student block with its teacher block and an accumulator.
    """

    def __init__(self, tile: int = DEFAULT_TILE, group=None):
        super().__init__()
        self.tile, self.group = check_tile(tile), group

    def forward(self, image_features, text_features, logit_scale, teacher_image, teacher_text, teacher_scale):
        layout = world_layout(image_features, text_features, self.group)
        dtype = loss_dtype(image_features, text_features)
        image, text = image_features.to(dtype), text_features.to(dtype)
        scale = torch.as_tensor(logit_scale, device=image.device).to(dtype)
        teacher_image, teacher_text = teacher_image.detach().to(dtype), teacher_text.detach().to(dtype)
        teacher_scale = torch.as_tensor(teacher_scale, device=image.device).detach().to(dtype)
        with torch.autocast(image.device.type, enabled=False):
            total = 0
            for rows, columns, teacher_rows, teacher_columns in (
                (image, text, teacher_image, teacher_text),
                (text, image, teacher_text, teacher_image),
            ):
                teacher_lse = ring_partial(ROW_LSE, teacher_rows, teacher_columns, teacher_scale, self.tile, layout)
                cross = TeacherWeighted(teacher_rows * teacher_scale, teacher_lse)
                total = (
                    total
                    + ring_sum(ROW_LSE, rows, columns, scale, None, self.tile, layout)
                    - ring_sum(cross, rows, columns, scale, None, self.tile, layout, companion_columns=teacher_columns)
                )
        return total * (layout.world_size / (2 * layout.global_batch))
