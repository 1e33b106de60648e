"""device="meta" builds a model's structure alone: the checks before any rank (preflight) build every model that
way, and open_clip builds on the CPU and then moves, so without a meta device around the build a ViT-L/14's
random init ran in full (3.4 s, 1.7 GB) for a check that reads no value."""

from __future__ import annotations

import pytest
import torch

from clipdist.model.factory import create_model


@pytest.mark.parametrize("name", ["ViT-L-14", "ViT-B-16-SigLIP2-256", "clipdist-naflex-b16", "coca_ViT-B-32"])
def test_a_meta_model_initialises_nothing_off_the_meta_device(name, monkeypatch):
    seen: list[str] = []
    for init in ("normal_", "uniform_", "trunc_normal_", "zeros_", "ones_", "constant_"):
        original = getattr(torch.nn.init, init)

        def recording(tensor, *args, _original=original, **kwargs):
            seen.append(tensor.device.type)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, init, recording)
    model = create_model(name, device="meta")
    assert {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()} == {"meta"}
    assert seen and set(seen) == {"meta"}, f"{seen.count('cpu')} of {len(seen)} initialisations on the CPU"
