"""Typed schema of the Hydra config: a key that is not here is an error, not a silent default.

conf/ holds the menu (model/, data/, loss/, world/, optim/, logging/); these dataclasses say
which keys exist and what type each value has.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class ModelConfig:
    name: str = "clipdist-tiny"  # any open_clip model config; random init
    checkpoint: Optional[str] = None  # local open_clip checkpoint file to start from
    grad_checkpointing: bool = False
    compile: bool = False  # torch.compile the model


@dataclass
class DataConfig:
    # Built-in real datasets turned into shards on first use (digits, fashion_mnist), or null
    # to read your own shards from train_shards / val_shards.
    source: Optional[str] = "digits"
    train_shards: Optional[str] = None  # local path, brace pattern 'dir/{000..099}.tar', or 'pipe:cmd'
    val_shards: Optional[str] = None
    resampled: bool = False  # draw shards with replacement forever instead of epoch by epoch
    split: str = "node"  # node: shards split over ranks/workers | replicated: every rank slices the same global batch
    augment: bool = True  # random resized crops for training images
    shuffle_buffer: int = 1000
    workers: int = 0  # DataLoader workers per rank
    source_dir: Optional[str] = None  # where a built-in source's raw files are (fashion_mnist)
    cache_dir: str = "~/.cache/clipdist"
    classnames: List[str] = field(default_factory=list)  # zero-shot classes; empty: no zero-shot eval
    templates: List[str] = field(default_factory=lambda: ["a photo of {}."])


@dataclass
class LossConfig:
    name: str = "disco"  # a backend registered in clipdist.losses
    options: Dict[str, Any] = field(default_factory=dict)  # keyword arguments of the backend, e.g. tile
    init_logit_scale: Optional[float] = None  # log of the initial logit scale; null: open_clip's log(1/0.07)
    init_logit_bias: float = -10.0  # initial logit bias, for backends that have one (siglip)


@dataclass
class GradCacheConfig:
    chunks: int = 1  # >1: gradient caching, each rank's batch forwarded in this many chunks
    micro_batch: Optional[int] = None  # or: samples per chunk (chunks = ⌈batch_per_device / micro_batch⌉)

    def chunks_for(self, local_batch: int) -> int:
        return self.chunks if self.micro_batch is None else -(-local_batch // self.micro_batch)


@dataclass
class WorldConfig:
    name: str = "local"
    nodes: int = 1
    procs_per_node: int = 1
    device: str = "auto"  # auto (cuda if present) | cpu | cuda
    backend: str = "auto"  # auto (nccl on cuda, else gloo) | gloo | nccl
    batch_per_device: int = 64
    spawn: bool = False  # started alone: launch procs_per_node local ranks with torch's elastic launcher
    timeout_s: int = 600  # bound on every collective

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass
class OptimConfig:
    lr: float = 2e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    warmup_steps: int = 50
    max_steps: int = 600
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    max_logit_scale: float = 100.0


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # offline (no key, no network) | online | disabled
    project: str = "clipdist"
    log_every: int = 10
    progress: bool = True


@dataclass
class TrainConfig:
    name: str = MISSING
    run_dir: str = "runs/${name}"
    seed: int = 0
    resume: str = "auto"  # auto: newest checkpoint in run_dir | never | path to a checkpoint
    precision: str = "auto"  # auto (bf16 autocast on cuda, fp32 on cpu) | fp32 | bf16
    eval_every: int = 200
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    max_nonfinite_steps: int = 10  # non-finite losses in a row before the run stops (after a checkpoint)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    grad_cache: GradCacheConfig = field(default_factory=GradCacheConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


POSITIVE = ("world.nodes", "world.procs_per_node", "world.batch_per_device", "optim.max_steps", "eval_every",
            "checkpoint_every", "keep_checkpoints", "logging.log_every", "max_nonfinite_steps", "world.timeout_s",
            "grad_cache.chunks")
NON_NEGATIVE = ("optim.warmup_steps", "optim.lr", "optim.weight_decay", "optim.grad_clip", "data.workers",
                "data.shuffle_buffer")


def validate(cfg: "TrainConfig") -> None:
    """Values Hydra's types cannot rule out: one ValueError naming the key and what to change."""
    for key in POSITIVE + NON_NEGATIVE:
        value = OmegaConf.select(OmegaConf.structured(cfg), key)
        if value < 0 or (value == 0 and key in POSITIVE):
            bound = "at least 1" if key in POSITIVE else "0 or more"
            raise ValueError(f"{key}={value}: must be {bound}")
    if cfg.grad_cache.micro_batch is not None:
        if cfg.grad_cache.chunks != 1:
            raise ValueError(f"grad_cache.chunks={cfg.grad_cache.chunks} and grad_cache.micro_batch="
                             f"{cfg.grad_cache.micro_batch} both set: give one of them")
        if cfg.grad_cache.micro_batch < 1:
            raise ValueError(f"grad_cache.micro_batch={cfg.grad_cache.micro_batch}: must be at least 1")
    if cfg.grad_cache.chunks > cfg.world.batch_per_device:
        raise ValueError(f"grad_cache.chunks={cfg.grad_cache.chunks} is more than world.batch_per_device="
                         f"{cfg.world.batch_per_device}: a chunk needs at least one sample")
    if cfg.optim.max_logit_scale <= 1:
        raise ValueError(f"optim.max_logit_scale={cfg.optim.max_logit_scale}: must be above 1 (it is exp-ed)")


def register() -> None:
    """Make the schema known to Hydra as `train_schema` (conf/config.yaml lists it first)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_train_config(cfg) -> TrainConfig:
    """A resolved, validated TrainConfig object from a DictConfig or plain dict."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
    OmegaConf.resolve(merged)
    return OmegaConf.to_object(merged)
