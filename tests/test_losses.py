"""Every backend against the single-process loss on the global batch, at the feature level.

Each rank calls the loss on its slice of a global float64 batch. The contract checked:
mean over ranks of the loss == L; gradient at rank r's features == N·∂L/∂f_r (what DDP's
average turns into the single-process gradient); mean over ranks of the logit scale's
gradient == ∂L/∂s. References: ours and open_clip's ClipLoss with world size 1.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from clipdist.distributed import launch_local
from clipdist.losses import BACKENDS, build, clip_loss

DIM = 8
TOLERANCE = 1e-12

# (local batch per rank for world size n, logit scale). One loss module per backend runs
# all cases in order, so the batch size changing between calls is covered too.
CASES = [
    (lambda n: [4] * n, 1 / 0.07),
    (lambda n: [4] * n, 100.0),
    (lambda n: [3] * n, 100.0),
    (lambda n: [2 + r for r in range(n)], 100.0),
]


def global_batch(sizes, seed):
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(sum(sizes), DIM, generator=generator, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(sum(sizes), DIM, generator=generator, dtype=torch.float64), dim=-1)
    return image, text


def single_process(loss_fn, sizes, seed, scale):
    """(loss, ∂L/∂I, ∂L/∂T, ∂L/∂s) of one process on the global batch."""
    image, text = (t.requires_grad_(True) for t in global_batch(sizes, seed))
    logit_scale = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    loss = loss_fn(image, text, logit_scale)
    loss.backward()
    return loss.detach(), image.grad, text.grad, logit_scale.grad


def distributed(loss_fn, sizes, seed, scale):
    """The same four quantities as DDP would see them: rank-local gradients averaged over ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    image, text = global_batch(sizes, seed)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    local_image = image[rows].clone().requires_grad_(True)
    local_text = text[rows].clone().requires_grad_(True)
    logit_scale = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    loss = loss_fn(local_image, local_text, logit_scale)
    loss.backward()
    image_grad, text_grad = torch.zeros_like(image), torch.zeros_like(text)
    image_grad[rows] = local_image.grad
    text_grad[rows] = local_text.grad
    scalars = torch.stack([loss.detach(), logit_scale.grad])
    for tensor in (image_grad, text_grad, scalars):
        dist.all_reduce(tensor)
        tensor /= world_size
    return scalars[0], image_grad, text_grad, scalars[1]


def open_clip_reference(image, text, logit_scale):
    return ClipLoss()(image, text, logit_scale)


def max_error(got, want):
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want))


def check_all_backends():
    """Worker: {(backend, case): (max rel. error vs ours, vs open_clip)} on rank 0."""
    world_size = dist.get_world_size()
    errors = {}
    for backend in BACKENDS:
        loss_fn = build(backend)
        for case, (sizes_for, scale) in enumerate(CASES):
            sizes = sizes_for(world_size)
            got = distributed(loss_fn, sizes, case, scale)
            errors[(backend, case)] = (
                max_error(got, single_process(clip_loss, sizes, case, scale)),
                max_error(got, single_process(open_clip_reference, sizes, case, scale)),
            )
    return errors if dist.get_rank() == 0 else None


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_backend_matches_single_process_loss_and_gradients(world_size):
    errors = launch_local(check_all_backends, world_size, timeout_s=120)[0]
    assert set(errors) == {(b, c) for b in BACKENDS for c in range(len(CASES))}
    bad = {key: err for key, err in errors.items() if max(err) > TOLERANCE}
    assert not bad, f"not exact at world size {world_size}: {bad}"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_without_process_group_is_the_single_process_loss(backend):
    got = single_process(build(backend), [5], 0, 100.0)
    want = single_process(clip_loss, [5], 0, 100.0)
    assert max_error(got, want) < TOLERANCE


def test_reference_equals_open_clip_cliploss():
    got = single_process(clip_loss, [6], 3, 20.0)
    want = single_process(open_clip_reference, [6], 3, 20.0)
    assert max_error(got, want) < TOLERANCE


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_loss_is_float32_under_bf16_autocast(backend):
    image, text = (t.to(torch.bfloat16) for t in global_batch([6], 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = build(backend)(image, text, torch.tensor(100.0))
    assert loss.dtype == torch.float32
    want = clip_loss(image.float(), text.float(), torch.tensor(100.0))
    assert torch.allclose(loss, want, rtol=1e-6)


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


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="same shape"):
        build("disco")(torch.zeros(3, 4), torch.zeros(2, 4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="2-D"):
        build("naive")(torch.zeros(3), torch.zeros(3), torch.tensor(1.0))
    with pytest.raises(ValueError, match="unknown loss backend 'nope'"):
        build("nope")
