"""Image and text towers, built with open_clip's factory (random init unless a local file is given)."""
from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from pathlib import Path

import open_clip
import torch

CONFIG_DIR = Path(__file__).parent / "model_configs"


@functools.cache
def _register_model_configs() -> None:
    """Make clipdist's own model configs (clipdist-tiny, clipdist-timm-tiny) known to open_clip, once."""
    open_clip.add_model_config(CONFIG_DIR)


class _QuietRandomInit(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()


@contextmanager
def _random_init_is_intended():
    """open_clip warns on every random init (on the root logger); here random init is what we ask for."""
    quiet = _QuietRandomInit()
    logging.getLogger().addFilter(quiet)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(quiet)


def model_names() -> list[str]:
    _register_model_configs()
    return open_clip.list_models()


def resolve_model_name(name: str) -> str:
    """`name` as open_clip knows it (a ValueError says how to fix an unknown one). A path to a model
    config file (`my-vit.json`, open_clip's format: embed_dim, vision_cfg, text_cfg) is registered
    with open_clip under its file stem."""
    if name.endswith(".json"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"model.name={name!r}: no such model config file")
        open_clip.add_model_config(path)
        name = path.stem
    if name not in model_names():
        raise ValueError(
            f"unknown model {name!r}; open_clip knows {len(model_names())} configs, e.g. "
            "clipdist-tiny, ViT-B-32, ViT-B-16, ViT-L-14, or give a config file: model.name=/path/to/my-vit.json"
        )
    return name


def create_model(
    name: str = "clipdist-tiny",
    checkpoint: str | None = None,
    grad_checkpointing: bool = False,
    init_logit_scale: float | None = None,
    init_logit_bias: float | None = None,
    device: str = "cpu",
) -> torch.nn.Module:
    """An open_clip CLIP model, randomly initialised (no download ever happens here).

    `name` is any open_clip model config (ours: clipdist-tiny, clipdist-timm-tiny) or a config file
    (see resolve_model_name).
    `checkpoint` loads weights from a local open_clip checkpoint file. `init_logit_scale` is
    the log of the initial scale; `init_logit_bias` gives the model a logit bias (SigLIP).
    """
    name = resolve_model_name(name)
    kwargs = {"device": device}  # "meta": the structure alone, no memory (for checks)
    if init_logit_scale is not None:
        kwargs["init_logit_scale"] = init_logit_scale
    if init_logit_bias is not None:
        kwargs["init_logit_bias"] = init_logit_bias
    with _random_init_is_intended():
        model = open_clip.create_model(name, pretrained=None, pretrained_image=False, pretrained_text=False, **kwargs)
    if checkpoint is not None:
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"model.checkpoint={checkpoint!r} does not exist")
        open_clip.load_checkpoint(model, checkpoint)
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model


def create_model_for_loss(name: str, loss_fn, init_logit_scale: float | None = None,
                          init_logit_bias: float | None = None, **options) -> torch.nn.Module:
    """`create_model` with the scalars `loss_fn` needs: a logit bias only if it uses one, and its
    initial values (SigLIP: scale 10, bias −10) wherever the caller gives none."""
    if init_logit_scale is None:
        init_logit_scale = getattr(loss_fn, "init_logit_scale", None)
    if getattr(loss_fn, "uses_logit_bias", False):
        init_logit_bias = loss_fn.init_logit_bias if init_logit_bias is None else init_logit_bias
    else:
        init_logit_bias = None
    return create_model(name, init_logit_scale=init_logit_scale, init_logit_bias=init_logit_bias, **options)


def get_tokenizer(name: str = "clipdist-tiny"):
    """The model's tokenizer; the BPE vocabulary ships inside open_clip's wheel."""
    _register_model_configs()
    return open_clip.get_tokenizer(resolve_model_name(name))


def random_tokens(batch: int, context_length: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Rows of random BPE ids in open_clip's layout: start-of-text, words, end-of-text, zero padding."""
    tokenizer = open_clip.tokenizer._tokenizer  # the shared SimpleTokenizer: its vocabulary and special ids
    words = torch.randint(0, tokenizer.sot_token_id, (batch, context_length), generator=generator)
    ends = torch.randint(2, context_length, (batch,), generator=generator)
    words[:, 0] = tokenizer.sot_token_id
    for row, end in enumerate(ends.tolist()):
        words[row, end] = tokenizer.eot_token_id
        words[row, end + 1:] = 0
    return words
