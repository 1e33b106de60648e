"""`clipdist export --format transformers`: a model as Hugging Face transformers loads it, offline and alone.

    model = transformers.CLIPModel.from_pretrained(OUT)
    processor = transformers.CLIPProcessor.from_pretrained(OUT)
    pipeline("zero-shot-image-classification", model=OUT)

open_clip's CLIP and transformers' CLIPModel are one architecture under two names: a ViT with a class token, a
pre- and a post-norm, and a projection; a causal text transformer pooled at the end-of-text token. The mapping,
per block, is open_clip's fused attention projection split in three,

    in_proj_weight = [W_q; W_k; W_v]   ->   q_proj.weight = W_q, k_proj.weight = W_k, v_proj.weight = W_v

and its projections transposed (open_clip computes x @ P, transformers x @ Wᵀ with W = Pᵀ). The tokenizer files
are made from open_clip's own BPE vocabulary (the same ids: <|startoftext|> 49406, <|endoftext|> 49407), the
image processor from the model's preprocess config (size, crop, mean, std, interpolation).

What has no counterpart is refused in one line naming the part: image towers other than open_clip's ViT (timm,
ResNet), attention pooling, average pooling, layer scale, norms inside attention, a text tower from
transformers, CoCa's decoder, a tokenizer other than open_clip's BPE. Before anything is written the converted
model encodes an image and a caption beside the original; a difference beyond 1e-5 (relative) refuses the
export, so a variant this mapping misses cannot leave as a different model. A SigLIP-loss run (CLIP towers with
a logit bias) maps to CLIPModel: its features and similarities are the model's; CLIPModel has no logit bias, so
the bias is kept in config.json as `logit_bias` and sigmoid(scale·cos + bias) is computed by the user.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import open_clip
import torch
from torch import nn

from clipdist.files import write_atomic
from clipdist.model.factory import base_tokenizer

FORMAT = "transformers"
CHECK_TOLERANCE = 1e-5  # relative difference of the features, fp32, before the export is written
SPECIAL = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}  # open_clip's -> transformers'
# PIL's resample codes, as CLIPImageProcessor takes them
INTERPOLATION: dict[str, Any] = {"bicubic": 3, "bilinear": 2, "nearest": 0}


class NoCounterpart(ValueError):
    """A part of the model transformers' CLIPModel cannot represent."""


def _activation(block: Any, where: str) -> str:
    act = block.mlp.gelu
    if isinstance(act, open_clip.transformer.QuickGELU):
        return "quick_gelu"
    if isinstance(act, nn.GELU) and act.approximate == "none":
        return "gelu"
    raise NoCounterpart(f"{where}'s activation {act!r} has no CLIPModel counterpart (gelu or quick_gelu)")


def _tower(transformer: Any, where: str) -> dict:
    """Per-tower settings the weights do not carry: activation, norm eps, heads; refuses block variants."""
    blocks = list(transformer.resblocks)
    first = blocks[0]
    if type(first) is not open_clip.transformer.ResidualAttentionBlock:
        raise NoCounterpart(
            f"{where} uses {type(first).__name__} blocks (norms or scales inside attention): "
            "CLIPModel has plain pre-norm blocks"
        )
    for block in blocks:
        if not isinstance(block.ls_1, nn.Identity) or not isinstance(block.ls_2, nn.Identity):
            raise NoCounterpart(f"{where} has layer scale (ls_init_value): CLIPModel has none")
        if not isinstance(block.attn, nn.MultiheadAttention) or block.attn.in_proj_weight is None:
            raise NoCounterpart(f"{where}'s attention is not one fused projection with biases")
    norms = {module.eps for block in blocks for module in (block.ln_1, block.ln_2)}
    activations = {_activation(block, where) for block in blocks}
    if len(norms) != 1 or len(activations) != 1:
        raise NoCounterpart(f"{where} mixes norm eps or activations across blocks: CLIPModel has one of each")
    return {
        "hidden_size": first.ln_1.normalized_shape[0],
        "intermediate_size": first.mlp.c_fc.out_features,
        "num_hidden_layers": len(blocks),
        "num_attention_heads": first.attn.num_heads,
        "hidden_act": activations.pop(),
        "layer_norm_eps": norms.pop(),
    }


def _text_of(model: Any) -> Any:
    """The module holding the text tower's parameters: the CLIP itself, or CustomTextCLIP's `text`."""
    if isinstance(model, open_clip.CoCa):
        raise NoCounterpart("CoCa's text decoder has no transformers counterpart: export it with --format open_clip")
    text = getattr(model, "text", model)
    if not isinstance(text, (open_clip.model.CLIP, open_clip.transformer.TextTransformer)):
        raise NoCounterpart(
            f"the text tower is a {type(text).__name__} (a tower from transformers, hf_model_name): "
            "CLIPModel's text tower is open_clip's own TextTransformer"
        )
    return text


def clip_config(model: Any, tokenizer) -> dict:
    """transformers' CLIPConfig (as keyword arguments) for `model`; NoCounterpart naming what does not map."""
    text = _text_of(model)  # CoCa first: its decoder, not its pooling, is what has no counterpart
    visual = model.visual
    if not isinstance(visual, open_clip.transformer.VisionTransformer):
        name = getattr(getattr(visual, "trunk", None), "default_cfg", {}).get("architecture", type(visual).__name__)
        raise NoCounterpart(
            f"the image tower is {name} (not open_clip's VisionTransformer): CLIPModel's image "
            "tower is a ViT with a class token; export it with --format open_clip"
        )
    if visual.attn_pool is not None or visual.pool_type != "tok" or visual.final_ln_after_pool:
        raise NoCounterpart(
            "the image tower pools by attention or by averaging (attentional_pool, pool_type, "
            "final_ln_after_pool): CLIPModel pools the class token"
        )
    if isinstance(visual.ln_pre, nn.Identity) or visual.proj is None:
        raise NoCounterpart(
            "the image tower has no pre-norm or no projection (no_ln_pre, proj_type): CLIPModel has both"
        )
    (height, width), (patch_h, patch_w) = visual.image_size, visual.patch_size
    if height != width or patch_h != patch_w:
        raise NoCounterpart(f"images {height}x{width} in patches {patch_h}x{patch_w}: CLIPModel takes square ones")
    if text.attn_mask is None or getattr(text, "cls_emb", None) is not None:
        raise NoCounterpart(
            "the text tower is not causal or has a class token (no_causal_mask, embed_cls): "
            "CLIPModel's is causal, pooled at the end-of-text token"
        )
    if text.text_pool_type not in ("argmax", "eos") or not isinstance(text.text_projection, nn.Parameter):
        raise NoCounterpart(
            f"the text tower pools by {text.text_pool_type!r} or projects with a bias: CLIPModel "
            "pools the end-of-text token and projects without one"
        )
    _check_tokenizer(tokenizer, text.vocab_size)
    embed_dim = visual.proj.shape[1]
    vision = {
        **_tower(visual.transformer, "the image tower"),
        "image_size": height,
        "patch_size": patch_h,
        "num_channels": visual.conv1.in_channels,
        "projection_dim": embed_dim,
    }
    text_cfg = {
        **_tower(text.transformer, "the text tower"),
        "vocab_size": text.vocab_size,
        "max_position_embeddings": text.context_length,
        "projection_dim": embed_dim,
        "bos_token_id": tokenizer.sot_token_id,
        "eos_token_id": tokenizer.eot_token_id,
        "pad_token_id": tokenizer.eot_token_id,
    }
    config = {
        "text_config": text_cfg,
        "vision_config": vision,
        "projection_dim": embed_dim,
        "logit_scale_init_value": float(model.logit_scale.detach().float()),
    }
    if getattr(model, "logit_bias", None) is not None:
        config["logit_bias"] = float(model.logit_bias.detach().float())
    return config


def _check_tokenizer(tokenizer, vocab_size: int) -> None:
    tokenizer = base_tokenizer(tokenizer)
    if type(tokenizer) is not open_clip.tokenizer.SimpleTokenizer:
        raise NoCounterpart(
            f"the tokenizer is {type(tokenizer).__name__}: the export writes open_clip's BPE "
            "vocabulary as CLIPTokenizer, and only that"
        )
    if (
        tokenizer.clean_fn is not open_clip.tokenizer._clean_lower
        or tokenizer.reduction_fn is not None
        or tokenizer.vocab_size != vocab_size
        or len(tokenizer.all_special_ids) != 2
    ):
        raise NoCounterpart(
            "the tokenizer cleans, reduces or extends open_clip's BPE (tokenizer_kwargs): "
            "CLIPTokenizer lower-cases and nothing else"
        )


def clip_weights(model: Any) -> dict[str, torch.Tensor]:
    """open_clip's state dict under CLIPModel's names (the module docstring); every tensor used once."""
    source = dict(model.state_dict())
    text_prefix = "text." if hasattr(model, "text") else ""
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        return source.pop(key).detach().float().contiguous()

    def tower(prefix: str, to: str, layers: int) -> None:
        for index in range(layers):
            block, layer = f"{prefix}transformer.resblocks.{index}.", f"{to}encoder.layers.{index}."
            for name, value in zip("qkv", take(block + "attn.in_proj_weight").chunk(3)):
                out[f"{layer}self_attn.{name}_proj.weight"] = value.contiguous()
            for name, value in zip("qkv", take(block + "attn.in_proj_bias").chunk(3)):
                out[f"{layer}self_attn.{name}_proj.bias"] = value.contiguous()
            for ours, theirs in (
                ("attn.out_proj", "self_attn.out_proj"),
                ("ln_1", "layer_norm1"),
                ("mlp.c_fc", "mlp.fc1"),
                ("mlp.c_proj", "mlp.fc2"),
                ("ln_2", "layer_norm2"),
            ):
                for kind in ("weight", "bias"):
                    out[f"{layer}{theirs}.{kind}"] = take(f"{block}{ours}.{kind}")

    visual = model.visual
    out["vision_model.embeddings.class_embedding"] = take("visual.class_embedding")
    out["vision_model.embeddings.patch_embedding.weight"] = take("visual.conv1.weight")
    out["vision_model.embeddings.position_embedding.weight"] = take("visual.positional_embedding")
    for ours, theirs in (("ln_pre", "pre_layrnorm"), ("ln_post", "post_layernorm")):
        for kind in ("weight", "bias"):
            out[f"vision_model.{theirs}.{kind}"] = take(f"visual.{ours}.{kind}")
    tower("visual.", "vision_model.", len(visual.transformer.resblocks))
    out["visual_projection.weight"] = take("visual.proj").t().contiguous()

    text = _text_of(model)
    out["text_model.embeddings.token_embedding.weight"] = take(f"{text_prefix}token_embedding.weight")
    out["text_model.embeddings.position_embedding.weight"] = take(f"{text_prefix}positional_embedding")
    tower(text_prefix, "text_model.", len(text.transformer.resblocks))
    for kind in ("weight", "bias"):
        out[f"text_model.final_layer_norm.{kind}"] = take(f"{text_prefix}ln_final.{kind}")
    out["text_projection.weight"] = take(f"{text_prefix}text_projection").t().contiguous()
    out["logit_scale"] = take("logit_scale")
    source.pop("logit_bias", None)  # config.json's logit_bias (CLIPModel has no parameter for it)
    source = {key: value for key, value in source.items() if key != f"{text_prefix}attn_mask"}
    if source:
        raise NoCounterpart(f"{len(source)} tensor(s) have no CLIPModel counterpart, e.g. {sorted(source)[0]}")
    return out


def write_tokenizer(tokenizer, folder: Path) -> tuple[Path, Path]:
    """vocab.json and merges.txt, transformers' CLIP layout, from open_clip's BPE (the same ids)."""
    vocab = {SPECIAL.get(token, token): index for token, index in tokenizer.encoder.items()}
    merges = sorted(tokenizer.bpe_ranks, key=tokenizer.bpe_ranks.__getitem__)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "vocab.json", json.dumps(vocab, ensure_ascii=False))
    write_atomic(folder / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return folder / "vocab.json", folder / "merges.txt"


def processor(model: Any, tokenizer, context_length: int, folder: Path):
    """CLIPProcessor: the image processor from the model's preprocess config, CLIPTokenizerFast from its BPE."""
    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPTokenizerFast

    preprocess = model.visual.preprocess_cfg
    size = preprocess["size"]
    height, width = (size, size) if isinstance(size, int) else size
    mode = preprocess.get("resize_mode", "shortest")
    sizes: dict[str, Any]
    if mode == "shortest" and height == width:
        sizes = {
            "size": {"shortest_edge": height},
            "crop_size": {"height": height, "width": width},
            "do_center_crop": True,
        }
    elif mode == "squash":
        sizes = {"size": {"height": height, "width": width}, "do_center_crop": False}
    else:
        raise NoCounterpart(
            f"images resized by {mode!r} to {height}x{width}: CLIPImageProcessor resizes the "
            "shortest edge and crops a square, or squashes"
        )
    if preprocess.get("interpolation", "bicubic") not in INTERPOLATION:
        raise NoCounterpart(f"interpolation {preprocess['interpolation']!r}: not one CLIPImageProcessor has")
    images = CLIPImageProcessor(
        **sizes,
        resample=INTERPOLATION[preprocess.get("interpolation", "bicubic")],
        image_mean=list(preprocess["mean"]),
        image_std=list(preprocess["std"]),
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        do_convert_rgb=True,
    )
    vocab, merges = write_tokenizer(tokenizer, folder / ".bpe")
    text = CLIPTokenizerFast(
        vocab_file=str(vocab),
        merges_file=str(merges),
        unk_token="<|endoftext|>",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=context_length,
    )
    return CLIPProcessor(image_processor=images, tokenizer=text)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def features(output) -> torch.Tensor:
    """CLIPModel.get_image_features / get_text_features as a tensor: transformers 4.x returns the projected features,
    5.x an output whose pooler_output holds them."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def check_same(model: Any, theirs, tokenizer, size: int) -> float:
    """The largest relative difference of image and text features between `model` and its conversion;
    NoCounterpart where it exceeds CHECK_TOLERANCE."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, size, size, generator=generator)
    tokens = tokenizer(
        ["a photo of a cat.", "a diagram of the number 7, drawn by hand"],
        context_length=theirs.config.text_config.max_position_embeddings,
    )
    model = model.float().eval()
    with torch.no_grad():
        differences = (
            _relative(features(theirs.get_image_features(pixel_values=images)), model.encode_image(images)),
            _relative(features(theirs.get_text_features(input_ids=tokens)), model.encode_text(tokens)),
        )
    if max(differences) > CHECK_TOLERANCE:
        raise NoCounterpart(
            f"the converted model's features differ from the model's by {max(differences):.2e} "
            f"(relative; the bound is {CHECK_TOLERANCE:g}): a variant the mapping does not know; "
            "export it with --format open_clip"
        )
    return max(differences)


def write_transformers(model: Any, tokenizer, folder: Path) -> float:
    """CLIPModel's folder for `model` (weights, config, tokenizer, image processor) written into `folder`; the
    relative feature difference the check measured."""
    from transformers import CLIPConfig, CLIPModel

    tokenizer = base_tokenizer(tokenizer)  # its vocabulary, as open_clip ships it
    model = model.float().eval()
    config = CLIPConfig(**clip_config(model, tokenizer))
    theirs = CLIPModel(config).eval()
    theirs.load_state_dict(clip_weights(model), strict=True)
    difference = check_same(model, theirs, tokenizer, config.vision_config.image_size)
    folder.mkdir()
    theirs.save_pretrained(folder, safe_serialization=True)
    built = processor(model, tokenizer, config.text_config.max_position_embeddings, folder)
    built.save_pretrained(folder)
    for leftover in sorted((folder / ".bpe").iterdir()):
        leftover.unlink()
    (folder / ".bpe").rmdir()
    return difference
