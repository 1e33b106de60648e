"""Image and text towers, built with open_clip's factory (random init unless a local file is given)."""
from __future__ import annotations

from pathlib import Path

import logging

import open_clip
import torch

CONFIG_DIR = Path(__file__).parent / "model_configs"
open_clip.add_model_config(CONFIG_DIR)


class _QuietRandomInit(logging.Filter):
    """open_clip warns on every random init; random init is what we ask for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()


logging.getLogger().addFilter(_QuietRandomInit())


def create_model(
    name: str = "clipdist-tiny",
    checkpoint: str | None = None,
    grad_checkpointing: bool = False,
    init_logit_scale: float | None = None,
    init_logit_bias: float | None = None,
) -> torch.nn.Module:
    """An open_clip CLIP model, randomly initialised (no download ever happens here).

    `name` is any open_clip model config (ours: clipdist-tiny, clipdist-timm-tiny).
    `checkpoint` loads weights from a local open_clip checkpoint file. `init_logit_scale` is
    the log of the initial scale; `init_logit_bias` gives the model a logit bias (SigLIP).
    """
    if name not in open_clip.list_models():
        raise ValueError(
            f"unknown model {name!r}; open_clip knows {len(open_clip.list_models())} configs, e.g. "
            "clipdist-tiny, ViT-B-32, ViT-B-16, ViT-L-14"
        )
    kwargs = {}
    if init_logit_scale is not None:
        kwargs["init_logit_scale"] = init_logit_scale
    if init_logit_bias is not None:
        kwargs["init_logit_bias"] = init_logit_bias
    model = open_clip.create_model(name, pretrained=None, pretrained_image=False, pretrained_text=False, **kwargs)
    if checkpoint is not None:
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"model.checkpoint={checkpoint!r} does not exist")
        open_clip.load_checkpoint(model, checkpoint)
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model


def get_tokenizer(name: str = "clipdist-tiny"):
    """The model's tokenizer; the BPE vocabulary ships inside open_clip's wheel."""
    return open_clip.get_tokenizer(name)
