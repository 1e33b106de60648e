"""The loss backends on one process: without a process group each is the single-process loss (value and
gradients), our references equal open_clip's ClipLoss / SigLipLoss, bf16 features give a float32 loss, and bad
shapes are clear errors. The multi-rank contract (N·∂L/∂f_r, the scalars' gradient once) is checked in
tests/integration/test_losses.py."""

from __future__ import annotations

import pytest
import torch
from fixtures import global_batch, max_error, single_process
from open_clip.loss import ClipLoss, SigLipLoss

from clipdist.losses import BACKENDS, build, clip_loss, siglip_loss

TOLERANCE = 1e-12


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
