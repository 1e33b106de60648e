"""The transformers mapping (clipdist.tools.to_transformers): every part CLIPModel cannot represent is refused in
one line naming the part, before anything is written; the vocabulary is open_clip's. (The variants it converts,
and its self-check, are in tests/integration/test_transformers_export.py: they need transformers imported.)"""

from __future__ import annotations

import copy

import open_clip
import pytest
from fixtures import tiny_open_clip

from clipdist.tools import to_transformers


@pytest.mark.parametrize(
    "build, part",
    [
        (lambda: tiny_open_clip(vision={"ls_init_value": 0.1}), "layer scale"),
        (lambda: tiny_open_clip(vision={"attentional_pool": True}), "pools by attention"),
        (lambda: tiny_open_clip(vision={"pool_type": "avg"}), "pools by attention or by averaging"),
        (lambda: tiny_open_clip(vision={"no_ln_pre": True}), "no pre-norm"),
        (lambda: tiny_open_clip(vision={"image_size": [32, 48]}), "square"),
        (lambda: tiny_open_clip(text={"no_causal_mask": True}), "not causal"),
        (lambda: tiny_open_clip(text={"pool_type": "last"}), "pools by 'last'"),
        (lambda: tiny_open_clip(vision={"scaled_cosine_attn": True}), "CustomResidualAttentionBlock"),
        (lambda: open_clip.create_model("clipdist-timm-tiny"), "vit_tiny_patch16_224"),
        (lambda: open_clip.create_model("clipdist-coca-tiny"), "CoCa's text decoder"),
    ],
    ids=[
        "layer_scale",
        "attn_pool",
        "avg_pool",
        "no_ln_pre",
        "not_square",
        "not_causal",
        "last_pool",
        "cosine_attn",
        "timm_tower",
        "coca",
    ],
)
def test_what_clipmodel_cannot_represent_is_refused_naming_the_part(build, part):
    from clipdist.model import factory as models

    models._register_model_configs()
    with pytest.raises(to_transformers.NoCounterpart, match=part) as refused:
        to_transformers.clip_config(build(), open_clip.tokenizer._tokenizer)  # the shared one: 0.4 s a new one
    assert "\n" not in str(refused.value)


def test_a_tokenizer_other_than_open_clips_bpe_is_refused():
    canonical = copy.copy(open_clip.tokenizer._tokenizer)
    canonical.clean_fn = open_clip.tokenizer.get_clean_fn("canonicalize")
    with pytest.raises(to_transformers.NoCounterpart, match="cleans, reduces or extends"):
        to_transformers.clip_config(tiny_open_clip(), canonical)


def test_the_vocabulary_is_open_clips_under_transformers_names(tmp_path):
    import json

    tokenizer = open_clip.tokenizer._tokenizer
    vocab, merges = to_transformers.write_tokenizer(tokenizer, tmp_path)
    ids = json.loads(vocab.read_text())
    assert len(ids) == 49408 and ids["<|startoftext|>"] == 49406 and ids["<|endoftext|>"] == 49407
    assert ids["photo</w>"] == tokenizer.encoder["photo</w>"]
    lines = merges.read_text().splitlines()
    assert lines[0] == "#version: 0.2" and len(lines) == 1 + len(tokenizer.bpe_ranks)
