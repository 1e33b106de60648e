"""The distributed-loss bugs that public code keeps shipping, reproduced on purpose.

None of these is a backend: they exist so `clipdist gradcheck --loss clipdist.tools.wrong_losses:NAME`
can show what each fault looks like, and so the tests can prove the harness catches them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from clipdist.losses.collectives import all_gather_rows, world_layout
from clipdist.losses.reference import clip_loss


class _BrokenGather(torch.autograd.Function):
    """All-gather with one of the published, wrong backwards.

    "own_slice": a GatherLayer that returns grads[rank] without summing over ranks.
    "average": DisCo-CLIP's published gather, all_reduce(AVG) instead of SUM.
    """

    @staticmethod
    def forward(ctx, tensor, layout, backward):
        ctx.layout, ctx.backward = layout, backward
        return all_gather_rows(tensor, layout)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.backward == "average":
            dist.all_reduce(grad)
            grad /= ctx.layout.world_size
        return grad.split(list(ctx.layout.local_sizes))[ctx.layout.rank], None, None


def _overwrite_own_slice(local, layout):
    parts = list(all_gather_rows(local, layout).split(list(layout.local_sizes)))
    parts[layout.rank] = local
    return torch.cat(parts)


def rank_slice_gather(image_features, text_features, logit_scale):
    """Full loss over a gather whose backward keeps grads[rank] only: encoders get 1/N."""
    layout = world_layout(image_features, text_features)
    return clip_loss(
        _BrokenGather.apply(image_features, layout, "own_slice"),
        _BrokenGather.apply(text_features, layout, "own_slice"),
        logit_scale,
    )


def overwrite_own_slice(image_features, text_features, logit_scale):
    """Plain all_gather with the own slice put back, nothing else: encoders get 1/N."""
    layout = world_layout(image_features, text_features)
    return clip_loss(
        _overwrite_own_slice(image_features, layout), _overwrite_own_slice(text_features, layout), logit_scale
    )


def loss_times_world_size(image_features, text_features, logit_scale):
    """The usual "fix" for the 1/N: multiply the loss by N. Encoders exact, logit scale N×."""
    layout = world_layout(image_features, text_features)
    return layout.world_size * overwrite_own_slice(image_features, text_features, logit_scale)


def disco_average_backward(image_features, text_features, logit_scale):
    """DisCo-CLIP as published: rows sliced from the gathered features, the gather's
    backward averages (all_reduce AVG) — under DDP every encoder gets 1/N."""
    layout = world_layout(image_features, text_features)
    all_image = _BrokenGather.apply(image_features, layout, "average")
    all_text = _BrokenGather.apply(text_features, layout, "average")
    rows = slice(layout.offset, layout.offset + image_features.shape[0])
    labels = torch.arange(rows.start, rows.stop)
    return (
        F.cross_entropy(logit_scale * all_image[rows] @ all_text.T, labels)
        + F.cross_entropy(logit_scale * all_text[rows] @ all_image.T, labels)
    ) / 2


def local_loss_without_grad_gather(image_features, text_features, logit_scale):
    """Local rows against columns gathered without autograd: the "sample as another
    rank's negative" terms are lost — not a rescaling of the true gradient."""
    layout = world_layout(image_features, text_features)
    all_image = all_gather_rows(image_features, layout)
    all_text = all_gather_rows(text_features, layout)
    labels = torch.arange(layout.offset, layout.offset + image_features.shape[0])
    return (
        F.cross_entropy(logit_scale * image_features @ all_text.T, labels)
        + F.cross_entropy(logit_scale * text_features @ all_image.T, labels)
    ) / 2
