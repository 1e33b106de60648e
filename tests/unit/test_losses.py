"""Every backend against the single-process loss on the global batch, at the feature level.

Each rank calls the loss on its slice of a global float64 batch. The contract checked:
mean over ranks of the loss == L; gradient at rank r's features == N·∂L/∂f_r (what DDP's
average turns into the single-process gradient); mean over ranks of the logit scale's
gradient == ∂L/∂s (and the logit bias's, for siglip). References: ours and open_clip's
ClipLoss / SigLipLoss with world size 1.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss, SigLipLoss

from clipdist.losses import BACKENDS, build, clip_loss, siglip_loss

DIM = 8
TOLERANCE = 1e-12

def global_batch(sizes, seed):
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(sum(sizes), DIM, generator=generator, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(sum(sizes), DIM, generator=generator, dtype=torch.float64), dim=-1)
    return image, text


def scalar_parameters(scale, with_bias):
    """Logit scale (and the SigLIP bias, at its usual init of −10) as leaves that want gradients."""
    values = [scale, -10.0] if with_bias else [scale]
    return [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values]


def single_process(loss_fn, sizes, seed, scale, with_bias=False):
    """(loss, ∂L/∂I, ∂L/∂T, ∂L/∂s[, ∂L/∂t]) of one process on the global batch."""
    image, text = (t.requires_grad_(True) for t in global_batch(sizes, seed))
    scalars = scalar_parameters(scale, with_bias)
    loss = loss_fn(image, text, *scalars)
    loss.backward()
    return loss.detach(), image.grad, text.grad, *(s.grad for s in scalars)


def max_error(got, want):
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_without_process_group_is_the_single_process_loss(backend):
    loss_fn = build(backend)
    got = single_process(loss_fn, [5], 0, 100.0, loss_fn.uses_logit_bias)
    want = single_process(loss_fn.reference, [5], 0, 100.0, loss_fn.uses_logit_bias)
    assert max_error(got, want) < TOLERANCE


@pytest.mark.parametrize("reference, with_bias", [(clip_loss, False), (siglip_loss, True)])
def test_references_equal_open_clip(reference, with_bias):
    got = single_process(reference, [6], 3, 20.0, with_bias)
    want = single_process(SigLipLoss() if with_bias else ClipLoss(), [6], 3, 20.0, with_bias)
    assert max_error(got, want) < TOLERANCE


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_loss_is_float32_under_bf16_autocast(backend):
    image, text = (t.to(torch.bfloat16) for t in global_batch([6], 1))
    loss_fn = build(backend)
    scalars = [torch.tensor(100.0)] + ([torch.tensor(-10.0)] if loss_fn.uses_logit_bias else [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(image, text, *scalars)
    assert loss.dtype == torch.float32
    want = loss_fn.reference(image.float(), text.float(), *scalars)
    assert torch.allclose(loss, want, rtol=1e-6)


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="same shape"):
        build("disco")(torch.zeros(3, 4), torch.zeros(2, 4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="2-D"):
        build("naive")(torch.zeros(3), torch.zeros(3), torch.tensor(1.0))
    with pytest.raises(ValueError, match="unknown loss backend 'nope'"):
        build("nope")
