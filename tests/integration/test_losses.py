"""Every backend against the single-process loss on the global batch, at the feature level.

Each rank calls the loss on its slice of a global float64 batch. The contract checked:
mean over ranks of the loss == L; gradient at rank r's features == N·∂L/∂f_r (what DDP's
average turns into the single-process gradient); mean over ranks of the logit scale's
gradient == ∂L/∂s (and the logit bias's, for siglip). References: each backend's own (its registry entry's
`reference`) and, where that is CLIP's or SigLIP's loss, open_clip's ClipLoss / SigLipLoss with world size 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fixtures import global_batch, max_error, scalar_parameters, single_process
from open_clip.loss import ClipLoss, SigLipLoss

from clipdist.distributed.launch import launch_local
from clipdist.losses import BACKENDS, build
from clipdist.registry import load
from clipdist.registry.losses import CLIP, SIGLIP

TOLERANCE = 1e-12

# (local batch per rank for world size n, logit scale). One loss module per backend runs
# all cases in order, so the batch size changing between calls is covered too.
CASES = [
    (lambda n: [4] * n, 1 / 0.07),
    (lambda n: [4] * n, 100.0),
    (lambda n: [3] * n, 100.0),
    (lambda n: [2 + r for r in range(n)], 100.0),
]


def distributed(loss_fn, sizes, seed, scale, with_bias=False):
    """The same quantities as DDP would see them: rank-local gradients averaged over ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    image, text = global_batch(sizes, seed)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    local_image = image[rows].clone().requires_grad_(True)
    local_text = text[rows].clone().requires_grad_(True)
    scalars = scalar_parameters(scale, with_bias)
    loss = loss_fn(local_image, local_text, *scalars)
    loss.backward()
    image_grad, text_grad = torch.zeros_like(image), torch.zeros_like(text)
    image_grad[rows] = local_image.grad
    text_grad[rows] = local_text.grad
    values = torch.stack([loss.detach(), *(s.grad for s in scalars)])
    for tensor in (image_grad, text_grad, values):
        dist.all_reduce(tensor)
        tensor /= world_size
    return values[0], image_grad, text_grad, *values[1:]


OPEN_CLIP = {CLIP: ClipLoss, SIGLIP: SigLipLoss}  # the references open_clip also defines (at world size 1)


def open_clip_reference(name: str):
    """open_clip's definition of the loss backend `name` computes, or its own reference where open_clip has none."""
    reference = BACKENDS[name].reference
    return OPEN_CLIP[reference]() if reference in OPEN_CLIP else load(reference)


# Every registered backend, plus the ring backends with tiles smaller than the local and global batch
# so rows and columns span several (and partial) tiles.
LOSSES = {
    **{name: (name, {}) for name in BACKENDS},
    "tiled(tile=3)": ("tiled", {"tile": 3}),
    "siglip(tile=3)": ("siglip", {"tile": 3}),
}


def check_all_backends():
    """Worker: {(loss, case): (max rel. error vs ours, vs open_clip)} on rank 0."""
    world_size = dist.get_world_size()
    errors = {}
    for backend, (name, options) in LOSSES.items():
        loss_fn = build(name, **options)
        bias = loss_fn.uses_logit_bias
        for case, (sizes_for, scale) in enumerate(CASES):
            sizes = sizes_for(world_size)
            got = distributed(loss_fn, sizes, case, scale, bias)
            errors[(backend, case)] = (
                max_error(got, single_process(loss_fn.reference, sizes, case, scale, bias)),
                max_error(got, single_process(open_clip_reference(name), sizes, case, scale, bias)),
            )
    return errors if dist.get_rank() == 0 else None


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_backend_matches_single_process_loss_and_gradients(world_size):
    errors = launch_local(check_all_backends, world_size, timeout_s=120)[0]
    assert set(errors) == {(b, c) for b in LOSSES for c in range(len(CASES))}
    bad = {key: err for key, err in errors.items() if max(err) > TOLERANCE}
    assert not bad, f"not exact at world size {world_size}: {bad}"


def mismatched_feature_dims():
    """Worker: rank 1 passes d=6, the others d=8; every rank must raise, none may hang."""
    dim = 6 if dist.get_rank() == 1 else 8
    features = F.normalize(torch.randn(3, dim, dtype=torch.float64), dim=-1)
    try:
        build("disco")(features, features, torch.tensor(10.0))
    except ValueError as error:
        return str(error)
    return None


def test_mismatched_feature_dims_raise_on_every_rank():
    messages = launch_local(mismatched_feature_dims, 3, timeout_s=60)
    assert len(messages) == 3
    assert all(m is not None and "feature dimension differs across ranks" in m for m in messages.values())
