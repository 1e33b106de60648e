"""The data checks before any rank starts: the shards resolve and are enough for the run's readers, the first
samples have captions where data.caption_keys says, a NaFlex tower's token budget holds, data.decode_on's transform
is one the device can run, the node's loaders can hold their batches, every evaluation set reads;
and the loader plan and reader count the run will have (the same on every rank)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import psutil
import torch
from torchvision import transforms as T

from clipdist.config import TrainConfig
from clipdist.data.device_decode import check_transform, jpeg_decoder
from clipdist.data.epochs import epoch_sizes
from clipdist.data.eval_stream import first_eval_record
from clipdist.data.loader import READ_AHEAD_BATCHES, held_samples, sample_bytes
from clipdist.data.naflex import longest_seq_len, resolve_budget, resolve_seq_lens
from clipdist.data.order import BudgetOrder, run_layout
from clipdist.data.samples import SampleKeys
from clipdist.data.sources import EvalSet, Shards, resolve_shards
from clipdist.data.stream import check_caption_keys, check_pieces, check_shard_count, kept_readers, run_readers
from clipdist.data.transforms import image_size_stages, image_transforms
from clipdist.data.workers import WORKER_MEMORY_FLOOR, LoaderPlan, loader_workers
from clipdist.distributed import parallel
from clipdist.errors import ConfigError, as_config_error
from clipdist.model.factory import image_size
from clipdist.model.timm_towers import naflex_patch_size, naflex_trunk


def check_data(
    cfg: TrainConfig, student: torch.nn.Module, resuming: tuple[Path, dict] | None
) -> tuple[Shards, LoaderPlan]:
    """The run's shards, checked (the module docstring), and its ranks' loader plan; `student` on the meta device."""
    with as_config_error(FileNotFoundError):
        shards = resolve_shards(cfg.data)
        shards = dataclasses.replace(shards, sizes=epoch_sizes(shards.train, cfg.data.resampled))
        sized = shards.sizes is not None and shards.sizes[0] is not None
        sizes, how = shards.sizes or (None, "")
        if sized and not sum(sizes or ()):
            raise ValueError(
                f"data.train_shards: the {len(shards.train)} shard(s) hold no samples ({how}); check them "
                "with `tar tf SHARD | head`"
            )
        whole_shards = not cfg.data.resampled and not sized  # epochs deal whole shards: a reader needs one
        layout = stream_layout(cfg, resuming, len(shards.train) if whole_shards else None)
        plan = loader_workers_for(cfg, layout[0])._replace(layout=layout)
        readers = layout[0]
        check_shard_count(len(shards.train), readers, resampled=cfg.data.resampled, sized=sized)
        check_caption_keys(shards.train, SampleKeys(tuple(cfg.data.caption_keys), None, tuple(cfg.data.image_keys)))
    with as_config_error():
        check_naflex(cfg, student, readers, resuming)
        check_decode_on(cfg, student)
    check_host_memory(cfg, student, plan)
    for evalset in shards.evals:
        check_eval_set(evalset)
    return shards, plan


def check_host_memory(cfg: TrainConfig, student: torch.nn.Module, plan: LoaderPlan) -> None:
    """What this node's loaders need within the memory this machine has free: the inputs they hold at once (every
    local rank's batch and what its workers read ahead, as the loader hands them over: loader.held_samples,
    loader.sample_bytes) and their worker processes (WORKER_MEMORY_FLOOR each). A batch or a worker count the host
    cannot hold is refused now, not after the workers have decoded for minutes. A NaFlex tower's batches are token
    budgets, checked by check_naflex."""
    if naflex_trunk(student) is not None:
        return
    batch, pieces, workers, ranks = cfg.world.batch_per_device, cfg.data.pieces, plan.workers, cfg.world.procs_per_node
    each = sample_bytes(student, int(getattr(student, "context_length", 77)))
    inputs = ranks * held_samples(batch, workers, pieces) * each
    processes = ranks * workers * WORKER_MEMORY_FLOOR
    available = psutil.virtual_memory().available
    if inputs + processes > available:
        raise ConfigError(
            f"world.batch_per_device={batch} with data.workers={workers}: this node's loaders would need "
            f"{(inputs + processes) / 2**30:.1f} GiB, and this machine has {available / 2**30:.1f} GiB free. Inputs "
            f"held at once: {inputs / 2**30:.1f} GiB ({ranks} rank(s) × {batch} samples × {each} bytes × "
            f"{1 + READ_AHEAD_BATCHES * workers / pieces:g}: the batch handed over, and {READ_AHEAD_BATCHES} more read "
            f"ahead by each worker in data.pieces={pieces} piece(s) a batch); worker processes: {ranks * workers} at "
            f"{WORKER_MEMORY_FLOOR >> 20} MiB or more each. Lower world.batch_per_device, read the batch in pieces "
            "(data.pieces=K with grad_cache.chunks=K) or set fewer data.workers; `clipdist plan` counts the inputs"
        )


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
    world, patch = cfg.world.world_size, naflex_patch_size(model)
    seq_lens = resolve_seq_lens(cfg.data, image_size(model), patch)
    views, longest = cfg.loss.self_distill, longest_seq_len(cfg.data, seq_lens)
    if views.on and (views.crop_size // patch) ** 2 > longest:
        source = "data.seq_lens" if longest in seq_lens else "data.resolution_schedule"
        raise ValueError(
            f"loss.self_distill.crop_size={views.crop_size}: local views of {(views.crop_size // patch) ** 2} "
            f"patches, more than the longest image's {longest} ({source}); give at most "
            f"{math.isqrt(longest) * patch}, or 0 for √L/4 patches a side"
        )
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


def check_decode_on(cfg: TrainConfig, model: torch.nn.Module) -> None:
    """data.decode_on=device: a fixed-size tower at one size, whose training transform (the one the run builds) only
    crops and normalises, the device doing both after it decodes (data/device_decode.py), with a JPEG decoder."""
    if str(cfg.data.decode_on) != "device":
        return
    if naflex_trunk(model) is not None:
        raise ValueError(
            "data.decode_on=device: a NaFlex tower's patches are cut by the loader from each image whole; leave "
            "data.decode_on=host"
        )
    if cfg.data.resolution_schedule:
        raise ValueError(
            "data.decode_on=device decodes to one image size, and data.resolution_schedule changes it; leave "
            "data.decode_on=host"
        )
    if str(cfg.data.normalize_on) == "loader":
        raise ValueError(
            "data.decode_on=device makes the pixels on the device, where they are normalized: "
            "data.normalize_on=loader cannot apply; leave it auto"
        )
    train, _ = image_transforms(model, cfg.data)
    check_transform(list(train.transforms) if isinstance(train, T.Compose) else [train])
    jpeg_decoder()  # TorchCodec's or torchvision's, before any rank starts


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


def loader_workers_for(cfg: TrainConfig, readers: int) -> LoaderPlan:
    """The loader plan for data.workers: as given, or automatic for this host (the same on every rank of like
    nodes), at most one worker per reader a rank reads of the run's `readers`."""
    each = readers if cfg.data.split == "replicated" else max(1, readers // cfg.world.world_size)
    return loader_workers(
        cfg.data.workers,
        cfg.world.procs_per_node,
        each,
        device_type="cuda" if parallel.uses_cuda(cfg.world.device) else "cpu",
    )


def stream_layout(cfg: TrainConfig, resuming: tuple[Path, dict] | None, most_readers: int | None) -> tuple[int, int]:
    """(V, Λ), the layout of the run's data stream: a resumed run keeps its checkpoint's (data.stream); a new run
    takes data.readers (Λ = the global batch) or order.run_layout of its global batch — never the launch's ranks,
    workers or CPUs, so every launch of the run reads the same batches. `most_readers`: the shards, where each reader
    needs a whole one."""
    saved = ((resuming or (None, {}))[1].get("stream") or {}).get("layout") or {}
    kept = kept_readers(saved, cfg.data.readers)
    if kept is not None:
        return kept, saved["cycle"]
    batch = cfg.world.batch_per_device * cfg.world.world_size
    if cfg.data.readers is not None:
        return run_readers(1, cfg.world.world_size, str(cfg.data.split), cfg.data.readers), batch
    return run_layout(batch, most_readers)
