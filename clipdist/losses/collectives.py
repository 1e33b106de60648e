"""The collectives the loss backends are built from.

All of them take rows that may differ in number from rank to rank: the batch sizes are
exchanged first (one tiny all_gather), tensors are padded to the largest local batch for
the collective and the padding is dropped again, so the global batch is always the exact
rank-major concatenation of the local batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class WorldLayout:
    """Who we are and how the global batch is split: `local_sizes[r]` rows live on rank r."""

    rank: int
    world_size: int
    local_sizes: tuple[int, ...]
    group: dist.ProcessGroup | None = None

    @property
    def global_batch(self) -> int:
        return sum(self.local_sizes)

    @property
    def offset(self) -> int:
        """Index of this rank's first sample in the rank-major global batch."""
        return sum(self.local_sizes[: self.rank])


def loss_dtype(*features: torch.Tensor) -> torch.dtype:
    """The dtype a loss computes in: the features' own, at least float32 (bf16 logits lose the differences the
    softmax depends on)."""
    dtype = torch.float32
    for tensor in features:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def world_layout(image_features: torch.Tensor, text_features: torch.Tensor, group=None) -> WorldLayout:
    """Check the local features and exchange (batch, dim, the width of the dtype the loss computes in) with every
    rank.

    Every rank receives the same table, so a mismatch raises the same error on every rank
    instead of hanging the next collective.
    """
    if image_features.dim() != 2 or text_features.dim() != 2:
        raise ValueError(
            f"loss expects 2-D features (local_batch, dim); got image {tuple(image_features.shape)}, "
            f"text {tuple(text_features.shape)}"
        )
    if image_features.shape != text_features.shape:
        raise ValueError(
            f"image and text features must have the same shape; got image {tuple(image_features.shape)}, "
            f"text {tuple(text_features.shape)}"
        )
    batch, dim = image_features.shape
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return WorldLayout(0, 1, (batch,), group)
    world_size = dist.get_world_size(group)
    width = loss_dtype(image_features, text_features).itemsize
    mine = torch.tensor([batch, dim, width], dtype=torch.long, device=image_features.device)
    table = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(table, mine, group=group)
    sizes = tuple(int(t[0]) for t in table)
    dims = {int(t[1]) for t in table}
    if len(dims) != 1:
        raise ValueError(
            f"feature dimension differs across ranks: {[int(t[1]) for t in table]} (rank-ordered); "
            "every rank must run the same model"
        )
    widths = [f"float{8 * int(t[2])}" for t in table]
    if len(set(widths)) != 1:  # the blocks the ranks exchange would differ in size
        raise ValueError(
            f"the features' precision differs across ranks: the loss computes in {widths} (rank-ordered); every "
            "rank must pass features of the same dtype"
        )
    if sum(sizes) == 0:
        raise ValueError("the global batch is empty: every rank passed 0 samples")
    return WorldLayout(dist.get_rank(group), world_size, sizes, group)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(tensor, (0, 0, 0, rows - tensor.shape[0])).contiguous()


def all_gather_rows(tensor: torch.Tensor, layout: WorldLayout) -> torch.Tensor:
    """Concatenate every rank's rows in rank order. No autograd graph."""
    if layout.world_size == 1:
        return tensor
    padded = _pad_rows(tensor.detach(), max(layout.local_sizes))
    parts = [torch.empty_like(padded) for _ in range(layout.world_size)]
    dist.all_gather(parts, padded, group=layout.group)
    return torch.cat([part[:n] for part, n in zip(parts, layout.local_sizes)])


def sum_rows_to_owner(global_rows: torch.Tensor, layout: WorldLayout) -> torch.Tensor:
    """Sum a (B, d) tensor over ranks and return this rank's (b, d) slice of the sum.

    A reduce-scatter; gloo has none, so there it is an all_reduce of the padded stack
    (N× the traffic, the same result).
    """
    if layout.world_size == 1:
        return global_rows
    rows = max(layout.local_sizes)
    stacked = torch.stack([_pad_rows(part, rows) for part in global_rows.split(list(layout.local_sizes))])
    if dist.get_backend(layout.group) == dist.Backend.NCCL:
        mine = torch.empty_like(stacked[0])
        dist.reduce_scatter_tensor(mine, stacked.flatten(0, 1), group=layout.group)
    else:
        dist.all_reduce(stacked, group=layout.group)
        mine = stacked[layout.rank]
    return mine[: layout.local_sizes[layout.rank]]


class _AllGatherSumBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, layout):
        ctx.layout = layout
        return all_gather_rows(tensor, layout)

    @staticmethod
    def backward(ctx, grad_global):
        return sum_rows_to_owner(grad_global.contiguous(), ctx.layout), None


def all_gather_with_grad(tensor: torch.Tensor, layout: WorldLayout) -> torch.Tensor:
    """All-gather whose backward sums the incoming gradients over ranks (reduce-scatter).

    If every rank r computes a loss l_r from the gathered rows, the gradient returned to
    rank r's rows is sum_q dl_q/df_r: every rank's use of those rows is counted.
    """
    if layout.world_size == 1:
        return tensor
    return _AllGatherSumBackward.apply(tensor, layout)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity in the forward pass; multiplies the gradient by `factor` in the backward."""
    if factor == 1:
        return tensor
    return _ScaleGradient.apply(tensor, factor)


def post_exchange(tensors, shifts, receive_rows, layout, tag: int = 0):
    """Post sending tensors[k] to rank + shifts[k] and receiving a block of receive_rows[k] rows from
    rank − shifts[k] (all at once, message tags tag + k); returns (the receive buffers, the requests). Ranks are
    the group's; point-to-point operations name peers by their global rank."""
    rank, world_size = layout.rank, layout.world_size
    received = [tensors[k].new_empty((rows, *tensors[k].shape[1:])) for k, rows in enumerate(receive_rows)]
    operations = []
    for k, (tensor, shift) in enumerate(zip(tensors, shifts)):
        peer_to, peer_from = _global(layout, (rank + shift) % world_size), _global(layout, (rank - shift) % world_size)
        operations.append(dist.P2POp(dist.isend, tensor.contiguous(), peer_to, layout.group, tag=tag + k))
        operations.append(dist.P2POp(dist.irecv, received[k], peer_from, layout.group, tag=tag + k))
    return received, dist.batch_isend_irecv(operations)


def _global(layout: WorldLayout, group_rank: int) -> int:
    """The global rank of the group's `group_rank` (the same where the group is the default one)."""
    return group_rank if layout.group is None else dist.get_global_rank(layout.group, group_rank)
