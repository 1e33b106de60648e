"""Captions cut to their batch's longest change no feature and no gradient where clipdist cuts them, and are left
padded (with the reason said) where padding would matter."""

from __future__ import annotations

import math

import pytest
import torch

from clipdist.data.batch import Batch
from clipdist.losses import build
from clipdist.model.factory import create_model, get_tokenizer
from clipdist.model.short_text import allow_short_text, trim, trims_exactly
from clipdist.train.step import build_step

CAPTIONS = [
    "a photo of the digit seven.",
    "4",
    "a handwritten zero, slightly slanted to the left, on white",
    "café's — nine",
]


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_model("clipdist-tiny", init_logit_scale=math.log(10)).double()


def test_cut_captions_give_the_padded_captions_features_and_gradients():
    tokens = get_tokenizer("clipdist-tiny")(CAPTIONS)
    short = trim(tokens)
    assert short.shape[1] < tokens.shape[1] and torch.equal(short, tokens[:, : short.shape[1]])
    assert (tokens[:, short.shape[1] :] == 0).all()
    model = _tiny()
    padded = model.encode_text(tokens)
    assert allow_short_text(model) and type(model).__name__ == "ShortTextCLIP"
    torch.testing.assert_close(model.encode_text(short), padded, rtol=0, atol=1e-12)
    torch.testing.assert_close(model.encode_text(tokens), padded, rtol=0, atol=0)  # full length still taken
    images = torch.randn(len(CAPTIONS), 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gradients = []
    for cut in (False, True):
        model = _tiny()
        allow_short_text(model)
        step = build_step(model, build("disco"), trim_text=cut)
        loss = step.gradients(Batch.of(images, tokens))
        gradients.append((loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    assert gradients[0][0] == pytest.approx(gradients[1][0], rel=1e-13)
    for name, gradient in gradients[0][1].items():
        torch.testing.assert_close(gradients[1][1][name], gradient, rtol=1e-10, atol=1e-14, msg=name)


def test_a_tower_whose_features_depend_on_padding_is_left_padded_and_says_why():
    assert trims_exactly(_tiny()) is None
    custom = create_model("clipdist-tiny", device="meta", overrides={"force_custom_text": True})
    assert "a CustomTextCLIP model" in trims_exactly(custom)
    assert not allow_short_text(custom) and type(custom).__name__ == "CustomTextCLIP"
    last = _tiny()
    last.text_pool_type = "last"  # SigLIP's text towers pool at the last position: it moves with the padding
    assert "pools at 'last'" in trims_exactly(last) and not allow_short_text(last)
    assert "a CoCa model" in trims_exactly(create_model("clipdist-coca-tiny", device="meta"))
    assert trim(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 1)


@pytest.mark.parametrize(
    "trim_text, precision, cut",
    [(None, "fp32", True), (None, "bf16", False), (None, "fp16", False), (True, "bf16", True), (False, "fp32", False)],
)
def test_the_default_cuts_captions_in_fp32_only(trim_text, precision, cut):
    """data.trim_text=null cuts where the towers compute in fp32; under autocast only when asked (true)."""
    from clipdist.config import TrainConfig
    from clipdist.train.parts import trims_text

    cfg = TrainConfig()
    cfg.data.trim_text, cfg.precision = trim_text, precision
    assert trims_text(cfg, torch.device("cpu")) is cut
