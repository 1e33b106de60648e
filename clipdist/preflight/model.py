"""The model checks before any rank starts, on the model built once on the meta device (its structure, no memory):
the name and its options, the loss terms' weights, a distillation teacher, the optimizer, the augmentation, the
parallelism's needs (FSDP's blocks, SyncBatchNorm's GPUs); the pretrained weights and a hub tokenizer fetched into
the cache once."""

from __future__ import annotations

import torch

from clipdist.compat import require
from clipdist.config import TrainConfig
from clipdist.data.transforms import augmentation_cfg
from clipdist.distributed import parallel
from clipdist.errors import ConfigError, as_config_error
from clipdist.losses import build as build_loss
from clipdist.model import targets
from clipdist.model.factory import (
    check_logit_bias,
    check_loss_weights,
    check_model_options,
    check_teacher,
    check_tokenizer,
    check_weights,
    create_model,
    model_overrides,
    resolve_model_name,
)
from clipdist.objective import attach_parts
from clipdist.optim.optimizer import check_optim


def check_model(cfg: TrainConfig, is_main: bool) -> torch.nn.Module:
    """The student on the meta device, checked (the module docstring); rank 0 (`is_main`) fetches its weights."""
    with as_config_error(FileNotFoundError):  # a path the config names that is not there: the user's to fix
        resolve_model_name(cfg.model.name)
        check_model_options(cfg.model)
        check_loss_weights(cfg.loss, cfg.model.name)
        student = create_model(cfg.model.name, device="meta", overrides=model_overrides(cfg.model, fetch=False))
        loss = build_loss(cfg.loss.name, **cfg.loss.options())
        check_logit_bias(student, loss, f"loss={cfg.loss.name}", cfg.model.name)
        attach_parts(cfg.loss, student)  # a term's head: the checks it makes of the towers
        if cfg.loss.distill.model:
            teacher = targets.resolve(cfg.loss.distill.model, cfg.loss.distill.pretrained)
            check_teacher(targets.structure(teacher), student, cfg.loss.distill.model)
        check_optim(cfg.optim, parallel.uses_cuda(cfg.world.device))
        augmentation_cfg(cfg.data)
        if is_main:  # fetches pretrained weights and a hub tokenizer into the cache, once, before any rank starts
            check_weights(cfg.model, loss, cfg.loss.init_logit_bias)
            check_tokenizer(cfg.model)
    if cfg.world.parallel == "fsdp":
        check_shardable(student, cfg.model.name)
    if cfg.world.sync_batchnorm and not parallel.uses_cuda(cfg.world.device):
        check_no_batchnorm(student, cfg.model.name)
    return student


def check_shardable(model: torch.nn.Module, model_name: str) -> None:
    """world.parallel=fsdp shards the towers block by block: the model (on the meta device) must have transformer
    blocks, and the torch must take FSDP2's ignored parameters (the logit scale and bias stay whole)."""
    with as_config_error(RuntimeError):
        require("torch.distributed.fsdp.fully_shard(ignored_params)")
    if not parallel.transformer_blocks(model):
        raise ConfigError(
            f"world.parallel=fsdp: model {model_name} has no transformer blocks (module lists named "
            f"{', '.join(parallel.BLOCK_LISTS)}) for fully_shard; use world.parallel=ddp"
        )


def check_no_batchnorm(model: torch.nn.Module, model_name: str) -> None:
    """world.sync_batchnorm on CPU ranks: SyncBatchNorm runs on GPUs only, so a tower with BatchNorm is refused
    (one without has nothing to convert)."""
    if any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        raise ConfigError(
            f"world.sync_batchnorm=true: {model_name} has BatchNorm layers, and SyncBatchNorm runs "
            "on CUDA ranks only; use world.device=cuda, or world.sync_batchnorm=false on CPU ranks"
        )
