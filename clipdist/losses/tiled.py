"""`tiled`: the softmax CLIP loss in tiles with an online log-sum-exp, the other ranks' features passed
around a ring — no b×B logit block and no gathered features: O(b·d) kept per rank."""
from __future__ import annotations

import torch

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.collectives import WorldLayout, post_exchange


def _tiles_lse(rows, columns, logit_scale, tile: int) -> torch.Tensor:
    """LSE_j(s·r_i·c_j) per row over these columns, one tile×tile block of logits at a time."""
    lse = torch.empty(rows.shape[0], dtype=rows.dtype, device=rows.device)
    for r in range(0, rows.shape[0], tile):
        running = torch.full((min(tile, rows.shape[0] - r),), -torch.inf, dtype=rows.dtype, device=rows.device)
        for c in range(0, columns.shape[0], tile):
            logits = logit_scale * (rows[r : r + tile] @ columns[c : c + tile].T)
            running = torch.logaddexp(running, torch.logsumexp(logits, dim=1))
        lse[r : r + tile] = running
    return lse


def _tiles_backward(rows, columns, logit_scale, lse, tile: int, grad_rows) -> torch.Tensor:
    """With P_ij = exp(s·r_i·c_j − LSE_i) recomputed tile by tile: adds Σ_j P_ij c_j to `grad_rows` and
    returns Σ_i P_ij r_i for these columns (both before the factor s·g)."""
    grad_columns = torch.zeros_like(columns)
    for r in range(0, rows.shape[0], tile):
        row_block = rows[r : r + tile]
        for c in range(0, columns.shape[0], tile):
            column_block = columns[c : c + tile]
            probs = (row_block @ column_block.T).mul_(logit_scale).sub_(lse[r : r + tile, None]).exp_()
            grad_rows[r : r + tile] += probs @ column_block
            grad_columns[c : c + tile] += probs.T @ row_block
    return grad_columns


FEATURES, GRADIENTS = 0, 1  # message tags: a block and an accumulator may be in flight between two ranks at once


def _pass_right(tensor, origin: int, layout: WorldLayout, tag: int = FEATURES):
    """Post sending `tensor` to the next rank and receiving, from the previous one, the block that
    originated on rank `origin`; returns a function that waits for both and gives the received block."""
    (received,), requests = post_exchange([tensor], [1], [layout.local_sizes[origin]], layout, tag)

    def wait():
        for request in requests:
            request.wait()
        return received

    return wait


class _RingRowLogSumExp(torch.autograd.Function):
    """Σ_{i∈r} LSE_j(s·r_i·c_j): rows r are this rank's (b, d); columns c are every rank's, met block by
    block as they travel around the ring (rank q sends to q + 1).

    Forward: N steps; at step t the rank holds the column block that originated on rank r − t, posts its
    send onward and the receive of the next, and folds its tiles into a running LSE per row meanwhile.
    Saved for backward: the rank's rows and own columns (its inputs) and b row LSEs.

    Backward, a second ring pass: each block travels with its gradient accumulator. At step t the rank
    recomputes P_ij = exp(s·r_i·c_j − LSE_i) tile by tile, adds g·s·Σ_j P_ij c_j to its rows' gradient
    and g·s·Σ_i P_ij r_i to the block's accumulator (g: this rank's upstream gradient), and passes both
    on; after N steps the accumulator has met every rank and one more hop brings it home:
    Σ_q ∂l_q/∂c_r, what an all_gather's backward gives. ∂l_r/∂s = g·Σ_i r_i·(Σ_j P_ij c_j) from the
    rows' inner sums, counted once. In flight: a block and an accumulator."""

    @staticmethod
    def forward(ctx, rows, columns, logit_scale, tile, layout):
        rank, world_size = layout.rank, layout.world_size
        lse = torch.full((rows.shape[0],), -torch.inf, dtype=rows.dtype, device=rows.device)
        block = columns
        for step in range(world_size):
            wait = _pass_right(block, (rank - step - 1) % world_size, layout) if step < world_size - 1 else None
            lse = torch.logaddexp(lse, _tiles_lse(rows, block, logit_scale, tile))
            if wait is not None:
                block = wait()
        ctx.save_for_backward(rows, columns, logit_scale, lse)
        ctx.tile, ctx.layout = tile, layout
        return lse.sum()

    @staticmethod
    def backward(ctx, grad_output):
        rows, columns, logit_scale, lse = ctx.saved_tensors
        layout, tile = ctx.layout, ctx.tile
        rank, world_size = layout.rank, layout.world_size
        factor = grad_output * logit_scale
        grad_rows = torch.zeros_like(rows)
        block, arriving = columns, None
        for step in range(world_size):
            origin = (rank - step - 1) % world_size  # of the block (and accumulator) that arrives next
            wait_block = _pass_right(block, origin, layout) if step < world_size - 1 else None
            mine = _tiles_backward(rows, block, logit_scale, lse, tile, grad_rows).mul_(factor)
            accumulated = mine if arriving is None else arriving() + mine
            arriving = _pass_right(accumulated, origin, layout, GRADIENTS) if world_size > 1 else (lambda: accumulated)
            if wait_block is not None:
                block = wait_block()
        grad_columns = arriving()  # this rank's columns, back from their trip: every rank's term
        grad_scale = (rows * grad_rows).sum() * grad_output
        return grad_rows.mul_(factor), grad_columns, grad_scale, None, None


DEFAULT_TILE = 1024  # the default of loss.tile too (config.TiledLossConfig reads it)


class TiledLoss(DistributedContrastiveLoss):
    """DisCo's split of the loss, without DisCo's 2·b·B logits and without gathering: memory O(b·d).

    Per rank, over the global batch's images I and texts T and the rank's rows:
        l_r = N/(2B) · [Σ_{i∈r} LSE_j(s·I_i·T_j) + Σ_{i∈r} LSE_j(s·T_i·I_j) − 2s·Σ_{i∈r} I_i·T_i]
    which is DisCo's l_r term by term (CE_i = LSE_i − positive logit), so it is exact for the same
    reasons: each feature block's gradient sums every rank's term (N·∂L/∂f after DDP's average becomes
    ∂L/∂f) and the scale gets ∂l_r/∂s on rank r (average ∂L/∂s). Each LSE is a `_RingRowLogSumExp`: the
    other ranks' features come by, block by block, in tiles of `tile` rows and columns; kept for backward
    are the rank's own features and 2·b row LSEs, the largest transient is tile² logits, and in flight
    are one feature block and one gradient block. The scale's gradient comes out of the same tiles as the
    features' (counted once: the point where Inf-CL's published code is reported to be N× off).
    """

    def __init__(self, tile: int = DEFAULT_TILE, group=None):
        super().__init__(group)
        if tile < 1:
            raise ValueError(f"tile must be a positive number of rows, got {tile}")
        self.tile = tile

    def compute(self, image_features, text_features, logit_scale, layout):
        image_lse = _RingRowLogSumExp.apply(image_features, text_features, logit_scale, self.tile, layout)
        text_lse = _RingRowLogSumExp.apply(text_features, image_features, logit_scale, self.tile, layout)
        positives = logit_scale * (image_features * text_features).sum()
        return (image_lse + text_lse - 2 * positives) * (layout.world_size / (2 * layout.global_batch))

    def transient_bytes(self, local_batch: int, global_batch: int, dim: int, element_size: int) -> float:
        """Backward of one direction (fp32): the rows' gradient, the block held and the one arriving, this
        rank's column term, the accumulator being sent and the one arriving (6·b·d), and two tile² logit
        blocks (probs and their product). No term grows with B."""
        tile = min(self.tile, global_batch)
        return 6 * local_batch * dim * 4 + 2 * tile * tile * 4

    def sent_bytes_per_rank(self, local_batch: int, world_size: int, dim: int, element_size: int) -> float:
        """Per modality: N − 1 feature blocks forward; N − 1 feature blocks and N gradient blocks backward."""
        if world_size == 1:
            return 0.0
        return 2 * (3 * world_size - 2) * local_batch * dim * element_size
