"""The ring pass both O(b·d) backends are built on: a sum over this rank's rows and every rank's columns of
terms in the logits x_ij = s·r_i·c_j (+ t), computed tile by tile while the column blocks travel around a
ring (rank q sends to q + 1) — no b×B logit block, no gathered features.

A `RingKernel` says what is summed (`tiled`: a log-sum-exp per row; `siglip`: softplus of every logit);
`ring_sum` does the travelling, the tiling and the backward.
"""

from __future__ import annotations

import torch

from clipdist.losses.collectives import WorldLayout, post_exchange

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


def check_tile(tile: int) -> int:
    if tile < 1:
        raise ValueError(f"tile must be a positive number of rows, got {tile}")
    return tile


def logits(scaled_rows, columns, bias=None) -> torch.Tensor:
    """x = (s·r)·cᵀ (+ t) for one tile: one matmul, the bias fused into it."""
    if bias is None:
        return scaled_rows @ columns.T
    return torch.addmm(bias, scaled_rows, columns.T)


class RingKernel:
    """What a ring pass sums over this rank's rows and one column block at a time.

    forward:  `partial(scaled_rows, block, bias, tile, companion)` for one block; partials `merge` across blocks;
              `value(partial)` is the pass's output (a scalar), and the merged partial is kept for backward.
    backward: `weights(tile_logits, partial, rows, columns, companion)` = ∂value/∂x_ij for one tile (rows and
              columns: the tile's slices; it may overwrite the logits).
    `companion`: a constant block that travels with each column block (distillation: the teacher's features of
    the same samples), None where the pass has none.
    """

    def partial(self, scaled_rows, block, bias, tile: int, companion=None) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, first, second) -> torch.Tensor:
        raise NotImplementedError

    def value(self, partial) -> torch.Tensor:
        raise NotImplementedError

    def weights(self, tile_logits, partial, rows: slice, columns: slice, companion=None) -> torch.Tensor:
        raise NotImplementedError


class TileSum(RingKernel):
    """A kernel whose value is one number summed over tiles: `tile_total` of each tile's rows and columns."""

    def tile_total(self, scaled_rows, block, bias, rows: slice, companion) -> torch.Tensor:
        raise NotImplementedError

    def partial(self, scaled_rows, block, bias, tile, companion=None):
        total = scaled_rows.new_zeros(())
        for r in range(0, scaled_rows.shape[0], tile):
            for c in range(0, block.shape[0], tile):
                total += self.tile_total(
                    scaled_rows[r : r + tile],
                    block[c : c + tile],
                    bias,
                    slice(r, r + tile),
                    None if companion is None else companion[c : c + tile],
                )
        return total

    def merge(self, first, second):
        return first + second

    def value(self, partial):
        return partial


def _payload(columns, companion_columns):
    """What travels: the column block, with its companion block beside it (one message)."""
    if companion_columns is None:
        return columns
    return torch.cat([columns, companion_columns.to(columns.dtype)], dim=1)


def _split(payload, width: int):
    """(the column block, its companion block or None)."""
    return payload[:, :width], (payload[:, width:] if payload.shape[1] > width else None)


def _tile_backward(kernel, rows, scaled_rows, columns, companion, bias, partial, tile: int, grad_rows):
    """With P = ∂value/∂x recomputed tile by tile: adds Σ_j P_ij c_j to `grad_rows`, returns Σ_i P_ij r_i for
    these columns and Σ_ij P_ij (the bias's share; None without a bias) — all before the factor g (and s)."""
    grad_columns = torch.zeros_like(columns)
    grad_bias = None if bias is None else columns.new_zeros(())
    for r in range(0, rows.shape[0], tile):
        row_block, tile_rows = rows[r : r + tile], slice(r, r + tile)
        for c in range(0, columns.shape[0], tile):
            column_block, tile_columns = columns[c : c + tile], slice(c, c + tile)
            weights = kernel.weights(
                logits(scaled_rows[tile_rows], column_block, bias), partial, tile_rows, tile_columns, companion
            )
            grad_rows[tile_rows] += weights @ column_block
            grad_columns[tile_columns] += weights.T @ row_block
            if grad_bias is not None:
                grad_bias += weights.sum()
    return grad_columns, grad_bias


def _fold(kernel, scaled_rows, payload, width: int, bias, tile: int, layout: WorldLayout):
    """The forward ring pass: N steps; at step t the rank holds the block that originated on rank r − t, posts its
    send onward and the receive of the next, and folds the block's tiles into its partial meanwhile."""
    rank, world_size = layout.rank, layout.world_size
    partial = None
    for step in range(world_size):
        wait = _pass_right(payload, (rank - step - 1) % world_size, layout) if step < world_size - 1 else None
        block, companion = _split(payload, width)
        part = kernel.partial(scaled_rows, block, bias, tile, companion)
        partial = part if partial is None else kernel.merge(partial, part)
        if wait is not None:
            payload = wait()
    return partial


class _RingSum(torch.autograd.Function):
    """value(Σ over blocks) for this rank's rows r (b, d) against the columns c of every rank.

    Forward (`_fold`): N steps around the ring. Saved for backward: the rank's rows and own columns (its
    inputs), the scalars and the merged partial.

    Backward, a second ring pass: each block travels with its gradient accumulator. At step t the rank
    recomputes P = ∂value/∂x tile by tile, adds g·s·Σ_j P_ij c_j to its rows' gradient and g·s·Σ_i P_ij r_i
    to the block's accumulator (g: this rank's upstream gradient), and passes both on; after N steps the
    accumulator has met every rank and one more hop brings it home: Σ_q ∂l_q/∂c_r, what an all_gather's
    backward gives. ∂l_r/∂s = g·Σ_i r_i·(Σ_j P_ij c_j) from the rows' inner sums and ∂l_r/∂t = g·Σ_ij P_ij,
    counted once on the rank that owns the rows. In flight: a block (with its companion) and an accumulator.
    """

    @staticmethod
    def forward(ctx, rows, columns, scale, bias, companion_columns, kernel, tile, layout):
        scaled_rows = rows * scale  # once per pass, not once per tile
        partial = _fold(kernel, scaled_rows, _payload(columns, companion_columns), columns.shape[1], bias, tile, layout)
        ctx.save_for_backward(rows, columns, scale, bias, companion_columns, partial)
        ctx.kernel, ctx.tile, ctx.layout = kernel, tile, layout
        return kernel.value(partial)

    @staticmethod
    def backward(ctx, grad_output):
        rows, columns, scale, bias, companion_columns, partial = ctx.saved_tensors
        kernel, layout, tile = ctx.kernel, ctx.layout, ctx.tile
        rank, world_size, width = layout.rank, layout.world_size, columns.shape[1]
        factor = grad_output * scale
        scaled_rows = rows * scale
        grad_rows = torch.zeros_like(rows)
        grad_bias = None if bias is None else torch.zeros_like(bias)
        payload, arriving = _payload(columns, companion_columns), None
        for step in range(world_size):
            origin = (rank - step - 1) % world_size  # of the block (and accumulator) that arrives next
            wait_block = _pass_right(payload, origin, layout) if step < world_size - 1 else None
            block, companion = _split(payload, width)
            mine, bias_share = _tile_backward(
                kernel, rows, scaled_rows, block, companion, bias, partial, tile, grad_rows
            )
            mine.mul_(factor)
            if grad_bias is not None:
                grad_bias += bias_share
            accumulated = mine if arriving is None else arriving() + mine
            arriving = (
                _pass_right(accumulated, origin, layout, GRADIENTS)
                if world_size > 1
                else (lambda value=accumulated: value)
            )
            if wait_block is not None:
                payload = wait_block()
        grad_columns = arriving()  # this rank's columns, back from their trip: every rank's term
        grad_scale = (rows * grad_rows).sum() * grad_output
        if grad_bias is not None:
            grad_bias = grad_bias * grad_output
        return grad_rows.mul_(factor), grad_columns, grad_scale, grad_bias, None, None, None, None


def ring_sum(
    kernel: RingKernel, rows, columns, scale, bias, tile: int, layout: WorldLayout, companion_columns=None
) -> torch.Tensor:
    """`kernel`'s value over this rank's rows and every rank's columns, x_ij = s·r_i·c_j (+ t); see _RingSum.
    `companion_columns` (no gradient) travel with the columns, row for row."""
    return _RingSum.apply(rows, columns, scale, bias, companion_columns, kernel, tile, layout)


@torch.no_grad()
def ring_partial(kernel: RingKernel, rows, columns, scale, tile: int, layout: WorldLayout) -> torch.Tensor:
    """The forward pass alone, no gradient: the merged partial (e.g. the row log-sum-exps of a teacher's logits)."""
    return _fold(kernel, rows * scale, columns, columns.shape[1], None, tile, layout)
