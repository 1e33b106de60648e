"""Image and text towers, built with open_clip's factory: random init, or the weights of a local file, an
open_clip pretrained tag, an `hf-hub:` or a `local-dir:` model."""
from __future__ import annotations

import functools
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import open_clip
import torch

from clipdist.weights import read_weights

CONFIG_DIR = Path(__file__).parent / "model_configs"
DEFAULT_MODEL = "clipdist-tiny"  # ~3.4M parameters, 32-px images: trains on a laptop CPU in minutes (conf/model/tiny.yaml)


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


SCHEMAS = ("hf-hub:", "local-dir:")  # open_clip's model names whose config (and weights) come from elsewhere


def resolve_model_name(name: str) -> str:
    """`name` as open_clip knows it (a ValueError says how to fix an unknown one). A path to a model
    config file (`my-vit.json`, open_clip's format: embed_dim, vision_cfg, text_cfg) is registered
    with open_clip under its file stem; `hf-hub:ORG/REPO` and `local-dir:PATH` pass through to open_clip
    (a local folder must hold open_clip_config.json, as `clipdist export` writes it)."""
    if name.startswith("local-dir:"):
        folder = Path(name.removeprefix("local-dir:")).expanduser()
        if not (folder / "open_clip_config.json").is_file():
            raise ValueError(f"model.name={name}: {folder} holds no open_clip_config.json (a folder in open_clip's "
                             "hub layout, as `clipdist export` writes it)")
        return f"local-dir:{folder}"
    if name.startswith("hf-hub:"):
        return name
    if name.endswith(".json"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"model.name={name!r}: no such model config file")
        open_clip.add_model_config(path)
        name = path.stem
    if name not in model_names():
        raise ValueError(
            f"unknown model {name!r}; open_clip knows {len(model_names())} configs, e.g. "
            "clipdist-tiny, ViT-B-32, ViT-B-16, ViT-L-14, a config file (model.name=/path/to/my-vit.json), "
            "hf-hub:ORG/REPO or local-dir:PATH"
        )
    return name


def pretrained_cfg(name: str, pretrained: str | None) -> dict:
    """open_clip's entry for pretrained tag `pretrained` of model `name` ({} for none); a ValueError lists the tags."""
    if pretrained is None:
        return {}
    if name.startswith(SCHEMAS):
        raise ValueError(f"model.pretrained={pretrained} is for open_clip's built-in models; {name} brings its own "
                         "weights: leave model.pretrained unset")
    found = open_clip.get_pretrained_cfg(name, pretrained)
    if not found:
        tags = open_clip.list_pretrained_tags_by_model(name)
        raise ValueError(f"model.pretrained={pretrained}: open_clip has no such tag for {name} "
                         f"({'its tags: ' + ', '.join(tags) if tags else 'it has no pretrained weights'})")
    return found


def fetches_weights(name: str, pretrained: str | None) -> bool:
    """Whether the starting weights come over the network into a cache (a pretrained tag, an `hf-hub:` model)."""
    return pretrained is not None or name.startswith("hf-hub:")


def pretrained_weights(name: str, pretrained: str | None = None, cache_dir: str | None = None) -> str | None:
    """The local file or folder that model `name` starts from, fetched into Hugging Face's cache (or `cache_dir`)
    if it is not there yet: the weights of open_clip pretrained tag `pretrained`, or of an `hf-hub:` or
    `local-dir:` model; None for none. A ValueError in one line when they can be neither found nor fetched."""
    name = resolve_model_name(name)
    if name.startswith("local-dir:"):
        return name.removeprefix("local-dir:")
    what = f"model.pretrained={pretrained}" if pretrained else f"model.name={name}"
    if name.startswith("hf-hub:"):
        repo, filename = name.removeprefix("hf-hub:"), None
    else:
        tag = pretrained_cfg(name, pretrained)
        if not tag:
            return None
        repo, filename = os.path.split(tag["hf_hub"])  # open_clip's 'org/repo/' or 'org/repo/file.bin'
    try:
        return _hub_weights(repo, filename or None, cache_dir)
    except Exception as error:  # noqa: BLE001 -- offline, not cached, no such repo: the reason is the message
        reason = " ".join(str(error).split())[:300]
        raise ValueError(
            f"{what}: the weights are not in the cache ({cache_dir or 'HF_HOME, ~/.cache/huggingface'}) and cannot "
            f"be fetched from here ({reason}); fetch them once where there is network (the same command, or "
            f"`huggingface-cli download {repo}`) into a cache this machine reads (HF_HOME, model.cache_dir), or point "
            "model.checkpoint at the file") from None


def _hub_weights(repo: str, filename: str | None, cache_dir: str | None) -> str:
    """A weights file of Hugging Face repo `repo`, as open_clip names them (its safetensors twin first): from the
    cache without touching the network where it is there, else downloaded — after a quick check that the hub can
    be reached at all, since the hub's client retries an unreachable one for about a minute."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    filename = filename or "open_clip_pytorch_model.bin"
    names = ["open_clip_model.safetensors"] if filename == "open_clip_pytorch_model.bin" else \
        [filename[:-4] + ".safetensors"] if filename.endswith((".bin", ".pth")) else []
    names.append(filename)
    for candidate in names:
        found = try_to_load_from_cache(repo, candidate, cache_dir=cache_dir)
        if isinstance(found, str):
            return found
    if not constants.HF_HUB_OFFLINE:
        from clipdist.launch import unreachable

        reason = unreachable(constants.ENDPOINT)
        if reason:
            raise OSError(f"{constants.ENDPOINT} cannot be reached: {reason}")
    error = None
    for candidate in names:
        try:
            return hf_hub_download(repo, candidate, cache_dir=cache_dir)
        except Exception as failure:  # noqa: BLE001 -- the next name may exist; the last reason is reported
            error = failure
    raise error


def create_model(
    name: str = DEFAULT_MODEL,
    checkpoint: str | None = None,
    grad_checkpointing: bool = False,
    init_logit_scale: float | None = None,
    init_logit_bias: float | None = None,
    device: str = "cpu",
    pretrained: str | None = None,
    cache_dir: str | None = None,
) -> torch.nn.Module:
    """An open_clip CLIP model, randomly initialised unless weights are given.

    `name` is any open_clip model config (ours: clipdist-tiny, clipdist-timm-tiny), a config file, or
    `hf-hub:` / `local-dir:` (see resolve_model_name); those two bring their weights, as does a pretrained
    tag (`pretrained`, with its image preprocessing). `checkpoint` loads weights from a local file or folder
    instead (clipdist.weights.read_weights: nothing in it runs). Weights are fetched, where they must be, into open_clip's cache (`cache_dir`).
    `init_logit_scale` is the log of the initial scale; `init_logit_bias` gives the model a logit bias (SigLIP);
    a file's scalars replace them, except a bias the file does not have.
    """
    from open_clip.transform import merge_preprocess_dict

    name = resolve_model_name(name)
    tag = pretrained_cfg(name, pretrained)
    kwargs = {"device": device, "cache_dir": cache_dir}  # "meta": the structure alone, no memory (for checks)
    if init_logit_scale is not None:
        kwargs["init_logit_scale"] = init_logit_scale
    if init_logit_bias is not None:
        kwargs["init_logit_bias"] = init_logit_bias
    if tag:
        kwargs["force_preprocess_cfg"] = merge_preprocess_dict({}, tag)
    with _random_init_is_intended():
        model = open_clip.create_model(name, pretrained=None, load_weights=False, pretrained_image=False,
                                       pretrained_text=False, **kwargs)
    source = checkpoint
    if source is None and device != "meta":
        source = pretrained_weights(name, pretrained, cache_dir)
    if source is not None:
        model.load_state_dict(weights_for(model, read_weights(source), source))
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model


def weights_for(model: torch.nn.Module, weights: dict[str, torch.Tensor], source) -> dict[str, torch.Tensor]:
    """`weights` as `model` loads them strictly, or a ValueError naming the first tensor that does not fit.
    A model built for a loss with a logit bias (SigLIP) keeps its initial bias where the file has none; a file's
    bias is left out for a model without one (the softmax loss has no bias)."""
    weights = dict(weights)
    expected = model.state_dict()
    if "logit_bias" in expected and "logit_bias" not in weights:
        weights["logit_bias"] = expected["logit_bias"].detach().clone()
    if "logit_bias" not in expected:
        weights.pop("logit_bias", None)
    for key in ("logit_scale", "logit_bias"):  # 0-dim here, shape (1,) in some files
        if key in weights and key in expected and weights[key].numel() == 1:
            weights[key] = weights[key].reshape(expected[key].shape)
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected]
    wrong = [key for key in expected if key in weights and weights[key].shape != expected[key].shape]
    if wrong:
        key = wrong[0]
        raise ValueError(f"{source} does not fit the model: {key} is {tuple(weights[key].shape)} there, "
                         f"{tuple(expected[key].shape)} here ({len(wrong)} tensor(s) of another shape)")
    if missing or unexpected:
        first = f"{missing[0]} is missing" if missing else f"{unexpected[0]} is not in the model"
        raise ValueError(f"{source} does not fit the model: {first} ({len(missing)} missing, "
                         f"{len(unexpected)} unexpected)")
    return weights


def check_weights(model_cfg, loss_fn, init_logit_bias: float | None = None) -> None:
    """Before any rank starts: the weights the model starts from (model.checkpoint, model.pretrained, an `hf-hub:`
    or `local-dir:` model: fetched here into the cache, once) can be read and fit the model built for `loss_fn`
    (on the meta device: shapes only, no memory); a ValueError names the key and the first tensor that does not fit."""
    name, checkpoint = model_cfg.name, model_cfg.checkpoint
    if checkpoint is not None and (model_cfg.pretrained is not None or name.startswith(SCHEMAS)):
        raise ValueError(f"model.checkpoint and {'model.pretrained' if model_cfg.pretrained else 'model.name=' + name}"
                         " both give the starting weights: keep one")
    source = checkpoint or pretrained_weights(name, model_cfg.pretrained, model_cfg.cache_dir)
    if source is None:
        return
    what = f"model.checkpoint={checkpoint}" if checkpoint else \
        f"model.pretrained={model_cfg.pretrained}" if model_cfg.pretrained else f"model.name={name}"
    try:
        weights = read_weights(source)
    except ValueError as error:
        raise ValueError(f"{'model.checkpoint' if checkpoint else what}: {error}") from None
    model = create_model_for_loss(name, loss_fn, init_logit_bias=init_logit_bias, device="meta",
                                  pretrained=model_cfg.pretrained, cache_dir=model_cfg.cache_dir)
    weights_for(model, weights, what)


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


def get_tokenizer(name: str = DEFAULT_MODEL, cache_dir: str | None = None):
    """The model's tokenizer; the BPE vocabulary ships inside open_clip's wheel (a Hugging Face tokenizer
    is fetched into the cache)."""
    _register_model_configs()
    return open_clip.get_tokenizer(resolve_model_name(name), cache_dir=cache_dir)


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
