"""Image and text towers, built with open_clip's factory: random init, or the weights of a local file, an
open_clip pretrained tag, an `hf-hub:` or a `local-dir:` model."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
from open_clip import factory
from open_clip.convert import convert_state_dict
from open_clip.hf_model import HFTextEncoder
from open_clip.model import convert_to_custom_text_state_dict, resize_pos_embed, resize_text_pos_embed
from open_clip.transform import merge_preprocess_dict

from clipdist.checkpoint.weights import UnsafeFileError, own_file, read_small_json, read_weights
from clipdist.defaults import DEFAULT_MODEL
from clipdist.distributed.network import unreachable
from clipdist.distributed.parallel import node_leaders_first
from clipdist.errors import printable, words
from clipdist.model.timm_towers import (
    KWARGS_KEY,
    check_image_tower,
    check_tower_kwargs,
    naflex_patch_size,
    naflex_trunk,
    take_tower_kwargs,
    timm_tower,
    tower_settings,
)

CONFIG_DIR = Path(__file__).parents[1] / "model_configs"


@functools.cache
def _register_model_configs() -> None:
    """Make clipdist's own model configs (clipdist-tiny, clipdist-timm-tiny, clipdist-naflex-tiny) known to open_clip,
    once (a timm tower's keyword arguments kept apart: timm_towers)."""
    open_clip.add_model_config(CONFIG_DIR)
    for path in CONFIG_DIR.glob("*.json"):
        take_tower_kwargs(path.stem, factory._MODEL_CONFIGS[path.stem], str(path))


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


TOKENIZER_KWARGS = {
    "clean",
    "strip_sep_token",
}  # the tokenizer options open_clip's own configs use: nothing else passes
HF_NAMES = ("hf_tokenizer_name", "hf_model_name")
EXPORT_CONFIG = "open_clip_config.json"  # an open_clip hub-layout folder (local-dir:, clipdist export) holds these two
EXPORT_WEIGHTS = "open_clip_model.safetensors"  # text_cfg keys transformers loads with from_pretrained


@functools.cache
def _open_clips_own_hf_names() -> frozenset[str]:
    """The Hugging Face tokenizer and text-tower names open_clip's own (wheel-shipped) configs use."""
    configs = [open_clip.get_model_config(name) or {} for name in open_clip.list_models()]
    return frozenset(
        value for config in configs for key in HF_NAMES if (value := (config.get("text_cfg") or {}).get(key))
    )


def _remote_code_requests(node, path: str = "") -> list[str]:
    """Every key anywhere in a config that asks transformers to import code shipped with a model."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if "remote_code" in str(key) and value:
                found.append(f"{path}{key}")
            found += _remote_code_requests(value, f"{path}{key}.")
    elif isinstance(node, list):
        for item in node:
            found += _remote_code_requests(item, path)
    return found


def check_folder_is_its_own(folder: Path, where: str) -> None:
    """A tokenizer or model folder holds its own regular files: a link out of it, a FIFO or a device there is refused
    (UnsafeFileError) before transformers opens anything in it."""
    for entry in sorted(folder.iterdir())[:10_000]:
        if not (entry.is_file() or entry.is_dir()):  # through a link: what transformers would open
            raise UnsafeFileError(f"{where}: refused: not a regular file (a FIFO or a device): {str(entry)!r}")
        try:
            own_file(folder, entry)  # a link stays inside the folder (or a hub cache's snapshot -> blobs)
        except UnsafeFileError as error:
            raise UnsafeFileError(f"{where}: {error}") from None


def _check_hf_file(folder: Path, file: str, where: str) -> None:
    """A Hugging Face folder's config `file`: no file it names outside the folder, no auto_map (code to import)."""
    try:
        found = read_small_json(folder / file)
    except UnsafeFileError as error:  # a FIFO or /dev/zero would hang or fill transformers' reader
        raise UnsafeFileError(f"{where}: {error}") from None
    except (OSError, ValueError):  # none there, or not JSON: transformers reads no auto_map from it either
        return
    for name, named in found.items() if isinstance(found, dict) else ():
        if name.endswith("_file") and isinstance(named, str) and named:
            if not (folder / named).resolve().is_relative_to(folder.resolve()):
                raise UnsafeFileError(
                    f"{where}: refused: {str(folder / file)!r} names {name}={printable(named)[:80]!r}, a file "
                    "outside its folder"
                )
    if isinstance(found, dict) and "auto_map" in found:
        raise UnsafeFileError(
            f"{where}: refused: {str(folder / file)!r} has an auto_map, which makes "
            "transformers import the Python files it names"
        )


def check_config_is_data(model_cfg: dict, where: str) -> None:
    """A model config from a file (a config file, an export / local-dir folder, a hub repo, a run's saved name) is
    data: nothing in it may make a rank import code or reach the network on its own. Refused, one line
    (UnsafeFileError): any `trust_remote_code`; tokenizer options open_clip's own configs do not use; a Hugging Face
    tokenizer or text tower that is neither a name open_clip's own configs use nor a local folder without an
    `auto_map` (transformers imports the .py files an auto_map names); timm weights fetched for the image tower."""
    asked = _remote_code_requests(model_cfg)
    if asked:
        raise UnsafeFileError(
            f"{where}: refused: {asked[0]!r} asks to run code shipped with the model, which clipdist never does"
        )
    text = model_cfg.get("text_cfg") or {}
    unknown = sorted(set(text.get("tokenizer_kwargs") or {}) - TOKENIZER_KWARGS)
    if unknown:
        raise UnsafeFileError(
            f"{where}: refused: text_cfg.tokenizer_kwargs holds {unknown[0]!r}, not a tokenizer option "
            f"clipdist passes on (only {', '.join(sorted(TOKENIZER_KWARGS))})"
        )
    for key in HF_NAMES:
        value = text.get(key)
        if not value or value in _open_clips_own_hf_names():
            continue
        folder = Path(str(value)).expanduser()
        if not folder.is_dir():
            raise UnsafeFileError(
                f"{where}: refused: text_cfg.{key}={str(value)!r} is neither a local folder nor a name "
                "open_clip's own configs use: transformers would fetch it (and any code it names) "
                "from the hub; download it yourself and give the folder"
            )
        check_folder_is_its_own(folder, where)
        for file in ("tokenizer_config.json", "config.json"):
            _check_hf_file(folder, file, where)
    if KWARGS_KEY in (model_cfg.get("vision_cfg") or {}):
        check_tower_kwargs(model_cfg["vision_cfg"][KWARGS_KEY], where)
    named = (model_cfg.get("vision_cfg") or {}).get("timm_model_name")
    if isinstance(named, str) and named.startswith("hf-hub:"):
        raise UnsafeFileError(
            f"{where}: refused: vision_cfg.timm_model_name={printable(named)[:80]!r}: timm would fetch it from the hub "
            "when the model is built; a model config names local towers only"
        )
    if (model_cfg.get("vision_cfg") or {}).get("timm_model_pretrained"):
        raise UnsafeFileError(
            f"{where}: refused: vision_cfg.timm_model_pretrained fetches weights from the hub when "
            "the model is built; set model.pretrained_image=true to ask for them"
        )


def _read_model_config(path: Path, where: str) -> tuple[dict, dict]:
    """(model_cfg, preprocess_cfg) of a model config file — open_clip's model config, or its hub layout
    {"model_cfg", "preprocess_cfg"} (what `clipdist export` and open_clip write) — checked to be data
    (check_config_is_data); a ValueError in one line naming `where` otherwise."""
    try:
        config = read_small_json(path)
    except UnsafeFileError as error:
        raise UnsafeFileError(f"{where}: {error}") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: not a readable JSON model config ({error})") from None
    model_cfg = config.get("model_cfg", config) if isinstance(config, dict) else None
    if not isinstance(model_cfg, dict):
        raise ValueError(f"{where}: not an open_clip model config (a JSON object)")
    model_cfg = dict(model_cfg)
    preprocess = {**model_cfg.pop("preprocess_cfg", {}), **config.get("preprocess_cfg", {})}
    missing = [key for key in ("embed_dim", "vision_cfg", "text_cfg") if key not in model_cfg]
    if missing:
        raise ValueError(f"{where}: not an open_clip model config (no {', '.join(missing)})")
    check_config_is_data(model_cfg, where)
    return model_cfg, preprocess


@contextmanager
def hub_offline():
    """huggingface_hub answers from its cache alone inside (for a model a saved file names: no request leaves)."""
    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def resolve_model_name(name: str) -> str:
    """`name` as open_clip knows it (a ValueError says how to fix an unknown one). A path to a model
    config file (`my-vit.json`, open_clip's format: embed_dim, vision_cfg, text_cfg) is registered
    with open_clip under its file stem; `hf-hub:ORG/REPO` and `local-dir:PATH` pass through to open_clip
    (a local folder must hold open_clip_config.json, as `clipdist export` writes it)."""
    if name.startswith("local-dir:"):
        folder = Path(name.removeprefix("local-dir:")).expanduser()
        if not (folder / EXPORT_CONFIG).is_file():
            raise ValueError(
                f"model.name={name}: {folder} holds no open_clip_config.json (a folder in open_clip's "
                "hub layout, as `clipdist export` writes it)"
            )
        _read_model_config(folder / EXPORT_CONFIG, f"model.name={name}")
        return f"local-dir:{folder}"
    if name.startswith("hf-hub:"):
        return name
    if name.endswith(".json"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"model.name={name!r}: no such model config file")
        name = _register_config_file(path)
    if name not in model_names():
        raise ValueError(
            f"unknown model {name!r}; open_clip knows {len(model_names())} configs, e.g. "
            "clipdist-tiny, ViT-B-32, ViT-B-16, ViT-L-14, a config file (model.name=/path/to/my-vit.json), "
            "hf-hub:ORG/REPO or local-dir:PATH"
        )
    return name


_CONFIG_PREPROCESS: dict[str, dict] = {}  # image preprocessing a model config file carries (open_clip's preprocess_cfg)


def _register_config_file(path: Path) -> str:
    """Register a model config file (_read_model_config) with open_clip under its stem; a `preprocess_cfg` is kept
    apart and applied as the model's preprocessing (open_clip would pass it to the model's constructor)."""
    model_cfg, preprocess = _read_model_config(path, f"model.name={path}")
    take_tower_kwargs(path.stem, model_cfg, f"model.name={path}")
    factory._MODEL_CONFIGS[path.stem] = model_cfg  # what open_clip.add_model_config does, without the extra key
    _CONFIG_PREPROCESS[path.stem] = preprocess
    return path.stem


def _export_with_tower_kwargs(name: str) -> str:
    """The name open_clip builds `name` by: an export folder (`local-dir:`) whose config holds a timm tower's keyword
    arguments (a NaFlex tower's: open_clip 3.3 cannot read them) registered like a config file, under its path."""
    if not name.startswith("local-dir:"):
        return name
    path = Path(name.removeprefix("local-dir:")) / EXPORT_CONFIG
    model_cfg, preprocess = _read_model_config(path, f"model.name={name}")
    if KWARGS_KEY not in (model_cfg.get("vision_cfg") or {}):
        return name
    # a plain name (open_clip turns '/' into '-' and reads a schema's own way): one per folder
    key = "clipdist-export-" + hashlib.sha1(str(path.parent.resolve()).encode()).hexdigest()[:16]
    take_tower_kwargs(key, model_cfg, f"model.name={name}")
    factory._MODEL_CONFIGS[key] = model_cfg
    _CONFIG_PREPROCESS[key] = preprocess
    return key


MODEL_OVERRIDES = (
    "force_image_size",
    "force_context_length",
    "force_patch_dropout",
    "force_quick_gelu",
    "force_custom_text",
    "pretrained_image",
    "image_tower",
)
PREPROCESS_OVERRIDES = {
    "image_mean": "mean",
    "image_std": "std",
    "image_interpolation": "interpolation",
    "image_resize_mode": "resize_mode",
}


def model_overrides(model_cfg, fetch: bool = True) -> dict:
    """open_clip.create_model's keyword arguments for the per-run overrides of `model` config (model.force_*,
    model.pretrained_image) and the image preprocessing it sets (model.image_*: "preprocess"). fetch=False: the
    structure alone, timm's image-tower weights not fetched (checks, exports, a checkpoint's own weights)."""
    overrides = {
        key: value for key in MODEL_OVERRIDES if (value := getattr(model_cfg, key)) is not None and value is not False
    }  # 0.0 patch dropout counts
    if not fetch:
        overrides["pretrained_image"] = False
    preprocess = {
        field: value if not isinstance(value, list) else tuple(value)
        for key, field in PREPROCESS_OVERRIDES.items()
        if (value := getattr(model_cfg, key)) is not None
    }
    if preprocess:
        overrides["preprocess"] = {
            key: str(value) if key in ("interpolation", "resize_mode") else value for key, value in preprocess.items()
        }
    return overrides


def built_model_config(name: str, overrides: dict | None = None) -> dict:
    """open_clip's model config of `name` with `overrides` applied as open_clip.create_model applies them: the
    config of the model as built (what an export must carry)."""
    overrides = overrides or {}
    name = resolve_model_name(name)
    model_cfg = tower_settings(name, dict(open_clip.get_model_config(name)), overrides.get("image_tower"))
    model_cfg = {key: dict(value) if isinstance(value, dict) else value for key, value in model_cfg.items()}
    if overrides.get("force_quick_gelu"):
        model_cfg["quick_gelu"] = True
    if overrides.get("force_custom_text"):
        model_cfg["custom_text"] = True
    for key, tower, field in (
        ("force_patch_dropout", "vision_cfg", "patch_dropout"),
        ("force_image_size", "vision_cfg", "image_size"),
        ("force_context_length", "text_cfg", "context_length"),
    ):
        if overrides.get(key) is not None:
            model_cfg[tower][field] = overrides[key]
    return model_cfg


def lock_towers(model: Any, model_cfg) -> None:  # an open_clip model: its towers' methods are untyped
    """model.lock_image / model.lock_text with open_clip's own lock functions: the locked parameters stop
    requiring gradients (so they get no gradient, no optimizer state, and a fully locked tower no backward)."""
    if model_cfg.lock_image:
        model.lock_image_tower(
            unlocked_groups=model_cfg.lock_image_unlocked_groups, freeze_bn_stats=model_cfg.lock_image_freeze_bn_stats
        )
    if model_cfg.lock_text:
        model.lock_text_tower(
            unlocked_layers=model_cfg.lock_text_unlocked_layers, freeze_layer_norm=model_cfg.lock_text_freeze_layer_norm
        )


def is_captioning(name: str) -> bool | None:
    """Whether `name` is a CoCa model (open_clip's contrastive + captioning: a `multimodal_cfg`); None where the
    config comes with the weights (hf-hub:, local-dir:) and is known only once the model is built."""
    if name.startswith(SCHEMAS):
        return None
    return "multimodal_cfg" in (open_clip.get_model_config(resolve_model_name(name)) or {})


def has_caption_decoder(model: torch.nn.Module) -> bool:
    """Whether a built model is a CoCa model (a text decoder beside the towers)."""
    return getattr(model, "text_decoder", None) is not None


CAPTION_WEIGHT = 2.0  # open_clip_train's --coca-caption-loss-weight default


def caption_weight(loss_cfg, captions: bool, model_name: str) -> float:
    """The caption term's weight: 0 for a CLIP model, loss.caption_weight (default open_clip's 2) for a CoCa model
    (`captions`); a caption weight given for a model that does not caption is refused."""
    if captions:
        return CAPTION_WEIGHT if loss_cfg.caption_weight is None else loss_cfg.caption_weight
    if loss_cfg.caption_weight:
        raise ValueError(
            f"loss.caption_weight={loss_cfg.caption_weight}, but model.name={model_name} has no text "
            "decoder (a CoCa model config, e.g. coca_ViT-B-32, has one); remove the key or pick a CoCa model"
        )
    return 0.0


def check_loss_weights(loss_cfg, model_name: str) -> None:
    """Before any rank starts: weights not negative, something to minimise, a caption weight only for CoCa."""
    for key in ("contrastive_weight", "caption_weight"):
        if (getattr(loss_cfg, key) or 0) < 0:
            raise ValueError(f"loss.{key}={getattr(loss_cfg, key)}: a loss weight must be 0 or more")
    captioning = is_captioning(model_name)
    if captioning is None:  # hf-hub: / local-dir: — known once the model is built (Trainer: caption_weight)
        return
    if caption_weight(loss_cfg, captioning, model_name) == 0 and loss_cfg.contrastive_weight == 0:
        raise ValueError("loss.contrastive_weight=0 and no caption term: nothing to train")


def check_teacher(teacher: Any, student: Any, name: str) -> None:  # open_clip models
    """A distillation teacher sees the student's images and tokens: the same image size, context length and
    vocabulary."""
    for what, mine, theirs in (
        ("image size", student.visual.image_size, teacher.visual.image_size),
        ("context length", student.context_length, teacher.context_length),
    ):
        if tuple(np.atleast_1d(mine)) != tuple(np.atleast_1d(theirs)):
            raise ValueError(
                f"loss.distill.model={name}: its {what} is {theirs}, the student's {mine}; the teacher "
                f"is given the student's inputs (as open_clip_train does): pick a teacher with the same "
                f"{what}, or set model.force_image_size / model.force_context_length to match it"
            )
    vocabularies = [
        getattr(m, "vocab_size", None) or getattr(getattr(m, "text", None), "vocab_size", None)
        for m in (student, teacher)
    ]
    if None not in vocabularies and vocabularies[0] != vocabularies[1]:
        raise ValueError(
            f"loss.distill.model={name}: its vocabulary has {vocabularies[1]} tokens, the student's "
            f"{vocabularies[0]}: the teacher would read the student's token ids as other words"
        )


def check_model_options(model_cfg) -> None:
    """Before any rank starts: the overrides and locks fit the model (built on the meta device, no memory)."""
    if model_cfg.force_patch_dropout is not None and not 0 <= model_cfg.force_patch_dropout < 1:
        raise ValueError(f"model.force_patch_dropout={model_cfg.force_patch_dropout}: must be in [0, 1)")
    for key in ("force_image_size", "force_context_length"):
        if getattr(model_cfg, key) is not None and getattr(model_cfg, key) < 1:
            raise ValueError(f"model.{key}={getattr(model_cfg, key)}: must be at least 1")
    for key in ("lock_image_unlocked_groups", "lock_text_unlocked_layers"):
        if getattr(model_cfg, key) < 0:
            raise ValueError(f"model.{key}={getattr(model_cfg, key)}: must be 0 or more")
    if model_cfg.image_tower is not None:
        check_image_tower(
            model_cfg.image_tower,
            model_cfg.name,
            None
            if model_cfg.name.startswith(SCHEMAS)
            else open_clip.get_model_config(resolve_model_name(model_cfg.name)),
        )
    if not (model_cfg.lock_image or model_cfg.lock_text or model_cfg.pretrained_image or model_cfg.image_tower):
        return
    model = create_model(model_cfg.name, device="meta", overrides=model_overrides(model_cfg, fetch=False))
    if model_cfg.pretrained_image and type(model.visual).__name__ != "TimmModel":
        raise ValueError(
            f"model.pretrained_image=true starts a timm image tower from timm's weights, but "
            f"{model_cfg.name}'s image tower is {type(model.visual).__name__} (use a timm tower, e.g. "
            "model=timm_tiny, or model.pretrained / model.checkpoint for the whole model)"
        )
    if model_cfg.lock_text and not model_cfg.lock_text_freeze_layer_norm:
        text = getattr(model, "text", None)
        if not isinstance(text, HFTextEncoder):
            raise ValueError(
                "model.lock_text_freeze_layer_norm=false: open_clip's own text towers lock their "
                "LayerNorms with their layers (only Hugging Face text towers can leave them unlocked); "
                "leave it true"
            )
    try:
        lock_towers(model, model_cfg)
    except (AssertionError, ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"model.lock_image/lock_text on {model_cfg.name}: {error or type(error).__name__}") from None


def pretrained_cfg(name: str, pretrained: str | None) -> dict:
    """open_clip's entry for pretrained tag `pretrained` of model `name` ({} for none); a ValueError lists the tags."""
    if pretrained is None:
        return {}
    if name.startswith(SCHEMAS):
        raise ValueError(
            f"model.pretrained={pretrained} is for open_clip's built-in models; {name} brings its own "
            "weights: leave model.pretrained unset"
        )
    found = open_clip.get_pretrained_cfg(name, pretrained)
    if not found:
        tags = open_clip.list_pretrained_tags_by_model(name)
        raise ValueError(
            f"model.pretrained={pretrained}: open_clip has no such tag for {name} "
            f"({'its tags: ' + ', '.join(tags) if tags else 'it has no pretrained weights'})"
        )
    return found


def fetches_weights(name: str, pretrained: str | None, pretrained_image: bool = False) -> bool:
    """Whether the starting weights come over the network into a cache (a pretrained tag, an `hf-hub:` model, a
    timm image tower's own weights)."""
    return pretrained is not None or name.startswith("hf-hub:") or pretrained_image


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
    return _hub_file(repo, _weights_names(filename or "open_clip_pytorch_model.bin"), cache_dir, what)


def _weights_names(filename: str) -> list[str]:
    """The names a weights file of a hub repo may have, as open_clip names them (its safetensors twin first)."""
    names = (
        [EXPORT_WEIGHTS]
        if filename == "open_clip_pytorch_model.bin"
        else [filename[:-4] + ".safetensors"]
        if filename.endswith((".bin", ".pth"))
        else []
    )
    return [*names, filename]


def _hub_file(
    repo: str,
    names: list[str],
    cache_dir: str | None,
    what: str,
    thing: str = "the weights are",
    otherwise: str = ", or point model.checkpoint at the file",
) -> str:
    """The first of `names` in Hugging Face repo `repo`: from the cache without touching the network where it is
    there, else downloaded — after a quick check that the hub can be reached at all, since the hub's client retries
    an unreachable one for about a minute. A ValueError in one line (`what`: the key that named it) where it can be
    neither found nor fetched."""
    for candidate in names:
        found = try_to_load_from_cache(repo, candidate, cache_dir=cache_dir)
        if isinstance(found, str):
            return found
    try:
        if not constants.HF_HUB_OFFLINE:
            reason = unreachable(constants.ENDPOINT)
            if reason:
                raise OSError(f"{constants.ENDPOINT} cannot be reached: {reason}")
        error: Exception = FileNotFoundError(f"{repo}: none of {', '.join(names)}")
        for candidate in names:
            try:
                return hf_hub_download(repo, candidate, cache_dir=cache_dir)
            except Exception as failure:  # noqa: BLE001 -- the next name may exist; the last reason is reported
                error = failure
        raise error
    except Exception as error:  # noqa: BLE001 -- offline, not cached, no such repo: the reason is the message
        reason = words(error)
        raise ValueError(
            f"{what}: {thing} not in the cache ({cache_dir or 'HF_HOME, ~/.cache/huggingface'}) and "
            f"cannot be fetched from here ({reason}); fetch them once where there is network (the same command, or "
            f"`hf download {repo}`; huggingface_hub before 0.34: `huggingface-cli download {repo}`) into a cache "
            f"this machine reads (HF_HOME, model.cache_dir){otherwise}"
        ) from None


def _init_caption_decoder(decoder: Any) -> None:  # open_clip's MultimodalTransformer
    """What open_clip's MultimodalTransformer.init_parameters means to do. open_clip 3.3 never calls it, and it
    could not run (it reads `self.transformer`, which the decoder is): a CoCa model built from scratch keeps
    `text_projection` as torch.empty left it — other values on every rank, at times 1e30 (found by gradcheck)."""
    width, layers = decoder.width, decoder.layers
    attn_std, proj_std, fc_std = width**-0.5, width**-0.5 * (2 * layers) ** -0.5, (2 * width) ** -0.5
    with torch.no_grad():
        for block in [*decoder.resblocks, *decoder.cross_attn]:
            torch.nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
            torch.nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            torch.nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            torch.nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        if decoder.text_projection is not None:
            torch.nn.init.normal_(decoder.text_projection, std=width**-0.5)


def create_model(
    name: str = DEFAULT_MODEL,
    checkpoint: str | None = None,
    grad_checkpointing: bool = False,
    init_logit_scale: float | None = None,
    init_logit_bias: float | None = None,
    device: str = "cpu",
    pretrained: str | None = None,
    cache_dir: str | None = None,
    overrides: dict | None = None,
) -> torch.nn.Module:
    """An open_clip CLIP model, randomly initialised unless weights are given.

    `name` is any open_clip model config (ours: clipdist-tiny, clipdist-timm-tiny), a config file, or
    `hf-hub:` / `local-dir:` (see resolve_model_name); those two bring their weights, as does a pretrained
    tag (`pretrained`, with its image preprocessing). `checkpoint` loads weights from a local file or folder
    instead (clipdist.checkpoint.weights.read_weights: nothing in it runs). Weights are fetched, where they must be,
    into open_clip's cache (`cache_dir`).
    `init_logit_scale` is the log of the initial scale; `init_logit_bias` gives the model a logit bias (SigLIP);
    a file's scalars replace them, except a bias the file does not have. `overrides`: open_clip.create_model's
    force_* / pretrained_image arguments and the image preprocessing ("preprocess"), as model_overrides makes them.
    """
    name = resolve_model_name(name)
    hub = name.startswith("hf-hub:")
    if hub:  # the repo's config, fetched once (then open_clip reads it from the cache), checked before it builds
        repo = name.removeprefix("hf-hub:")
        _hub_file(repo, [EXPORT_CONFIG], cache_dir, f"model.name={name}", f"its {EXPORT_CONFIG} is")
        with hub_offline():
            check_config_is_data(factory._get_hf_config(repo, cache_dir=cache_dir).get("model_cfg", {}), name)
    tag = pretrained_cfg(name, pretrained)
    # device "meta": the structure alone, no memory (for checks)
    kwargs: dict[str, Any] = {"device": device, "cache_dir": cache_dir}
    if init_logit_scale is not None:
        kwargs["init_logit_scale"] = init_logit_scale
    if init_logit_bias is not None:
        kwargs["init_logit_bias"] = init_logit_bias
    overrides = dict(overrides or {})
    build = _export_with_tower_kwargs(name)
    preprocess = merge_preprocess_dict(_CONFIG_PREPROCESS.get(build, {}), tag)  # open_clip's order: config, tag, run
    preprocess = merge_preprocess_dict(preprocess, overrides.pop("preprocess", {}))
    if preprocess:
        kwargs["force_preprocess_cfg"] = preprocess
    overrides.setdefault("pretrained_image", False)
    offline = hub_offline() if hub else contextlib.nullcontext()
    # "meta": every tensor made there (open_clip builds on the CPU, then moves: a ViT-L/14's init cost 3.4 s, 0.07 s)
    place = torch.device("meta") if device == "meta" else contextlib.nullcontext()
    with _random_init_is_intended(), timm_tower(build, overrides.pop("image_tower", None)), offline, place:
        model = open_clip.create_model(
            build, pretrained=None, load_weights=False, pretrained_text=False, **kwargs, **overrides
        )
    if has_caption_decoder(model) and device != "meta":
        _init_caption_decoder(model.text_decoder)
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
    Converted first as open_clip's load_checkpoint converts them (_as_open_clip_loads). A model built for a loss
    with a logit bias (SigLIP) keeps its initial bias (−10) where the file has none — open_clip_train sets 0
    there (docs/migrating.md, defaults that differ); a file's bias is left out for a model without one (the
    softmax loss has no bias)."""
    expected = model.state_dict()
    weights = _as_open_clip_loads(model, dict(weights), expected)
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
        raise ValueError(
            f"{source} does not fit the model: {key} is {tuple(weights[key].shape)} there, "
            f"{tuple(expected[key].shape)} here ({len(wrong)} tensor(s) of another shape)"
        )
    if missing or unexpected:
        first = f"{missing[0]} is missing" if missing else f"{unexpected[0]} is not in the model"
        raise ValueError(
            f"{source} does not fit the model: {first} ({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    return weights


def _as_open_clip_loads(model: torch.nn.Module, weights: dict, expected: dict) -> dict:
    """What open_clip's load_checkpoint does to a file's weights before loading them (factory.py), with its own
    functions: third-party layouts converted, a standard text tower's keys moved for a custom one
    (model.force_custom_text), position embeddings resized to the model's image grid and context length
    (model.force_image_size, model.force_context_length). Weights it cannot resize are left for the shape check."""
    weights = convert_state_dict(model, weights)
    if "positional_embedding" in weights and "positional_embedding" not in expected:
        weights = convert_to_custom_text_state_dict(weights)
    if "text.transformer.embeddings.position_ids" not in expected:
        weights.pop("text.transformer.embeddings.position_ids", None)
    try:
        resize_pos_embed(weights, model)
        resize_text_pos_embed(weights, model)
    except (AssertionError, RuntimeError, ValueError, AttributeError):
        pass  # not a grid or a width open_clip can resize: the shape check names the tensor
    return weights


def check_weights(model_cfg, loss_fn, init_logit_bias: float | None = None) -> None:
    """Before any rank starts: the weights the model starts from (model.checkpoint, model.pretrained, an `hf-hub:`
    or `local-dir:` model: fetched here into the cache, once) can be read and fit the model built for `loss_fn`
    (on the meta device: shapes only, no memory); a ValueError names the key and the first tensor that does not fit."""
    name, checkpoint = model_cfg.name, model_cfg.checkpoint
    if checkpoint is not None and (model_cfg.pretrained is not None or name.startswith(SCHEMAS)):
        raise ValueError(
            f"model.checkpoint and {'model.pretrained' if model_cfg.pretrained else 'model.name=' + name}"
            " both give the starting weights: keep one"
        )
    source = checkpoint or pretrained_weights(name, model_cfg.pretrained, model_cfg.cache_dir)
    if source is None:
        return
    overrides = model_overrides(model_cfg, fetch=False)
    what = (
        f"model.checkpoint={checkpoint}"
        if checkpoint
        else f"model.pretrained={model_cfg.pretrained}"
        if model_cfg.pretrained
        else f"model.name={name}"
    )
    try:
        weights = read_weights(source)
    except ValueError as error:
        raise ValueError(f"{'model.checkpoint' if checkpoint else what}: {error}") from None
    model = create_model_for_loss(
        name,
        loss_fn,
        init_logit_bias=init_logit_bias,
        device="meta",
        pretrained=model_cfg.pretrained,
        cache_dir=model_cfg.cache_dir,
        overrides=overrides,
    )
    weights_for(model, weights, what)


def check_logit_bias(model: torch.nn.Module, loss_fn, loss: str, model_name: str) -> None:
    """A model whose config gives it a logit bias (SigLIP's `init_logit_bias`) with a loss that takes none (a softmax
    backend; `loss` as the user named it): a ValueError saying so, before any rank builds it."""
    if getattr(model, "logit_bias", None) is not None and not getattr(loss_fn, "uses_logit_bias", False):
        raise ValueError(
            f"{loss}: model {model_name} has a logit bias (its config's init_logit_bias, for SigLIP's "
            "sigmoid loss), which this softmax loss has no use for; use loss=siglip, or a model config without "
            "init_logit_bias"
        )


def create_model_for_loss(
    name: str, loss_fn, init_logit_scale: float | None = None, init_logit_bias: float | None = None, **options
) -> torch.nn.Module:
    """`create_model` with the scalars `loss_fn` needs: a logit bias only if it uses one, and its
    initial values (SigLIP: scale 10, bias −10) wherever the caller gives none."""
    if init_logit_scale is None:
        init_logit_scale = getattr(loss_fn, "init_logit_scale", None)
    if getattr(loss_fn, "uses_logit_bias", False):
        init_logit_bias = loss_fn.init_logit_bias if init_logit_bias is None else init_logit_bias
    else:
        init_logit_bias = None
    return create_model(name, init_logit_scale=init_logit_scale, init_logit_bias=init_logit_bias, **options)


def create_run_model(
    model_cfg, loss_cfg, loss_fn, device: torch.device, dtype: torch.dtype | None, local_rank: int = 0
) -> tuple[torch.nn.Module, BoundedTokenizer]:
    """A run's model (model and loss sections: starting weights, overrides, scalars, locked towers) on `device` in
    `dtype`, and its tokenizer; weights a hub serves fetched by one rank a node first."""
    needed = fetches_weights(model_cfg.name, model_cfg.pretrained, model_cfg.pretrained_image)
    with node_leaders_first(local_rank, needed=needed):
        model = create_model_for_loss(
            model_cfg.name,
            loss_fn,
            init_logit_scale=loss_cfg.init_logit_scale,
            init_logit_bias=loss_cfg.init_logit_bias,
            checkpoint=model_cfg.checkpoint,
            grad_checkpointing=model_cfg.grad_checkpointing,
            pretrained=model_cfg.pretrained,
            cache_dir=model_cfg.cache_dir,
            overrides=model_overrides(model_cfg),
        ).to(device, dtype)
        tokenizer = get_tokenizer(model_cfg.name, model_cfg.cache_dir, model_cfg.force_context_length)
    lock_towers(model, model_cfg)
    return model, tokenizer


def get_tokenizer(name: str = DEFAULT_MODEL, cache_dir: str | None = None, context_length: int | None = None):
    """The model's tokenizer, its tokens `context_length` long where given (model.force_context_length, as
    open_clip_train passes --force-context-length); the BPE vocabulary ships inside open_clip's wheel (a Hugging
    Face tokenizer is fetched into the cache)."""
    _register_model_configs()
    resolved = resolve_model_name(name)
    registered = resolved in _CONFIG_PREPROCESS  # a config file or an export clipdist registered
    text = (factory._MODEL_CONFIGS.get(resolved) or {}).get("text_cfg") or {} if registered else {}
    if registered and not text.get("hf_tokenizer_name"):
        # a config file's tokenizer is what its data says: open_clip would pick one by the name (a file called
        # my-siglip.json: SigLIP's Gemma tokenizer, fetched from the network)
        length = context_length or text.get("context_length", open_clip.tokenizer.DEFAULT_CONTEXT_LENGTH)
        return BoundedTokenizer(
            open_clip.SimpleTokenizer(context_length=length, **(text.get("tokenizer_kwargs") or {}))
        )
    tokenizer = open_clip.get_tokenizer(resolved, cache_dir=cache_dir, context_length=context_length)
    return BoundedTokenizer(tokenizer)


def check_tokenizer(model_cfg) -> None:
    """Before any rank starts: a model whose tokenizer comes from the Hugging Face hub (SigLIP 2's Gemma tokenizer:
    its text_cfg's hf_tokenizer_name) has it in the cache, fetched here once where it is not; a ValueError in one
    line says how to get it where it cannot be (offline, unreachable: the hub's client would retry for a minute)."""
    resolved = resolve_model_name(model_cfg.name)
    repo = ((open_clip.get_model_config(resolved) or {}).get("text_cfg") or {}).get("hf_tokenizer_name")
    if not repo or resolved in _CONFIG_PREPROCESS:  # a config file's tokenizer is open_clip's BPE (get_tokenizer)
        return
    cache_dir = model_cfg.cache_dir
    _hub_file(
        repo, ["tokenizer_config.json"], cache_dir, f"model.name={model_cfg.name}", f"its tokenizer ({repo}) is", ""
    )
    get_tokenizer(model_cfg.name, cache_dir=cache_dir)  # its other files, into the same cache


CHARS_PER_TOKEN_BOUND = 32  # a caption is cut at context × this many characters: far more than its tokens need
WORD_BOUND = 256  # and each run of non-space characters at this many: BPE's cost grows steeply with a word's length


def bound_text(text: str, context_length: int) -> str:
    """`text` cut to what can reach the tokens: whitespace runs collapsed (as the tokenizer's cleaning does), each
    word cut at WORD_BOUND characters, the whole at context × CHARS_PER_TOKEN_BOUND. A 1 MB single-word caption
    costs BPE minutes (8,000 random letters: 2 s; 2,464: 0.3 s); any real caption's first `context_length` tokens
    come from far fewer characters, so they are unchanged."""
    limit = context_length * CHARS_PER_TOKEN_BOUND
    if len(text) <= WORD_BOUND:
        return text
    words = text[: limit * 4].split()
    return " ".join(word[:WORD_BOUND] for word in words)[:limit]


def base_tokenizer(tokenizer):
    """open_clip's own tokenizer inside a BoundedTokenizer (for what reads its vocabulary: the transformers export)."""
    return tokenizer.tokenizer if isinstance(tokenizer, BoundedTokenizer) else tokenizer


class BoundedTokenizer:
    """An open_clip tokenizer whose every text is bound_text'ed first (training, evaluation, zero-shot prompts);
    everything else (context_length, vocabulary, decode) is the tokenizer's own."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, texts, *args, **kwargs):
        length = kwargs.get("context_length") or getattr(self.tokenizer, "context_length", 77)
        if isinstance(texts, str):
            texts = [texts]
        return self.tokenizer([bound_text(text, length) for text in texts], *args, **kwargs)

    def __getattr__(self, name: str):
        if name == "tokenizer" or name.startswith("__"):  # unpickling (a loader worker) asks before __init__ ran
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def image_size(model: Any) -> tuple[int, int]:  # an open_clip model
    """(height, width) of the images the model's image tower takes (open_clip gives an int for a square)."""
    size = model.visual.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def image_width(model: Any) -> int:  # an open_clip model
    """The width of the image tower's tokens: open_clip's ViT's, or a timm trunk's (a NaFlex tower's too); 0 for a
    tower with neither (a ResNet)."""
    visual = model.visual
    width = getattr(getattr(visual, "transformer", None), "width", None)
    return int(width or getattr(getattr(visual, "trunk", None), "embed_dim", None) or 0)


def text_shape(model: Any) -> tuple[int, int, int] | None:  # an open_clip model
    """(layers, width, heads) of the model's text transformer — open_clip's, CLIP's `transformer` or CustomTextCLIP's
    `text.transformer` — or None for another text tower (a Hugging Face one)."""
    text = getattr(model, "text", None)
    transformer: Any = getattr(text, "transformer", None) if text is not None else getattr(model, "transformer", None)
    blocks = getattr(transformer, "resblocks", None)
    if not blocks:
        return None
    return len(blocks), int(transformer.width), int(blocks[0].attn.num_heads)


def blank_images(model: torch.nn.Module, rows: int):
    """Zeros of the model's image input for `rows` samples (a NaFlex tower's: one valid patch each)."""
    if naflex_trunk(model) is None:
        return torch.zeros(rows, 3, *image_size(model))
    # drawn from no generator: a stopped step's stand-in must leave the RNG the checkpoint saves as it was
    patch = naflex_patch_size(model)
    return {
        "patches": torch.zeros(rows, 1, patch * patch * 3),
        "patch_coord": torch.zeros(rows, 1, 2, dtype=torch.long),
        "patch_valid": torch.ones(rows, 1, dtype=torch.bool),
    }


def random_tokens(batch: int, context_length: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Rows of random BPE ids in open_clip's layout: start-of-text, words, end-of-text, zero padding."""
    tokenizer = open_clip.tokenizer._tokenizer  # the shared SimpleTokenizer: its vocabulary and special ids
    words = torch.randint(0, tokenizer.sot_token_id, (batch, context_length), generator=generator)
    ends = torch.randint(2, context_length, (batch,), generator=generator)
    words[:, 0] = tokenizer.sot_token_id
    for row, end in enumerate(ends.tolist()):
        words[row, end] = tokenizer.eot_token_id
        words[row, end + 1 :] = 0
    return words
