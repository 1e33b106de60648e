"""What one rank sets up around the loop (train.trainer): its host (intra-op threads, the malloc policy), its data
stream with the loader plan preflight decided, the lines the run opens with, and the stand-in batch a stop signal
gets."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from clipdist import console
from clipdist.config import TrainConfig
from clipdist.data.batch import Batch
from clipdist.data.device_decode import jpeg_decoder
from clipdist.data.images import normalize_on_device
from clipdist.data.naflex import PatchImages, resolve_budget
from clipdist.data.stream import TrainStream
from clipdist.data.workers import LoaderPlan, loader_priority
from clipdist.distributed import host, launch
from clipdist.model import precision
from clipdist.model.factory import blank_images
from clipdist.train.recipe import recipe

log = logging.getLogger("clipdist")


def configure_host(cfg: TrainConfig, plan: LoaderPlan, env: launch.DistEnv, device: torch.device) -> None:
    """The rank's intra-op threads beside its loader workers, and the malloc policy of a CPU rank (train.log says
    which and why)."""
    if env.is_main and cfg.data.workers is None:
        log.info("%d loader worker(s) per rank (%s)", plan.workers, plan.why, extra=console.DETAIL)
    threads, source = host.intra_op_threads(cfg.world.threads, cfg.world.procs_per_node, plan.workers)
    torch.set_num_threads(threads)
    if env.is_main:
        log.info(
            "%d intra-op thread(s) per rank (%s; waiting: %s)",
            threads,
            source,
            host.openmp_wait(),
            extra=console.DETAIL,
        )
    if device.type == "cpu" and host.keep_freed_memory() and env.is_main:
        log.info(
            "malloc keeps freed memory for reuse (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = 1 GiB, 2 GiB)",
            extra=console.DETAIL,
        )


def build_stream(trainer, plan: LoaderPlan, image_transform, say: Callable[..., None]) -> TrainStream:
    """The rank's training stream, with the loader plan preflight decided."""
    cfg, device, env = trainer.cfg, trainer.device, trainer.env
    on_device, why = normalize_on_device(cfg.data.normalize_on)
    budget = None
    if isinstance(image_transform, PatchImages):  # a NaFlex tower: patches, normalized by the loader
        budget = resolve_budget(
            cfg.data, image_transform.seq_lens, cfg.world.batch_per_device * env.world_size, cfg.seed
        )
        on_device, why = False, "NaFlex patches; each image resized whole at its own aspect ratio, not augmented"
    where = f"on {device.type} after the copy" if on_device else "by the loader"
    say(f"images normalized {where} ({why})", detail=True)
    if str(cfg.data.decode_on) == "device":
        decoder = f"{jpeg_decoder()[0]}'s decode_jpeg, {'nvJPEG' if device.type == 'cuda' else 'libjpeg-turbo'}"
        say(
            f"training JPEGs decoded, cropped and resized on {device.type} ({decoder}; data.decode_on=device): the "
            "workers read headers and draw the crops",
            detail=True,
        )
    priority, said = loader_priority(str(cfg.data.worker_priority), plan.workers)
    if plan.workers:
        say(f"loader workers at {'idle' if priority == 'low' else 'normal'} priority ({said})", detail=True)
    stream = TrainStream(
        trainer.shards.sources,
        cfg.data,
        batch_size=cfg.world.batch_per_device,
        image_transform=image_transform,
        tokenizer=trainer.tokenizer,
        rank=env.rank,
        world_size=env.world_size,
        seed=cfg.seed,
        pixels=on_device,
        pin_memory=on_device and device.type == "cuda",
        readers=plan.readers,
        layout=plan.layout,
        workers=plan.workers,
        budget=budget,
        sizes=trainer.shards.sizes,
        low_priority_workers=priority == "low",
    )
    return stream


def compile_lines(trainer) -> list[tuple[str, int]]:
    """Whether the towers are compiled and why (said where it was decided for the user, or is on), where the caches
    are, and what was removed from them as unsigned (checkpoint.compile_cache)."""
    compiled, why = trainer.compiled
    lines = []
    if compiled or trainer.cfg.model.compile is None and trainer.device.type == "cuda":
        mode = trainer.cfg.model.compile_mode.name
        where = f"; its caches in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}" if compiled else ""
        mode = f", model.compile_mode={mode}" if compiled and mode != "default" else ""
        lines.append((f"torch.compile {'on' if compiled else 'off'} ({why}{mode}){where}", logging.INFO))
    if trainer.cache_admitted:
        lines.append((trainer.cache_admitted, logging.WARNING))
    return lines


def start_lines(trainer) -> list[tuple[str, int]]:
    """(line, level) for where the run starts: the checkpoint, the run directory, the recipe, where the data stream
    goes on from, and whether there is anything left to train."""
    cfg, state, stream = trainer.cfg, trainer.state, trainer.stream
    lines = (
        [(f"resumed from {trainer.resumed_from} at step {state.step}", logging.INFO)] if trainer.resumed_from else []
    )
    lines.append((f"run directory: {trainer.run_dir}", logging.INFO))
    said = recipe(
        cfg,
        trainer.model,
        trainer.step.objective,
        trainer.env.world_size,
        getattr(trainer.step, "chunks", 1),
        precision.resolved(cfg.precision, trainer.device),
        trainer.shards,
        stream.budget,
        trainer.step.trim_text,
    )
    lines += [(line, logging.INFO) for line in said]
    lines += compile_lines(trainer)
    if stream.continued:
        lines.append(
            (
                f"the data stream continues at sample {stream.position} of its order ({stream.order.readers} "
                f"reader(s); {trainer.env.world_size} rank(s) × {cfg.world.batch_per_device})",
                logging.INFO,
            )
        )
    lines += [(line, logging.INFO) for line in (stream.epochs(), stream.assembly()) if line]
    if stream.restart_reason:
        lines.append(
            (
                f"the data stream cannot continue sample for sample ({stream.restart_reason}); it restarts "
                f"reshuffled at sample {state.samples_seen}, so samples already seen in this epoch may come again",
                logging.WARNING,
            )
        )
    if cfg.world.parallel == "fsdp" and trainer.env.world_size == 1:
        lines.append(
            (
                "world.parallel=fsdp on one rank: nothing is sharded (the rank holds the whole model's state, as under "
                "DDP), and FSDP2's gathers and hooks still cost host time every step (docs/fsdp.md); "
                "world.parallel=ddp trains the same run faster here",
                logging.WARNING,
            )
        )
    if state.step >= cfg.optim.max_steps:
        lines.append(
            (
                f"run {trainer.run_dir} is already complete at step {state.step} (optim.max_steps="
                f"{cfg.optim.max_steps}); raise optim.max_steps to train on, or set name= for a new run",
                logging.INFO,
            )
        )
    return lines


def stand_in_batch(trainer) -> Batch:
    """Blank images and empty captions in the shape of this rank's batch: what a step gets when a stop signal came
    while it waited for data (its collectives still match on every rank, and its agreement stops them). The captions
    are the tokenizer's empty caption, not zeros: a batch of padding alone, cut to its longest caption
    (data.trim_text), would leave a caption decoder no token to predict."""
    rows = max(trainer.stream.global_batch // trainer.env.world_size, 1)
    empty = trainer.tokenizer([""] * rows)
    return Batch.dummy(blank_images(trainer.model, rows), empty, len(trainer.shards.sources))
