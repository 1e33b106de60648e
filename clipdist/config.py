"""Typed schema of the Hydra config, and every check a config must pass before any rank starts.

clipdist/conf/ holds the menu (model/, data/, loss/, world/, optim/, logging/); these
dataclasses say which keys exist, what type each value has and, for enumerated choices,
which values are allowed — so a typo in a key or a choice is an error at composition, not a
silent default or a crash inside a spawned rank. Each loss backend with options has its own
schema (`loss=tiled` → TiledLossConfig with `tile`). `validate` checks what types cannot.
"""

from __future__ import annotations

import ast
import difflib
import functools
import io
import math
import sys
import tokenize
import types
import typing
from dataclasses import MISSING as MISSING_FIELD
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, cast

from hydra._internal.config_repository import ConfigRepository
from hydra._internal.utils import create_config_search_path
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import MISSING, BooleanNode, DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, ValidationError

from clipdist import hydra_policy
from clipdist.defaults import (  # noqa: F401 -- WARN: re-exported for the checks
    COLLECTIVE_TIMEOUT_S,
    DEFAULT_MODEL,
    DEFAULT_TILE,
    FREE,
    REFUSE,
    WARN,
    above_zero,
    non_negative,
    positive,
    seed_field,
)
from clipdist.errors import ConfigError, printable
from clipdist.files import read_bounded
from clipdist.registry import left_out
from clipdist.registry.kinds import KINDS
from clipdist.registry.losses import BACKENDS, LossSpec
from clipdist.registry.schedules import SCHEDULES
from clipdist.registry.terms import TERMS, TermOptions, first_step

# What a resume may change, per key (checkpoint.check_resume): REFUSE a change that makes another model, optimizer state
# or objective; WARN one that resumes the same state differently (numerics, schedule, what an image is). A section
# whose keys make the run's state (model, optim, loss) gives every field its rule in RESUME, and a unit test holds it
# to that, so a new key cannot slip through; every key of the other sections (data, world, logging, ...) is free:
# the stream continues or restarts with a line saying why, the world size and batch may change.


def resume_rule(key: str, loss_schemas=None) -> str:
    """The rule for a dotted key of TrainConfig (`loss.tile` looked up in every loss schema); free for a key no
    schema has (one a newer or older clipdist wrote)."""
    owners = [TrainConfig]
    *sections, name = key.split(".")
    for section in sections:
        nested = [
            f.default_factory
            for owner in owners
            for f in fields(owner)
            if f.name == section and is_dataclass(f.default_factory)
        ]
        owners = nested + ([*(loss_schemas or LOSS_SCHEMAS).values()] if section == "loss" else [])
        if not nested:
            return FREE
    return next((owner.RESUME[name] for owner in owners if name in getattr(owner, "RESUME", {})), FREE)


class Choice(str, Enum):
    """An enumerated config value; compares equal to its name ("bf16" == Precision.bf16)."""

    def __str__(self) -> str:
        return self.value


class Precision(Choice):
    auto = "auto"  # bf16 autocast on CUDA, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"  # bf16 autocast, fp32 weights (open_clip's amp_bf16)
    fp16 = "fp16"  # fp16 autocast, fp32 weights, gradients scaled (GradScaler; open_clip's amp)
    pure_bf16 = "pure_bf16"  # weights, activations and gradients in bf16 (open_clip's pure_bf16)
    pure_fp16 = "pure_fp16"  # weights, activations and gradients in fp16, no scaler (open_clip's pure_fp16)
    amp = "amp"  # open_clip's spelling of fp16 (read as fp16)
    amp_bf16 = "amp_bf16"  # open_clip's spelling of bf16 (read as bf16)
    amp_bfloat16 = "amp_bfloat16"  # open_clip's other spelling of bf16 (read as bf16)


# open_clip_train's --precision names that mean one of ours; its bf16 / fp16 (weights in that dtype) are nearest our
# pure_bf16 / pure_fp16, since our bf16 / fp16 are autocast (docs/migrating.md)
PRECISION_ALIASES = {"amp": "fp16", "amp_bf16": "bf16", "amp_bfloat16": "bf16"}


class CompileMode(Choice):
    """torch.compile's mode for the towers (model.compile_mode)."""

    default = "default"  # inductor's fused kernels
    reduce_overhead = "reduce-overhead"  # and CUDA graphs where shapes are fixed: one launch replays a graph (CUDA)
    max_autotune = "max-autotune"  # and the fastest matmul kernels searched for (a longer first compile)


class Interpolation(Choice):
    bicubic = "bicubic"
    bilinear = "bilinear"
    random = "random"  # bilinear or bicubic, drawn per image (training only; open_clip's 'random')


class ResizeMode(Choice):
    shortest = "shortest"  # resize the shorter side, then centre crop (evaluation)
    longest = "longest"  # resize the longer side, then pad
    squash = "squash"  # resize both sides, aspect ratio not kept


class Device(Choice):
    auto = "auto"  # cuda if one is visible, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Backend(Choice):
    auto = "auto"  # nccl on cuda, else gloo
    gloo = "gloo"
    nccl = "nccl"


class Parallel(Choice):
    ddp = "ddp"  # every rank holds the whole model, gradients and AdamW state; gradients all-reduced
    fsdp = "fsdp"  # FSDP2: parameters, gradients and AdamW state sharded over ranks (fully_shard per block)


class RetrievalTies(Choice):
    pessimistic = "pessimistic"  # a caption tied with other images' counts against the image (never a free hit)
    open_clip = "open_clip"  # open_clip_train's rule: ties in argsort's order (one caption per image)


class Split(Choice):
    node = "node"  # shards split over ranks and loader workers
    replicated = "replicated"  # every rank reads the same samples and keeps its slice of the global batch


class WorkerPriority(Choice):
    normal = "normal"  # the workers compete with the ranks for CPU time as equals
    low = "low"  # SCHED_IDLE: the workers run in the time the ranks wait (collectives, the data queue)


class NormalizeOn(Choice):
    auto = "auto"  # device: fewer bytes handed over, the floats made in memory the rank reuses
    loader = "loader"  # the workers make normalized float32 batches
    device = "device"  # the workers make uint8 batches; the rank normalizes them on its device after the copy


class DecodeOn(Choice):
    host = "host"  # the workers decode, crop and resize (PIL, libjpeg-turbo at the DCT scale the crop needs)
    device = "device"  # the workers draw the crop and hand over the JPEG's bytes; the rank decodes on its device


class OnCheckpointError(Choice):
    stop = "stop"  # one line naming the path and the OS error, then a clean stop (exit 1)
    warn = "warn"  # the same line as a warning; training goes on and the next save tries again


class WandbMode(Choice):
    offline = "offline"  # no key, no network; `wandb sync` later
    online = "online"
    disabled = "disabled"


@dataclass
class ModelConfig:
    RESUME: ClassVar[dict] = {
        "name": REFUSE,
        "force_image_size": REFUSE,
        "force_context_length": REFUSE,
        "force_quick_gelu": REFUSE,
        "force_custom_text": REFUSE,
        "image_tower": REFUSE,  # the architecture: shapes, activations, classes
        "lock_image": REFUSE,
        "lock_image_unlocked_groups": REFUSE,
        "lock_text": REFUSE,
        "lock_text_unlocked_layers": REFUSE,
        "lock_text_freeze_layer_norm": REFUSE,  # which parameters train
        "force_patch_dropout": WARN,  # FLIP-style training switches patch dropout off for its last steps this way
        "image_mean": WARN,
        "image_std": WARN,
        "image_interpolation": WARN,
        "image_resize_mode": WARN,
        "lock_image_freeze_bn_stats": WARN,
        "pretrained": FREE,
        "checkpoint": FREE,
        "pretrained_image": FREE,  # starting weights: the checkpoint's win
        "cache_dir": FREE,
        "grad_checkpointing": FREE,
        "compile": FREE,
        "compile_mode": FREE,
    }
    # Any open_clip model config (random init), a config file, or hf-hub:ORG/REPO / local-dir:PATH (with weights).
    name: str = DEFAULT_MODEL
    pretrained: str | None = None  # an open_clip pretrained tag of `name` (laion2b_s34b_b79k, openai, ...)
    checkpoint: str | None = None  # weights to start from: an open_clip file, an export folder, a clipdist checkpoint
    cache_dir: str | None = None  # where downloaded weights go (default: Hugging Face's cache, HF_HOME)
    grad_checkpointing: bool = False  # recompute each block's activations in backward (less memory, ~30% more compute)
    # torch.compile the towers (before DDP wraps them); null: on a CUDA device for a run of 300 steps or more on a
    # fixed-size tower, off on a CPU (train.parts.compile_decision); its caches in <run_dir>/compile_cache
    compile: bool | None = None
    compile_mode: CompileMode = CompileMode.default  # torch.compile's mode where it compiles (reduce_overhead, ...)
    # Locked towers (LiT, fine-tuning): open_clip's own lock functions; a locked parameter gets no gradient.
    lock_image: bool = False  # freeze the image tower
    lock_image_unlocked_groups: int = 0  # ... but its last N layer groups (open_clip's groups) still train
    lock_image_freeze_bn_stats: bool = False  # BatchNorm running statistics of locked layers frozen too
    lock_text: bool = False  # freeze the text tower
    lock_text_unlocked_layers: int = 0  # ... but its last N layers still train
    lock_text_freeze_layer_norm: bool = True  # false: the LayerNorms of locked layers still train (HF text towers)
    # Per-run changes to the model config (no JSON needed), as open_clip's --force-* flags:
    force_image_size: int | None = None
    # text tokens per caption; null: the model's own (open_clip's --force-context-length)
    force_context_length: int | None = None
    force_patch_dropout: float | None = None  # fraction of image patches dropped in training (FLIP); 0: none
    force_quick_gelu: bool = False  # QuickGELU activations (OpenAI's pretrained weights need them)
    force_custom_text: bool = False  # the text tower as a separate module (CustomTextCLIP)
    image_tower: str | None = None  # a timm model in the place of the config's timm image tower (any NaFlex name)
    pretrained_image: bool = False  # a timm image tower starts from timm's ImageNet weights (fetched into the cache)
    # Image preprocessing for training and evaluation; null: the model config's (or its pretrained tag's)
    image_mean: list[float] | None = None
    image_std: list[float] | None = None  # per-channel std for normalisation; null: the model's own
    image_interpolation: Interpolation | None = None  # resize interpolation; null: the model's own
    image_resize_mode: ResizeMode | None = None  # how an image meets the tower's size; null: the model's own


@dataclass
class AugmentationConfig:
    """Training-image augmentation, open_clip's AugmentationCfg field for field (open_clip.transform)."""

    scale: list[float] = field(default_factory=lambda: [0.9, 1.0])  # random resized crop: area fraction range
    ratio: list[float] | None = None  # crop aspect-ratio range; null: [3/4, 4/3]
    color_jitter: list[float] | None = None  # brightness, contrast, saturation[, hue]
    color_jitter_prob: float | None = None  # with gray_scale_prob: SimCLR-style jitter applied with this probability
    gray_scale_prob: float | None = None  # probability of a grey-scale image; null: none
    re_prob: float | None = None  # random erasing probability (with use_timm)
    re_count: int | None = None  # random-erasing regions per image; null: timm's default
    use_timm: bool = False  # timm's create_transform (RandAugment-style pipelines, random erasing)


def model_config(settings: dict) -> ModelConfig:
    """A ModelConfig from a saved run's `model` section (as_dict): keys it predates take their defaults, keys this
    version no longer has are left out."""
    known = {key: value for key, value in settings.items() if key in ModelConfig.__dataclass_fields__}
    return cast(ModelConfig, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), known)))


def _with_sections(specs, rule: str | None = None):
    """A schema decorator: a section `<name>` per registered spec that takes options (its options dataclass: a data
    kind's, a loss term's, an lr schedule's), with the resume rule `rule` where the schema has rules (each key's own:
    the section's RESUME)."""

    def add(schema: type) -> type:
        for spec in specs.values():
            if spec.options is not None:
                schema.__annotations__[spec.name] = spec.options
                setattr(schema, spec.name, field(default_factory=spec.options))
                if rule is not None:
                    schema.RESUME[spec.name] = rule  # type: ignore[attr-defined]
        return schema

    return add


RAW_FILE_SOURCES = ("fashion_mnist",)  # the built-in sources made from files in data.source_dir (data/builtin.py)


@dataclass
@_with_sections(KINDS)
class DataConfig:
    # Built-in real datasets turned into shards on first use (digits, fashion_mnist, web_photos), or null
    # to read your own shards from train_shards / val_shards.
    source: str | None = "digits"
    # A shard spec: file, brace pattern 'dir/{000..099}.tar', directory, glob, URL or 'pipe:cmd'; '::' joins several.
    # ... or a CSV/TSV table of image paths and captions (.csv/.tsv: open_clip's --dataset-type csv), read as shards
    train_shards: str | None = None
    val_shards: str | None = None  # the main evaluation set (a spec, or a clip_benchmark dataset folder)
    eval_sets: dict[str, str] = field(default_factory=dict)  # more evaluation sets: name -> spec, logged as name/...
    # Where a training sample's caption is: member extensions (txt) or JSON paths (json:caption, json:captions.0;
    # json:captions, a list: one drawn); the first the sample has, or one drawn by caption_probs (seeded per sample)
    caption_keys: list[str] = field(default_factory=lambda: ["txt"])
    caption_probs: list[float] | None = None  # one probability per caption key: draw among the keys a sample has
    image_keys: list[str] = field(default_factory=list)  # image extensions to read, first found; empty: any image
    resampled: bool = False  # draw shards with replacement forever instead of epoch by epoch
    weights: list[float] | None = None  # resampled: one weight per '::' part of train_shards (sources drawn by weight)
    split: Split = Split.node  # node: each rank reads its own shards; replicated: every rank reads them all
    # retrieval metrics where captions tie (repeated captions): pessimistic, or open_clip to compare with its runs
    retrieval_ties: RetrievalTies = RetrievalTies.pessimistic
    augment: bool = True  # augment training images (data.augmentation); false: the evaluation transform
    augmentation: AugmentationConfig = field(default_factory=AugmentationConfig)
    shuffle_buffer: int = non_negative(1000)  # samples a slot of the order holds to shuffle, over its readers (0: none)
    workers: int | None = non_negative(0)  # DataLoader workers per rank; null: automatic (data/workers.loader_workers)
    pieces: int = positive(
        1
    )  # the loader reads each rank's batch in this many pieces (a divisor of batch_per_device): docs/data.md
    readers: int | None = positive(
        None
    )  # the run's readers (the sample order's layout, fixed at its start); null: ranks × workers
    # CPU scheduling of the loader workers (docs/data.md#loader-workers)
    worker_priority: WorkerPriority = WorkerPriority.normal
    normalize_on: NormalizeOn = NormalizeOn.auto  # where uint8 pixels become normalized floats (docs/data.md)
    decode_on: DecodeOn = DecodeOn.host  # where training JPEGs are decoded: device is nvJPEG on CUDA (docs/data.md)
    source_dir: str | None = None  # where a built-in source's raw files are (RAW_FILE_SOURCES: fashion_mnist)
    cache_dir: str = "~/.cache/clipdist"  # where built-in datasets are written on first use
    classnames: list[str] = field(
        default_factory=list
    )  # zero-shot classes; empty: a built-in source's or classnames.txt
    max_skips_in_a_row: int = positive(1000)  # this many unusable samples with no good one between: stop with an error
    # captions cut to the batch's longest (clipdist/model/short_text.py); null: where the towers compute in fp32
    # (under fp16 / bf16 autocast the cut moves features by the autocast's rounding: scripts/trim_gap.py)
    trim_text: bool | None = None
    # NaFlex image towers (model=naflex_tiny, naflex_b16, any timm NaFlexVit): token-budget batches (docs/naflex.md)
    seq_lens: list[int] | None = (
        None  # patches an image may become, one length drawn per global batch; null: the tower's image_size grid
    )
    seq_len_probs: list[float] | None = None  # the lengths' weights; null: equal
    max_tokens_per_batch: int | None = positive(
        None
    )  # image patches of a *global* batch; null: batch_per_device × ranks × max(seq_lens)
    patch_size: int | None = positive(None)  # null: the tower's (the only one its patch embedding takes)
    naflex_square_crop: bool = False  # every image center-cropped square at ⌊√L⌋² patches: a fixed-size pipeline
    resolution_schedule: dict[str, list[int]] = field(
        default_factory=dict
    )  # global batch (+data.resolution_schedule.500=[...]) -> seq_lens
    # Zero-shot prompts; empty: a built-in source's own, else 'a photo of {}.' (a zeroshot_classification_templates.txt
    # beside an evaluation set's shards wins over both)
    templates: list[str] = field(default_factory=list)


@dataclass
@_with_sections(TERMS, REFUSE)
class LossConfig:
    """Options common to every backend, and a section per loss term (`loss.distill`, ...: registry.terms); a backend
    with options of its own extends this (below)."""

    RESUME: ClassVar[dict] = {
        "name": REFUSE,
        "contrastive_weight": REFUSE,
        "caption_weight": REFUSE,
        "init_logit_scale": FREE,
        "init_logit_bias": FREE,
    }  # initial scalars: the checkpoint's

    name: str = "disco"  # a backend registered in clipdist.losses
    init_logit_scale: float | None = None  # log of the initial logit scale; null: the backend's default
    init_logit_bias: float | None = None  # initial logit bias, for backends that have one; null: its default
    contrastive_weight: float = 1.0  # the contrastive term's weight (open_clip: --coca-contrastive-loss-weight)
    # CoCa models: the captioning loss's weight (open_clip: --coca-caption-loss-weight); null: open_clip's 2.0
    caption_weight: float | None = None

    if typing.TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...  # the terms' sections, added by _with_sections

    def term(self, name: str) -> TermOptions:
        """Term `name`'s section (loss.<name>)."""
        return getattr(self, name)

    def options(self) -> dict[str, Any]:
        """The backend's own keyword arguments: every field its schema adds to LossConfig."""
        common = {f.name for f in fields(LossConfig)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in common}


def _loss_schema(spec: LossSpec) -> type:
    """LossConfig with a backend's own options (`loss=tiled` → `loss.tile`), named for it (TiledLossConfig)."""
    own: Any = spec.options  # a dataclass
    hints = typing.get_type_hints(own)
    extra = [
        (
            f.name,
            hints[f.name],
            field(default=f.default, metadata=f.metadata)
            if f.default is not MISSING_FIELD
            else field(default_factory=f.default_factory, metadata=f.metadata),
        )
        for f in fields(own)
    ]
    schema = make_dataclass(
        "".join(part.title() for part in spec.name.split("_")) + "LossConfig",
        [("name", str, field(default=spec.name)), *extra],
        bases=(LossConfig,),
        namespace={"RESUME": {**LossConfig.RESUME, **getattr(own, "RESUME", {})}, "__module__": __name__},
    )
    return schema


# the schema of each backend with options (clipdist.registry.losses): `loss=<name>` composes against it
LOSS_SCHEMAS = {name: _loss_schema(spec) for name, spec in BACKENDS.items() if spec.options is not None}


@dataclass
class GradCacheConfig:
    chunks: int = positive(1)  # >1: gradient caching, each rank's batch forwarded in this many chunks
    micro_batch: int | None = positive(None)  # or: samples per chunk (chunks = ⌈batch_per_device / micro_batch⌉)

    def chunks_for(self, local_batch: int) -> int:
        return self.chunks if self.micro_batch is None else -(-local_batch // self.micro_batch)


@dataclass
class WorldConfig:
    name: str = "local"  # the preset's name (world=<name>)
    nodes: int = positive(1)  # nodes the launch spans
    procs_per_node: int = positive(1)  # processes (ranks) per node
    device: Device = Device.auto  # auto: CUDA if present, else CPU
    backend: Backend = Backend.auto  # auto: nccl on CUDA, gloo on CPU
    batch_per_device: int = positive(64)  # samples per rank per step (global batch = this × ranks)
    parallel: Parallel = Parallel.ddp  # ddp (replicated weights) or fsdp (FSDP2: sharded weights and AdamW state)
    # fsdp: each block's gathered weights freed after its forward and gathered again for its backward; false: kept
    # from forward to backward (one all-gather a step fewer, the whole model's gathered weights held at once)
    reshard_after_forward: bool = True
    sync_batchnorm: bool = False  # BatchNorm statistics over the global batch (SyncBatchNorm; towers with BatchNorm)
    spawn: bool = False  # started alone: spawn procs_per_node local ranks (launch.launch_local)
    timeout_s: int = positive(COLLECTIVE_TIMEOUT_S)  # bound on every collective
    rendezvous_timeout_s: int = positive(300)  # srun: how long ranks wait for each other at start before failing
    threads: int | None = positive(None)  # intra-op threads per rank; null: OMP_NUM_THREADS, else SLURM_CPUS_PER_TASK,
    #                                else this process's CPUs / procs_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass
class EmaConfig:
    """An exponential moving average of the weights (open_clip main's --model-ema, MobileCLIP trains with one): after
    optimizer step t, every `every` steps from `start_step` on, ema ← decay·ema + (1 − decay)·θ; until then the
    average is the weights themselves. Kept in every checkpoint (resharded to any world size, FSDP2 too);
    `clipdist eval --ema` and `clipdist export --ema` take it (clipdist.optim.ema)."""

    RESUME: ClassVar[dict] = {"decay": WARN, "start_step": WARN, "start_at": WARN, "every": WARN}

    decay: float = non_negative(0.0)  # 0: no average; 0.999 ... 0.9999 (it spans ~1/(1 − decay) updates)
    start_step: int = non_negative(0)  # the first optimizer step that averages (before it: the weights)
    # or the start as a fraction of optim.max_steps, as a loss term's start_at: the teacher terms' teacher is then
    # the student at the step they start (SigLIP 2's rule); null: start_step
    start_at: float | None = None
    every: int = positive(1)  # average every this many steps

    def first_step(self, max_steps: int) -> int:
        """The first optimizer step that averages: start_step, or where start_at puts it (the step a term with the
        same start_at first counts, so the average is the weights for that step's forward)."""
        return self.start_step if self.start_at is None else first_step(self.start_at, max_steps)


@dataclass
@_with_sections(SCHEDULES, WARN)
class OptimConfig:
    RESUME: ClassVar[dict] = {
        "ema": WARN,  # the average goes on from the checkpoint's (or starts at the weights, where it had none)
        "name": REFUSE,  # another optimizer state
        "schedule": WARN,
        "max_steps": WARN,  # the cosine schedule reshapes mid-run
        "lr": FREE,
        "weight_decay": FREE,
        "betas": FREE,
        "eps": FREE,
        "momentum": FREE,
        "kwargs": FREE,
        "no_decay": FREE,
        "image_layer_decay": FREE,
        "text_layer_decay": FREE,
        "warmup_steps": FREE,
        "grad_clip": FREE,
        "max_logit_scale": FREE,
    }
    name: str = "adamw"  # adamw (torch's, fused), or any timm optimizer: lion, lamb, nadamw, sgd, ... (timm.optim)
    lr: float = non_negative(2e-3)  # peak learning rate
    weight_decay: float = non_negative(0.1)  # decoupled weight decay on the matrices (optim.no_decay: the exceptions)
    betas: list[float] | None = field(default_factory=lambda: [0.9, 0.98])  # null: the optimizer's own
    # null: the optimizer's own; 0 is refused: Adam-like steps divide by √v + eps, and v is 0 where no gradient has
    # reached (a token embedding's unused rows), so 0/0 made nan weights
    eps: float | None = above_zero(1e-6)
    momentum: float | None = None  # for optimizers that take one (sgd, ...)
    kwargs: dict[str, Any] = field(default_factory=dict)  # more keyword arguments for the optimizer
    # Parameters with no weight decay: every gain, bias and scalar (ndim < 2), and any parameter whose name contains
    # one of these: open_clip_train's rule, so positional embeddings are decayed as there (add "positional" to keep
    # them undecayed)
    no_decay: list[str] = field(default_factory=lambda: ["bn", "ln", "bias", "logit_scale"])
    image_layer_decay: float | None = None  # layer-wise lr decay in the image tower: layer l of L gets lr·d^(L−l)
    text_layer_decay: float | None = None  # the same in the text tower
    schedule: str = "cosine"  # after the warmup: a schedule of clipdist.registry.schedules (cosine, const, ...)
    warmup_steps: int = non_negative(50)  # linear warmup steps
    max_steps: int = positive(600)  # optimizer steps the run trains
    grad_clip: float = non_negative(1.0)  # max global grad norm; 0 disables
    ema: EmaConfig = field(default_factory=EmaConfig)  # optim.ema.decay=0.9999: an average of the weights
    max_logit_scale: float = 100.0  # the learnt logit scale is clamped at this (CLIP's 100)


@dataclass
class CheckpointConfig:
    # A copy of every checkpoint off the node: an fsspec URL (s3://bucket/runs/x, gs://..., an absolute mount), e.g.
    # s3://bucket/runs/${name}; resume=auto takes the newest of local and remote (docs/checkpoints.md).
    remote: str | None = None
    remote_retries: int = non_negative(
        3
    )  # a failed upload is tried again this many times (1, 2, 4, ... s apart), then reported
    # The state copied to host memory at the save, written to disk in the background while training goes on;
    # published once every rank has written (false: the step waits for the write).
    async_save: bool = True


@dataclass
class LoggingConfig:
    wandb: WandbMode = WandbMode.offline  # offline (no network; wandb sync later) | online | disabled
    tensorboard: bool = False  # also TensorBoard event files in <run_dir>/tensorboard/ (needs the tensorboard package)
    project: str = "clipdist"  # the W&B project
    wandb_notes: str | None = None  # the W&B run's notes
    log_every: int = positive(10)  # train_log.jsonl / W&B: step 1, every N-th after it, and the last
    # count log_every within epochs of this many steps and log each one's last, as open_clip_train does (its
    # "steps an epoch"); null: over the run
    epoch_steps: int | None = positive(None)
    progress: bool = True  # a progress bar on the console
    profile_steps: int = non_negative(
        0
    )  # >0: torch.profiler over this many steps -> <run_dir>/profile/ (trace + table per rank)
    profile_wait: int = non_negative(10)  # steps run before profiling starts (warm-up left out)
    report: bool = True  # report.png / report.txt in the run directory when the run ends or stops (clipdist report)
    sample_keys: bool = False  # each rank logs every step's samples ("shard#key") to <run_dir>/samples/rank_<r>.jsonl


@dataclass
class TrainConfig:
    RESUME: ClassVar[dict] = {"precision": WARN}
    name: str = MISSING  # the run's name (default: the start time); runs/<name> unless run_dir says
    run_dir: str = "runs/${name}"  # the run's directory: checkpoints, logs, report
    seed: int = seed_field(0)  # seeds weights, data order and augmentation
    resume: str = "auto"  # auto: newest checkpoint in run_dir | never | path to a checkpoint
    # auto | fp32 | bf16 | fp16 | pure_bf16 | pure_fp16 (open_clip's amp names too)
    precision: Precision = Precision.auto
    eval_every: int = positive(200)  # evaluate every N steps (and at the end)
    checkpoint_every: int = positive(200)  # save every N steps (and on a stop signal)
    checkpoint_every_minutes: float | None = above_zero(
        None
    )  # also checkpoint when this much time passed since the last
    keep_checkpoints: int = positive(3)  # the newest N checkpoints are kept
    on_checkpoint_error: OnCheckpointError = OnCheckpointError.stop  # stop | warn: what a failed save does
    max_nonfinite_steps: int = positive(10)  # non-finite losses in a row before the run stops (after a checkpoint)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    grad_cache: GradCacheConfig = field(default_factory=GradCacheConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def validate(cfg: TrainConfig) -> None:
    """Values and combinations of the schema alone (the bounds its fields carry, then the pairs of keys that must
    agree): a ConfigError naming the key and what to change. The checks that need a component (a loss backend,
    the data layout, a file system) are the component's, run by clipdist.preflight."""
    _check_bounds(cfg)
    if cfg.grad_cache.micro_batch is not None and cfg.grad_cache.chunks != 1:
        raise ConfigError(
            f"grad_cache.chunks={cfg.grad_cache.chunks} and grad_cache.micro_batch="
            f"{cfg.grad_cache.micro_batch} both set: give one of them"
        )
    if cfg.grad_cache.chunks > cfg.world.batch_per_device:
        raise ConfigError(
            f"grad_cache.chunks={cfg.grad_cache.chunks} is more than world.batch_per_device="
            f"{cfg.world.batch_per_device}: a chunk needs at least one sample"
        )
    for name in TERMS:
        if not 0 <= cfg.loss.term(name).start_at < 1:
            raise ConfigError(
                f"loss.{name}.start_at={cfg.loss.term(name).start_at}: must be at least 0 and below 1 (a fraction "
                "of optim.max_steps; 0.8: from 80% of the run)"
            )
        cfg.loss.term(name).check(name, cfg)
    check_schedule(cfg.optim)
    if cfg.optim.ema.start_at is not None and not 0 <= cfg.optim.ema.start_at < 1:
        raise ConfigError(f"optim.ema.start_at={cfg.optim.ema.start_at}: a fraction of optim.max_steps in [0, 1)")
    if not cfg.optim.ema.decay < 1:
        raise ConfigError(f"optim.ema.decay={cfg.optim.ema.decay}: must be below 1 (0.999 ... 0.9999; 0: no average)")
    if cfg.optim.max_logit_scale <= 1:
        raise ConfigError(f"optim.max_logit_scale={cfg.optim.max_logit_scale}: must be above 1 (it is exp-ed)")
    if cfg.world.backend == Backend.nccl and cfg.world.device == Device.cpu:
        raise ConfigError(
            "world.backend=nccl needs world.device=cuda (NCCL has no CPU tensors); use world.backend=gloo"
        )
    _check_data(cfg.data)
    _check_locks(cfg.model)
    _check_scales(cfg)


def _check_data(data: DataConfig) -> None:
    """The data section's keys that must agree: weights with resampling, captions' keys and probabilities, shards
    with the source that would make them."""
    if data.weights is not None:
        if not data.resampled:
            raise ConfigError(
                "data.weights needs data.resampled=true: sources are mixed by drawing shards by weight "
                "(in epoch mode every shard is read once per epoch, whatever its weight)"
            )
        if any(weight <= 0 for weight in data.weights):
            raise ConfigError(f"data.weights={list(data.weights)}: every weight must be above 0")
    if not data.caption_keys:
        raise ConfigError("data.caption_keys is empty: give where captions are, e.g. [txt] or [json:caption]")
    if data.caption_probs is not None and (
        len(data.caption_probs) != len(data.caption_keys) or any(p <= 0 for p in data.caption_probs)
    ):
        raise ConfigError(
            f"data.caption_probs={list(data.caption_probs)}: one probability above 0 per "
            f"data.caption_keys entry ({list(data.caption_keys)})"
        )
    if data.source is None and not data.train_shards:
        raise ConfigError(
            "data.train_shards is not set: give your shards, e.g. "
            "data.train_shards='/data/{000..099}.tar' (or data.source=digits)"
        )
    if data.source_dir is not None and data.source not in RAW_FILE_SOURCES:  # read by nothing: a silent no-op
        raise ConfigError(
            f"data.source_dir={data.source_dir} is where {', '.join(RAW_FILE_SOURCES)}'s raw files are, but "
            f"data.source={data.source or 'null'} reads none: add data=fashion_mnist to train on them, or drop "
            "data.source_dir"
        )
    if data.source is not None and data.train_shards:  # the built-in set would train, the shards unread
        raise ConfigError(
            f"data.train_shards is given, but data.source={data.source} makes the training shards (data=digits is "
            "the default): add data=webdataset (or data.source=null) to train on yours"
        )


def _check_locks(model: ModelConfig) -> None:
    """A locked tower's options set while the tower is not locked do nothing: refused, naming the switch."""
    defaults = ModelConfig()
    for switch, options in (
        ("lock_image", ("lock_image_unlocked_groups", "lock_image_freeze_bn_stats")),
        ("lock_text", ("lock_text_unlocked_layers", "lock_text_freeze_layer_norm")),
    ):
        changed = [key for key in options if getattr(model, key) != getattr(defaults, key)]
        if changed and not getattr(model, switch):
            value = str(getattr(model, changed[0])).lower()
            raise ConfigError(
                f"model.{changed[0]}={value} does nothing without model.{switch}=true (an option of the locked "
                f"tower): add model.{switch}=true, or drop it"
            )


def _check_scales(cfg: TrainConfig) -> None:
    """The image normalisation divides by a positive std per channel (or one for all), and the first step's logit
    scale is one training can hold: it is clamped to [0, log optim.max_logit_scale] only after each step (exp(1000)
    made the first loss inf)."""
    for key in ("image_mean", "image_std"):
        value = getattr(cfg.model, key)
        if value is not None and len(value) not in (1, 3):
            raise ConfigError(f"model.{key}={list(value)}: give one value per RGB channel (3), or one for all")
    if cfg.model.image_std is not None and any(std <= 0 for std in cfg.model.image_std):
        raise ConfigError(f"model.image_std={list(cfg.model.image_std)}: every std must be above 0 (it divides)")
    top, scale = math.log(cfg.optim.max_logit_scale), cfg.loss.init_logit_scale
    if scale is not None and not 0 <= scale <= top:
        raise ConfigError(
            f"loss.init_logit_scale={scale:g}: the log of the scale, which training holds in [0, {top:.2f}] (log "
            "optim.max_logit_scale); give one in it (CLIP's log(1/0.07) = 2.66, SigLIP's log 10 = 2.30)"
        )


def check_schedule(optim: OptimConfig) -> None:
    """The schedule is registered, its options can run, and no other schedule's section is set."""
    if optim.schedule not in SCHEDULES:
        raise ConfigError(
            f"optim.schedule={optim.schedule}{left_out('clipdist.schedules', optim.schedule)}: no such schedule; "
            f"choose one of {', '.join(SCHEDULES)}"
        )
    for name, spec in SCHEDULES.items():
        if spec.options is None:
            continue
        section = getattr(optim, name)
        if name == optim.schedule:
            getattr(section, "check", lambda optim: None)(optim)
        elif section != spec.options():
            changed = next(
                f.name for f in fields(section) if getattr(section, f.name) != getattr(spec.options(), f.name)
            )
            raise ConfigError(
                f"optim.{name}.{changed} is for optim.schedule={name}, not {optim.schedule}: set the schedule, or "
                "drop the key"
            )


def _check_bounds(node, prefix: str = "") -> None:
    """Every field declared with a bound (positive / non_negative / above_zero) holds a finite value within it (None:
    automatic, where the field allows it): nan passes every comparison, so it is refused by name. Every other number
    (in a list too: optim.betas, model.image_mean) is finite: nan or inf in a logit bias, a loss weight or a
    normalisation runs, and trains on nothing."""
    for spec in fields(node):
        value, key = getattr(node, spec.name), f"{prefix}{spec.name}"
        if is_dataclass(value):
            _check_bounds(value, f"{key}.")
        elif "bound" in spec.metadata and value is not None:
            low, strict, says = spec.metadata["bound"]
            if not math.isfinite(value):
                raise ConfigError(f"{key}={value}: must be a finite number, {says}")
            high = spec.metadata.get("high")
            if value < low or (strict and value == low) or (high is not None and value > high):
                raise ConfigError(f"{key}={value}: must be {says}")
        elif any(not math.isfinite(number) for number in _numbers(value)):
            raise ConfigError(f"{key}={value}: must be finite (nan and inf are refused)")


def _numbers(value) -> list[float]:
    """The floats a field holds: itself, or a list's or tuple's items (not bools, not a free-form dict's)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [item for item in items if isinstance(item, float)]


_REGISTERED: set[tuple[str, type]] = set()  # what this process has stored already (each store costs ~50 ms)


def other_backends_option(key: str) -> str | None:
    """One line for `loss.<option>` where the run's loss does not take it but other backends do (loss.tile with
    loss=disco); None for any other key."""
    if not key.startswith("loss."):
        return None
    option = key.removeprefix("loss.")
    owners = [name for name, schema in LOSS_SCHEMAS.items() if option in _fields(schema)]
    if not owners or option in _fields(LossConfig):
        return None
    return (
        f"{printable(key)}: an option of {', '.join(f'loss={name}' for name in owners)}, not of the loss chosen; "
        "choose one of those backends or leave the option out"
    )


def _fields(schema: type) -> set[str]:
    return {field.name for field in fields(schema)}


def register() -> None:
    """Make the schemas known to Hydra: `train_schema` (config.yaml's first default) and `<name>_loss_schema` —
    once a process, and again for a backend or schema added to the registries since; and what a loss option means
    where Hydra finds it missing (hydra_policy.MISSING_KEY_HINTS)."""
    if other_backends_option not in hydra_policy.MISSING_KEY_HINTS:
        hydra_policy.MISSING_KEY_HINTS.append(other_backends_option)
    store = ConfigStore.instance()
    _store_once(store, "train_schema", TrainConfig)
    for name, schema in LOSS_SCHEMAS.items():
        _store_once(store, f"{name}_loss_schema", schema)  # top level: not offered in the loss= menu
    for name in BACKENDS:  # a backend without a conf/loss/<name>.yaml is still on the menu: its schema, as is
        if not (CONF / "loss" / f"{name}.yaml").is_file():
            _store_once(store, name, LOSS_SCHEMAS.get(name, LossConfig), group="loss")


def _store_once(store: ConfigStore, name: str, schema: type, group: str | None = None) -> None:
    key = (f"{group}/{name}" if group else name, schema)
    if key not in _REGISTERED:
        store.store(name=name, node=schema(name=name) if group else schema, group=group)
        _REGISTERED.add(key)


def as_dict(cfg: TrainConfig) -> dict:
    """Plain nested dict of a TrainConfig (choices as strings): for checkpoints, W&B and comparisons."""
    return cast(dict, OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))


def _misfit(given: dict, schema, prefix: str = "") -> str | None:
    """One line for the first key of `given` that its schema node does not have, or whose value its bool field
    would misread (loose_bool); keys under a free-form field (a Dict such as data.eval_sets) are the user's own."""
    owner = OmegaConf.get_type(schema)
    if not is_dataclass(owner):
        return None
    for key, value in given.items():
        path = f"{prefix}{key}"
        if key not in list(schema.keys()):  # (`key in schema` is False for a key whose value is ??? yet)
            return other_backends_option(path) or (
                f"{path}: no such key ({owner.__name__} has no '{key}'); check the spelling "
                "(python train.py --cfg job lists every key)"
            )
        child = schema._get_node(key)
        if loose_bool(child, value):
            return loose_bool_error(path, value)
        if isinstance(value, dict) and isinstance(child, DictConfig):
            found = _misfit(value, child, f"{path}.")
            if found:
                return found
    return None


def loose_bool(node, value) -> bool:
    """Whether `value`, given to the schema's `node`, is a number other than 0 and 1 for a bool: OmegaConf reads any
    other as true (2, '2', -1), where torch's settings of the same names take numbers (reshard_after_forward=2)."""
    if not isinstance(node, BooleanNode) or isinstance(value, bool):
        return False
    try:
        return int(str(value).strip()) not in (0, 1)
    except ValueError:  # true, false, yes, no, on, off, an interpolation, or a float OmegaConf refuses itself
        return False


def loose_bool_error(key: str, value) -> str:
    return f"{printable(key)}={printable(str(value))}: takes true or false (a number other than 0 or 1 means neither)"


CONF = Path(__file__).resolve().parent / "conf"  # the menu, shipped in the package


def preset(group: str, name: str):
    """conf/<group>/<name>.yaml (a menu entry: world=8gpu, data=web_photos) as a DictConfig, or None when there is
    none."""
    path = CONF / group / f"{name}.yaml"
    return OmegaConf.load(path) if path.is_file() else None


def to_train_config(cfg) -> TrainConfig:
    """A resolved TrainConfig object from a composed DictConfig or a plain dict."""
    if isinstance(cfg, TrainConfig):
        return cfg
    schema = OmegaConf.structured(TrainConfig)
    loss_name = OmegaConf.select(OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg, "loss.name")
    if loss_name in LOSS_SCHEMAS:
        schema.loss = OmegaConf.structured(LOSS_SCHEMAS[loss_name])
    given = cfg if isinstance(cfg, dict) else cast(dict, OmegaConf.to_container(cfg, resolve=False))
    misfit = _misfit(given, schema)
    if misfit:  # `+optim.lrr=1` adds a key Hydra lets through and the schema would drop without a word
        raise ConfigError(misfit)
    merged = OmegaConf.merge(schema, cfg)
    hydra_policy.refuse_outside_resolvers()  # a saved config read back resolves nothing from the environment
    if str(merged.precision) in PRECISION_ALIASES:
        merged.precision = PRECISION_ALIASES[str(merged.precision)]
    try:
        OmegaConf.resolve(merged)
    except InterpolationResolutionError as error:  # ${oc.env:UNSET}, ${no.such.key}: one line, not a traceback
        key = next(
            (
                key
                for key in _interpolations(OmegaConf.to_container(merged, resolve=False))
                if not _resolves(merged, key)
            ),
            "the config",
        )
        raise ConfigError(
            f"{key}: {printable(str(error)).splitlines()[0]}; set what it names or write the value itself"
        ) from None
    return cast(TrainConfig, OmegaConf.to_object(merged))


def _interpolations(node, prefix: str = ""):
    """The dotted keys under `node` (a plain container) whose values hold a ${...} interpolation."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, (dict, list)):
            yield from _interpolations(value, f"{prefix}{key}.")
        elif isinstance(value, str) and "${" in value:
            yield f"{prefix}{key}"


def _resolves(cfg, key: str) -> bool:
    try:
        OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except InterpolationResolutionError:
        return False
    return True


@functools.cache
def schema_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(every dotted key of the schema, the keys of free-form fields whose own keys are the user's): `loss.*` holds
    the options of every loss backend (its schema is chosen by loss.name). Read once a process."""
    keys: set[str] = set()
    free: set[str] = set()

    def walk(schema, prefix: str) -> None:
        hints = typing.get_type_hints(schema)
        for item in fields(schema):
            path, kind = f"{prefix}{item.name}", hints[item.name]
            keys.add(path)
            if is_dataclass(kind):
                walk(kind, f"{path}.")
            elif typing.get_origin(kind) is dict or (
                typing.get_origin(kind) in (typing.Union, getattr(types, "UnionType", None))
                and any(typing.get_origin(arg) is dict for arg in typing.get_args(kind))
            ):
                free.add(path)

    walk(TrainConfig, "")
    for schema in LOSS_SCHEMAS.values():
        walk(schema, "loss.")
    return frozenset(keys), frozenset(free)


GROUPS_WITHOUT_KEYS = ("recipe",)  # config groups with no section of their own (clipdist/conf/recipe/: _global_)


@functools.cache
def default_groups() -> frozenset[str]:
    """The config groups conf/config.yaml's defaults list chooses for every run (model, data, ..., recipe)."""
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    keys = (str(key) for entry in defaults if isinstance(entry, DictConfig) for key in entry)
    return frozenset(key for key in keys if not key.startswith("override"))


def group_options(group: str) -> list[str]:
    """The options Hydra's own menu offers for a config group (`loss=`, `world=`, `hydra/launcher=`): clipdist/conf's
    files, the registered loss backends, a search-path plugin's; [] for a key that is no group."""
    register()
    repository = _config_repository()
    if "." in group or not repository.group_exists(group):
        return []
    return repository.get_group_options(group, results_filter=ObjectType.CONFIG)


@functools.cache
def _config_repository() -> ConfigRepository:
    return ConfigRepository(config_search_path=create_config_search_path("pkg://clipdist.conf"))


# keys an earlier clipdist had, where they are now: a component's options in its own section
MOVED = {
    "data.csv_separator": "data.table.separator",
    "data.csv_image_key": "data.table.image_key",
    "data.csv_caption_key": "data.table.caption_key",
    "data.csv_rows_per_part": "data.table.rows_per_part",
    "optim.cooldown_steps": "optim.const_cooldown.steps",
    "optim.cooldown_end_lr": "optim.const_cooldown.end_lr",
    "optim.cooldown_power": "optim.const_cooldown.power",
}


def unknown_override(arguments: list[str]) -> str | None:
    """One line for the first `key=value` override whose key the schema does not have, with the nearest keys it
    does have ("did you mean"), or a group choice that names no option (`loss=foo`, or one of a sweep's
    `loss=disco,foo`: the options listed), said before Hydra composes anything; None where all exist. Read by
    Hydra's override grammar (a line it cannot read is Hydra's to say). Choices where a user's config folder may add
    options, Hydra's own keys and deletions (`~key`) are left to Hydra."""
    keys, free = schema_keys()
    overrides = parsed_overrides(arguments) or []
    searched = hydra_policy.searches_user_folders(arguments, overrides)
    for override in overrides:
        if override.is_delete():
            continue
        key = override.key_or_group
        options = [] if searched else group_options(key)
        if options:
            said = _group_choice_error(override, key, options)
            if said:
                return said
            continue
        if "/" in key or key.split(".")[0] == "hydra" or key in keys or any(key.startswith(f"{f}.") for f in free):
            continue
        if key in GROUPS_WITHOUT_KEYS:  # a group that sets others' keys (recipe=siglip2)
            continue
        siblings = sorted(k for k in keys if k.count(".") == key.count("."))
        near = [MOVED[key]] if key in MOVED else difflib.get_close_matches(key, siblings, n=2, cutoff=0.8)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        backends = "; a loss backend's options exist with its loss=" if key.startswith("loss.") else ""
        return f"{printable(key)}: no such key{hint} (python train.py --cfg job lists every key{backends})"
    return None


def _group_choice_error(override, key: str, options: list[str]) -> str | None:
    """One line for a choice of the group `key` that names no option (a sweep's too), or one added with `+` to a group
    every run chooses from already (Hydra: "Multiple values for loss ... use 'override loss: tiled'"); None where
    it is fine."""
    chosen = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
    unknown = next((str(value) for value in chosen if value is not None and value not in options), None)
    if unknown is not None:
        near = difflib.get_close_matches(unknown, options, n=1, cutoff=0.6)
        hint = f"did you mean {key}={near[0]}? " if near else ""
        named = "; an open_clip model name or config file goes in model.name=" if key == "model" else ""
        listed = ", ".join(options)
        return f"{printable(key)}={printable(unknown)}: no such option; {hint}choose one of {listed}{named}"
    if override.is_add() and key in default_groups():
        value = printable(override.get_value_element_as_str())
        return f"+{key}={value}: {key} is a group every run's config chooses from already; give {key}={value}"
    return None


def parsed_overrides(arguments: list[str]) -> list | None:
    """The command line's overrides (`key=value`, `+key=...`, `~key`, sweeps) as Hydra's grammar reads them; None
    where it cannot read one (Hydra then says why)."""
    try:
        return OverridesParser.create().parse_overrides([a for a in arguments if "=" in a and a[0] != "-"])
    except Exception:  # noqa: BLE001 -- the grammar's error is Hydra's to say
        return None


def invalid_value(arguments: list[str]) -> str | None:
    """One line for the first `key=value` override whose value its key's type refuses (`optim.lr=abc`,
    `world.parallel=fsdp2`), said before Hydra composes (Hydra's own says it in six lines); None where all fit.
    Values are read by Hydra's override grammar; sweeps, group choices and a loss backend's own options (typed once
    its schema is chosen) are left to Hydra."""
    keys, _ = schema_keys()
    schema = OmegaConf.structured(TrainConfig)
    for override in parsed_overrides(arguments) or ():
        key = override.key_or_group
        if key not in keys or override.is_sweep_override() or override.is_delete() or override.package is not None:
            continue
        try:
            if OmegaConf.is_config(OmegaConf.select(schema, key, throw_on_resolution_failure=False)):
                continue  # a section or a group choice
            parent, _, leaf = key.rpartition(".")
            section = OmegaConf.select(schema, parent) if parent else schema
            if loose_bool(section._get_node(leaf), override.value()):
                return loose_bool_error(key, override.get_value_element_as_str())
            OmegaConf.update(schema, key, override.value(), merge=True)
        except ValidationError as error:
            return f"{printable(key)}={printable(override.get_value_element_as_str())}: {str(error).splitlines()[0]}"
        except Exception:  # noqa: BLE001 -- a key only a chosen schema has (loss.tile): Hydra checks it there
            continue
    return None


def field_notes(source_file: str | Path = __file__) -> dict[tuple[str, str], str]:
    """(dataclass name, field name) -> the comment the schema's source gives it: on the field's line, or the comment
    lines just above it. Read from the module's source (this one's, or the loss registry's)."""
    source = read_bounded(source_file, 1 << 20).decode()
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    notes = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                said = [
                    comments[line]
                    for line in range(item.lineno, (item.end_lineno or item.lineno) + 1)
                    if line in comments
                ]
                above: list[str] = []
                line = item.lineno - 1
                while line in comments and lines[line - 1].lstrip().startswith("#"):
                    above.insert(0, comments[line])
                    line -= 1
                text = " ".join(above + said)
                if text:
                    notes[node.name, item.target.id] = text
    return notes


def describe_keys() -> list[str]:
    """One line per key of the schema: `key = default  — what it is` (`python train.py --help`)."""
    specs: list[Any] = [*BACKENDS.values(), *TERMS.values(), *KINDS.values(), *SCHEDULES.values()]
    sources = {sys.modules[spec.options.__module__].__file__ for spec in specs if spec.options is not None}
    notes = {key: note for source in sources if source for key, note in field_notes(source).items()}
    notes.update(field_notes())
    described: list[str] = []

    def walk(schema, prefix: str) -> None:
        hints = typing.get_type_hints(schema)
        for item in fields(schema):
            path = f"{prefix}{item.name}"
            if is_dataclass(hints[item.name]):
                walk(hints[item.name], f"{path}.")
                continue
            default = (
                item.default
                if item.default is not MISSING_FIELD
                else (item.default_factory() if item.default_factory is not MISSING_FIELD else "???")
            )
            default = default.value if isinstance(default, Enum) else default
            shown = str(default) if not isinstance(default, str) else repr(default)
            owner = next((owner for owner in schema.__mro__ if (owner.__name__, item.name) in notes), None)
            note = notes[owner.__name__, item.name] if owner else ""
            described.append(f"  {path} = {shown}" + (f"  — {note}" if note else ""))

    walk(TrainConfig, "")
    options: dict[str, list[str]] = {}
    for name, spec in BACKENDS.items():
        if spec.options is not None:
            for item in fields(spec.options):
                options.setdefault(f"{spec.options.__name__}.{item.name}", [])
                options[f"{spec.options.__name__}.{item.name}"].append(name)
    for key, backends in options.items():
        owner, name = key.split(".")
        options_schema: Any = BACKENDS[backends[0]].options  # a dataclass: the backend has options
        item = next(f for f in fields(options_schema) if f.name == name)
        note = notes.get((owner, name), "")
        described.append(f"  loss.{name} = {item.default}  — (loss={' | '.join(backends)}) {note}".rstrip())
    return described
