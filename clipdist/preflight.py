"""Every check before any rank starts, run once: the config's own (clipdist.config.validate) and each component's
checks of its settings (model, loss, optimizer, data, launch, logging), each one line (ConfigError) naming the key
and what to change.

    shards = preflight(cfg, env)      # train.run: then the ranks start
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from clipdist.checkpoint.manager import Checkpointer
from clipdist.checkpoint.remote import check_remote
from clipdist.checkpoint.run_dir import check_run_dir
from clipdist.config import TrainConfig, validate
from clipdist.data.epochs import shard_sizes
from clipdist.data.eval_stream import first_eval_record
from clipdist.data.naflex import resolve_budget, resolve_seq_lens
from clipdist.data.order import BudgetOrder, SampleOrder
from clipdist.data.samples import SampleKeys
from clipdist.data.sources import EvalSet, Shards, resolve_shards
from clipdist.data.stream import check_caption_keys, check_pieces, check_shard_count, kept_readers, run_readers
from clipdist.data.transforms import augmentation_cfg, image_size_stages
from clipdist.data.workers import LoaderPlan, loader_workers
from clipdist.distributed import launch, parallel
from clipdist.errors import ConfigError
from clipdist.losses import build as build_loss
from clipdist.model import targets
from clipdist.model.factory import (
    check_loss_weights,
    check_model_options,
    check_teacher,
    check_weights,
    create_model,
    image_size,
    model_overrides,
    resolve_model_name,
)
from clipdist.model.timm_towers import naflex_patch_size, naflex_trunk
from clipdist.train.optim import check_optim
from clipdist.train.tracking import check_tensorboard, check_wandb_online


def preflight(cfg: TrainConfig, env: launch.DistEnv) -> Shards:
    """Every check that needs no process group, before any rank starts; ConfigError says what to change. The
    model is built once, on the meta device (its structure, no memory), for every check that needs it."""
    check_config(cfg)
    launch.check_launch(cfg.world, env)
    check_run_dir(cfg.run_dir)
    resuming = Checkpointer.resume_point(cfg)
    Checkpointer.check_resume(cfg, cfg.world.world_size, resuming)
    with one_line():
        resolve_model_name(cfg.model.name)
        check_model_options(cfg.model)
        check_loss_weights(cfg.loss, cfg.model.name)
        student = create_model(cfg.model.name, device="meta", overrides=model_overrides(cfg.model, fetch=False))
        if cfg.loss.distill.model:
            teacher = targets.resolve(cfg.loss.distill.model, cfg.loss.distill.pretrained)
            check_teacher(targets.structure(teacher), student, cfg.loss.distill.model)
        check_optim(cfg.optim)
        augmentation_cfg(cfg.data)
        if env.is_main:  # fetches pretrained weights into the cache, once, before any rank starts
            check_weights(cfg.model, build_loss(cfg.loss.name, **cfg.loss.options()), cfg.loss.init_logit_bias)
    if cfg.world.parallel == "fsdp":
        check_shardable(student, cfg.model.name)
    if cfg.world.sync_batchnorm and not parallel.uses_cuda(cfg.world.device):
        check_no_batchnorm(student, cfg.model.name)
    with one_line(FileNotFoundError):
        shards = resolve_shards(cfg.data)
        readers = stream_readers(cfg, len(shards.train), resuming)
        sized = not cfg.data.resampled and shard_sizes(shards.train)[0] is not None
        check_shard_count(len(shards.train), readers, resampled=cfg.data.resampled, sized=sized)
        check_caption_keys(shards.train, SampleKeys(tuple(cfg.data.caption_keys), None, tuple(cfg.data.image_keys)))
    with one_line():
        check_naflex(cfg, student, readers, resuming)
    for evalset in shards.evals:
        check_eval_set(evalset)
    with one_line():
        if cfg.logging.wandb == "online" and env.is_main:
            check_wandb_online()
        if cfg.logging.tensorboard:
            check_tensorboard()
    return shards


def check_config(cfg: TrainConfig) -> None:
    """The config's own checks (config.validate), then those its components make of their settings: the loss
    backend's options, the data layout (pieces, readers against the global batch), the remote's file system."""
    validate(cfg)
    with one_line():
        check_pieces(cfg.data.pieces, cfg.world.batch_per_device)
        if cfg.data.readers is not None:
            readers = run_readers(1, cfg.world.world_size, str(cfg.data.split), cfg.data.readers)
            SampleOrder(readers, cfg.world.batch_per_device * cfg.world.world_size)
        build_loss(cfg.loss.name, **cfg.loss.options())
    if cfg.checkpoint.remote:
        check_remote(cfg.checkpoint.remote)


@contextmanager
def one_line(*errors: type[Exception]):
    """A component's ValueError (or one of `errors`) as the ConfigError the user sees, in one line."""
    try:
        yield
    except (ValueError, *errors) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(error)) from None


NAFLEX_KEYS = (
    "seq_lens",
    "seq_len_probs",
    "max_tokens_per_batch",
    "patch_size",
    "resolution_schedule",
    "naflex_square_crop",
)


def check_naflex(cfg: TrainConfig, model: torch.nn.Module, readers: int, resuming: tuple[Path, dict] | None) -> None:
    """The token budget (data/naflex.py) of a NaFlex tower: lengths, weights and budget valid, a row for every rank
    at the longest length, gradient caching's chunks within a rank's rows, no settings that only image batches
    take; data.seq_lens and the rest refused for another tower."""
    if naflex_trunk(model) is None:
        given = [key for key in NAFLEX_KEYS if getattr(cfg.data, key) not in (None, {}, False)]
        if given == ["resolution_schedule"]:
            image_size_stages(model, cfg.data.resolution_schedule)  # a fixed-size tower's: one size a stage
            return
        if given:
            raise ValueError(
                f"data.{given[0]} applies to NaFlex image towers (model=naflex_tiny, naflex_b16, a timm "
                f"NaFlexVit); model.name={cfg.model.name}'s image tower takes fixed-size images"
            )
        return
    world = cfg.world.world_size
    seq_lens = resolve_seq_lens(cfg.data, image_size(model), naflex_patch_size(model))
    saved = (((resuming or (None, {}))[1].get("stream") or {}).get("layout") or {}).get("budget")
    kept = None if cfg.data.max_tokens_per_batch else (saved or {}).get("max_tokens")
    budget = resolve_budget(cfg.data, seq_lens, cfg.world.batch_per_device * world, cfg.seed, kept)
    fewest = min(budget.sizes())
    if fewest < world:
        raise ValueError(
            f"data.max_tokens_per_batch={budget.max_tokens} holds {fewest} image(s) of "
            f"{max(budget.seq_lens)} patches, fewer than the {world} ranks: every rank needs a row; "
            f"raise it to at least {world * max(budget.seq_lens)}"
        )
    check_pieces(cfg.data.pieces, fewest // world, budget=True)
    chunks = cfg.grad_cache.chunks_for(cfg.world.batch_per_device)
    if chunks > fewest // world:
        raise ValueError(
            f"grad_cache: {chunks} chunks, but a rank holds as few as {fewest // world} rows (at "
            f"{max(budget.seq_lens)} patches): use fewer chunks or raise data.max_tokens_per_batch"
        )
    if str(cfg.data.normalize_on) == "device":
        raise ValueError(
            "data.normalize_on=device: a NaFlex tower's patches are normalized by the loader; leave "
            "data.normalize_on=auto"
        )
    BudgetOrder(min(readers, fewest), budget)


def check_shardable(model: torch.nn.Module, model_name: str) -> None:
    """world.parallel=fsdp shards the towers block by block: the model (on the meta device) must have transformer
    blocks."""
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


def check_eval_set(evalset: EvalSet) -> None:
    """Read the first sample of an evaluation set now, so a bad path or layout fails before training
    (not after the last step): it must decode, and have a caption or a label that has a class name."""
    what = evalset.key
    try:
        _, captions, label = first_eval_record(evalset.urls)
    except Exception as error:  # noqa: BLE001 -- whatever reading raised is the message
        raise ConfigError(f"{what}: cannot read its first sample: {error}") from None
    if label >= 0 and not captions and not evalset.classnames:
        raise ConfigError(
            f"{what}: samples have labels but no captions, and the set has no class names: put "
            "classnames.txt (one name per line, in label order) beside the shards, or set data.classnames"
        )
    if evalset.classnames and label >= len(evalset.classnames):
        raise ConfigError(f"{what}: a sample has label {label} but there are {len(evalset.classnames)} class names")


def loader_workers_for(cfg: TrainConfig, shards: int) -> LoaderPlan:
    """The loader plan for data.workers: as given, or automatic for this host (the same on every rank of like
    nodes)."""
    each = None if cfg.data.resampled else shards if cfg.data.split == "replicated" else shards // cfg.world.world_size
    return loader_workers(
        cfg.data.workers,
        cfg.world.procs_per_node,
        each,
        device_type="cuda" if parallel.uses_cuda(cfg.world.device) else "cpu",
    )


def stream_readers(cfg: TrainConfig, shards: int, resuming: tuple[Path, dict] | None) -> int:
    """The readers the run's data stream will have: a resumed run keeps its checkpoint's (data.stream), a new run
    takes data.readers or ranks × the rank's readers."""
    kept = kept_readers(((resuming or (None, {}))[1].get("stream") or {}).get("layout"), cfg.data.readers)
    if kept is not None:
        return kept
    return run_readers(
        loader_workers_for(cfg, shards).readers,
        cfg.world.world_size,
        str(cfg.data.split),
        cfg.data.readers,
        cfg.world.batch_per_device,
    )
