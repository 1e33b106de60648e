"""A rank's training components built from config, in one place: the model and its wrapping, the loss backend,
the optimizer and schedule, precision, the objective and the step — what the trainer runs and what
`clipdist bench gpu` times.

    parts = build_parts(cfg, device)
    parts.step(batch)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from clipdist.checkpoint import compile_cache
from clipdist.checkpoint.compile_cache import CompileCache
from clipdist.config import TrainConfig
from clipdist.data.device_decode import device_decoder
from clipdist.data.images import PixelNormalize
from clipdist.data.transforms import image_transforms
from clipdist.defaults import DEFAULT_TILE
from clipdist.distributed import parallel
from clipdist.losses import build as build_loss
from clipdist.model import precision
from clipdist.model.factory import create_run_model
from clipdist.model.flexible_grid import allow_other_sizes
from clipdist.model.short_text import allow_short_text
from clipdist.model.timm_towers import naflex_trunk
from clipdist.objective import TermContext, attach_parts, run_objective
from clipdist.optim.ema import WeightAverage
from clipdist.optim.optimizer import build_optimizer
from clipdist.registry.terms import part_lr_scales
from clipdist.train.step import Step, build_step


@dataclass
class Parts:
    """A rank's training components, built from config (build_parts)."""

    model: torch.nn.Module  # the model (its parameters: what the optimizer and checkpoints see)
    train_model: torch.nn.Module  # the model as it steps: wrapped (DDP / FSDP) and compiled where asked
    tokenizer: Callable[..., torch.Tensor]  # captions -> token ids (open_clip's tokenizer for the text tower)
    loss_fn: torch.nn.Module  # the loss backend (clipdist.losses.build)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # optim.schedules.lr_factor's (build_optimizer)
    scaler: precision.GradScaler | None  # fp16's gradient scaler
    autocast: AbstractContextManager  # the forward's precision: torch.autocast, or a null context
    step: Step  # one optimisation step of a Batch
    train_transform: Callable[[Any], Any]  # a decoded image -> the tower's input
    val_transform: Callable[[Any], Any]
    ema: WeightAverage | None = None  # optim.ema's average of the weights (None: optim.ema.decay=0)
    compiled: tuple[bool, str] = (False, "")  # whether the towers are compiled, and why (compile_decision)
    compile_cache: CompileCache | None = None  # where compiled, its caches (signed after each checkpoint)
    cache_admitted: str | None = None  # on rank 0, what admitting the cache removed (a line for the banner)


def trims_text(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether the step cuts captions to the batch's longest: data.trim_text, or where it is null, whether the towers
    compute in fp32 (a cut moves fp32 features by ≤ 2.6e-6, fp16's by ~1e-3 relative, bf16's by ~7e-3)."""
    if cfg.data.trim_text is not None:
        return cfg.data.trim_text
    return precision.compute_dtype(cfg.precision, device) == torch.float32


COMPILE_PAYS_STEPS = 300  # a compile costs ~60 s on a GPU (once: cached beside the run) and gains ~25% a step


def compile_decision(cfg: TrainConfig, device: torch.device, model: torch.nn.Module) -> tuple[bool, str]:
    """(whether the towers are compiled, why, for the banner): model.compile where it is set; automatic (null) on a
    CUDA device for a run of COMPILE_PAYS_STEPS steps or more on a fixed-size tower (a NaFlex tower's sequence
    lengths vary, and each would compile anew), off on a CPU (there the compile costs more than the run gains)."""
    if cfg.model.compile is not None:
        return bool(cfg.model.compile), f"model.compile={str(cfg.model.compile).lower()}"
    if device.type != "cuda":
        return False, "model.compile=auto: off on a CPU"
    if naflex_trunk(model) is not None:
        return False, "model.compile=auto: off for a NaFlex tower (its sequence lengths vary)"
    if cfg.optim.max_steps < COMPILE_PAYS_STEPS:
        return False, f"model.compile=auto: off for a run under {COMPILE_PAYS_STEPS} steps"
    return True, f"model.compile=auto: on (CUDA, {cfg.optim.max_steps} steps, a fixed-size tower)"


def _wrapped(
    cfg: TrainConfig, device: torch.device, model: torch.nn.Module, compile: bool
) -> tuple[torch.nn.Module, CompileCache | None, str | None]:
    """(the model as the step trains it, its compile cache, what admitting that cache removed). DDP or FSDP2 (under
    FSDP the parameters become this rank's shards, gathered in the autocast dtype on CUDA; gradients are reduced in
    fp32), compiled where `compile`: its cache beside the run, emptied of what this user's clipdist did not sign by
    rank 0 while the others wait, before anything compiles (checkpoint.compile_cache). Wrapped before the optimizer
    is built."""
    gathered_dtype = (
        precision.AUTOCAST.get(precision.resolved(cfg.precision, device)) if device.type == "cuda" else None
    )
    cache, admitted = None, None
    if compile:
        cache = compile_cache.use(cfg.run_dir)
        admitted = cache.admit() if parallel.rank_and_world_size()[0] == 0 else None
        parallel.barrier()
    wrapped = parallel.wrap_model(
        model,
        parallel=str(cfg.world.parallel),
        compile=compile,
        compile_mode=str(cfg.model.compile_mode),
        param_dtype=gathered_dtype,
        sync_batchnorm=cfg.world.sync_batchnorm,
        reshard_after_forward=cfg.world.reshard_after_forward,
    )
    return wrapped, cache, admitted


def _term_context(cfg: TrainConfig, device, model, local_rank: int, ema) -> TermContext:
    return TermContext(
        model,
        device,
        precision.weights_dtype(cfg.precision),
        cfg.model.cache_dir,
        local_rank,
        cfg.optim.max_steps,
        getattr(cfg.loss, "tile", DEFAULT_TILE),
        cfg.seed,
        ema.state_dict if ema is not None else None,  # the teacher terms' teacher
    )


def _change_classes(cfg: TrainConfig, device: torch.device, model: torch.nn.Module) -> bool:
    """The towers made to take short text and other image sizes where the run asks (model.class_swap: before
    wrapping, since FSDP2 gives each unit a class of its own); whether the text tower takes short text."""
    if cfg.data.resolution_schedule and naflex_trunk(model) is None:
        allow_other_sizes(model)  # preflight checked it can (transforms.image_size_stages)
    return trims_text(cfg, device) and allow_short_text(model)


def build_parts(cfg: TrainConfig, device: torch.device, local_rank: int = 0) -> Parts:
    """Model, its wrapping, optimizer, schedule, precision, objective and step from config, as a run builds them
    (the trainer, and `clipdist bench gpu` timing the run's own step); the same initial weights on every rank."""
    autocast = precision.autocast(cfg.precision, device)
    loss_fn = build_loss(cfg.loss.name, **cfg.loss.options())
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model, tokenizer = create_run_model(
        cfg.model, cfg.loss, loss_fn, device, precision.weights_dtype(cfg.precision), local_rank
    )
    attach_parts(cfg.loss, model)  # a term's own head, seeded with the model, before DDP or FSDP sees the parameters
    short_text = _change_classes(cfg, device, model)
    compiled = compile_decision(cfg, device, model)
    train_model, cache, admitted = _wrapped(cfg, device, model, compiled[0])
    optimizer, scheduler = build_optimizer(model, cfg.optim, part_lr_scales(cfg.loss))
    scaler = precision.gradient_scaler(cfg.precision, device)
    train_transform, val_transform = image_transforms(model, cfg.data)
    preprocess: dict = model.visual.preprocess_cfg  # type: ignore[union-attr,assignment]
    mean, std = preprocess["mean"], preprocess["std"]
    ema = WeightAverage(model, cfg.optim.ema, cfg.optim.max_steps) if cfg.optim.ema.decay > 0 else None
    objective = run_objective(
        cfg.loss, cfg.model.name, loss_fn, model, _term_context(cfg, device, model, local_rank, ema)
    )
    teachers = [term.teacher for term, _ in objective.terms if hasattr(term, "teacher")]
    trim_text = short_text and all(allow_short_text(teacher) for teacher in teachers)
    step = build_step(
        train_model,
        objective,
        optimizer,
        scheduler,
        chunks=cfg.grad_cache.chunks_for(cfg.world.batch_per_device),
        autocast=autocast,
        device=device,
        normalize=PixelNormalize(mean, std, device),
        decode=device_decoder(train_transform, device) if str(cfg.data.decode_on) == "device" else None,
        grad_clip=cfg.optim.grad_clip,
        max_logit_scale=cfg.optim.max_logit_scale,
        scaler=scaler,
        input_dtype=precision.weights_dtype(cfg.precision),
        trim_text=trim_text,
    )
    return Parts(
        model,
        train_model,
        tokenizer,
        loss_fn,
        optimizer,
        scheduler,
        scaler,
        autocast,
        step,
        train_transform,
        val_transform,
        ema,
        compiled,
        cache,
        admitted,
    )
