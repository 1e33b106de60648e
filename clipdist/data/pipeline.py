"""WebDataset streams for training (infinite, same number of batches on every rank) and evaluation."""
from __future__ import annotations

import functools
import os
import signal
import sys
import traceback

import torch
import webdataset as wds

from clipdist.data.faults import DataError, DataFailure, ShardHealth, SkipCounter
from clipdist.data.images import CaptionTokens, ImageBatcher
from clipdist.data.reader import Reader, ShardSequence
from clipdist.data.samples import eval_record, training_pair
from clipdist.data.tar_samples import kill_tree, tar_samples
from clipdist.distributed import STOP_SIGNALS


def check_shard_count(shards: int, world_size: int, workers: int, *, resampled: bool, split: str) -> None:
    """Epoch mode splits shards over ranks × workers: each needs at least one (a ValueError otherwise)."""
    if not resampled and split != "replicated" and shards < world_size * max(workers, 1):
        raise ValueError(
            f"{shards} shard(s) for {world_size} rank(s) × {max(workers, 1)} worker(s): every worker needs "
            "at least one shard. Use more shards, fewer data.workers, or data.resampled=true"
        )


def start_worker(_worker_id: int = 0, low_priority: bool = False) -> None:
    """DataLoader worker_init_fn. SIGTERM/SIGINT/SIGUSR1 sent to the whole process group (SLURM,
    `timeout`, Ctrl-C) are for the trainer, which checkpoints and then shuts the workers down.
    `low_priority`: SCHED_IDLE (see distributed.low_priority_workers; nice 19 where there is none).

    A stop signal can also interrupt the trainer while it receives a batch's tensors (their file
    descriptors come through multiprocessing's resource sharer): the worker's sharer thread then
    sees the connection reset and would print a traceback for a batch nobody wants any more."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if low_priority:
        if hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.nice(19)
    sys.excepthook = _quiet_on_abandoned_transfer(sys.excepthook)


def _quiet_on_abandoned_transfer(excepthook):
    def hook(kind, value, trace):
        if issubclass(kind, (ConnectionError, EOFError)) and any(
                "resource_sharer" in frame.filename for frame in traceback.extract_tb(trace)):
            return
        excepthook(kind, value, trace)
    return hook


def close_stream(batches) -> None:
    """Stop a train_stream's DataLoader workers now. They ignore SIGTERM (start_worker), so the
    DataLoader's own terminate() could not end one blocked on a full queue at exit: they are killed —
    nothing they hold is needed once the trainer stops — with what they started (`pipe:` commands)."""
    workers = getattr(batches, "_workers", [])
    if workers and getattr(batches, "_worker_pids_set", False):
        # Unregister them first, or the DataLoader's SIGCHLD handler reports the kill as a worker crash.
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False
    for worker in workers:
        if worker.is_alive():
            kill_tree(worker.pid)
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class _MarkGood:
    """Passes a usable sample on and tells the SkipCounter (its in-a-row count starts again)."""

    def __init__(self, skips: SkipCounter):
        self.skips = skips

    def __call__(self, sample):
        self.skips.ok()
        return sample


class Position:
    """A reader's state, opaque to the DataLoader (its default_convert would walk every list in it)."""

    __slots__ = ("state",)

    def __init__(self, state: dict):
        self.state = state


class TrainingBatches(torch.utils.data.IterableDataset):
    """This rank's endless (images, tokens, info) batches; in a DataLoader each worker slot plays one
    of the rank's readers (see reader.py), the slots rotated on resume so that batch k of the resumed
    stream comes from the reader that would have given it.

    `info`: {"reader": the rank-local reader, "state": its Position after this batch, "skipped": the
    samples and shards skipped while reading it, "sources": samples per source in this rank's rows}.
    Augmentation is seeded per sample (seed, reader, shard entry, sample number), so a resumed run
    crops and flips as the uninterrupted one did, with any number of workers.
    """

    def __init__(self, sources: list[list[str]], batch_size: int, image_transform, tokenizer, *, weights, resampled: bool,
                 replicated: bool, shuffle_buffer: int, workers: int, rank: int, world_size: int, seed: int,
                 max_skips_in_a_row: int, resume: dict | None = None):
        super().__init__()
        self.sources, self.batch_size, self.image_transform, self.tokenizer = sources, batch_size, image_transform, tokenizer
        self.weights, self.resampled, self.replicated, self.shuffle_buffer = weights, resampled, replicated, shuffle_buffer
        self.workers, self.rank, self.world_size, self.seed = max(workers, 1), rank, world_size, seed
        self.max_skips_in_a_row = max_skips_in_a_row
        self.resume = resume or {"readers": {}, "batches": 0}

    def reader(self, local: int, skips: SkipCounter, health: ShardHealth) -> Reader:
        index, count = (local, self.workers) if self.replicated else (self.rank * self.workers + local,
                                                                       self.world_size * self.workers)
        sequence = ShardSequence(self.sources, self.weights, self.seed, index, count, self.resampled)
        reader = Reader(sequence, self.shuffle_buffer, f"{self.seed}-shuffle-{index}", skips, health,
                        name=f"rank {self.rank} worker {local}")
        saved = self.resume["readers"].get(local)
        if saved is not None:
            reader.load_state_dict(saved)
        return reader

    @staticmethod
    def _augment(images: ImageBatcher, image, key: tuple[int, ...]):
        """The image's per-image transform steps with torch's CPU generator seeded from `key` (then put
        back as it was). Not torch.manual_seed: it also queues a CUDA seeding with a stack trace, ~0.6 ms a call."""
        generator = torch.default_generator
        saved = generator.get_state()
        generator.manual_seed(hash(key) & 0xFFFF_FFFF_FFFF_FFFF)
        try:
            return images(image)
        finally:
            generator.set_state(saved)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        slot = info.id if info is not None else 0
        local = (slot + self.resume["batches"]) % self.workers
        skips, health = SkipCounter(self.max_skips_in_a_row), ShardHealth()
        rows = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size) if self.replicated else slice(None)
        size = self.batch_size * (self.world_size if self.replicated else 1)
        batcher, tokenize = ImageBatcher(self.image_transform), CaptionTokens(self.tokenizer)
        try:
            reader = self.reader(local, skips, health)
            images, captions, sources = [], [], []
            for sample in reader:
                try:
                    image, caption = training_pair(sample)
                    image = self._augment(batcher, image,
                                          (self.seed, reader.sequence.reader, sample["__entry__"], sample["__index__"]))
                except DataError:
                    raise
                except Exception as exn:  # noqa: BLE001 -- a bad sample: counted and skipped by the handler
                    skips(exn)
                    continue
                skips.ok()
                images.append(image)
                captions.append(caption)
                sources.append(sample["__source__"])
                if len(images) == size:
                    counts = torch.bincount(torch.tensor(sources[rows]), minlength=len(self.sources)).tolist()
                    yield (batcher.stack(images[rows]), tokenize(captions[rows]),
                           {"reader": local, "state": Position(reader.state_dict()), "skipped": skips.take(),
                            "sources": counts})
                    images, captions, sources = [], [], []
        except DataError as error:
            yield DataFailure(str(error))


def train_stream(sources: list[list[str]], batch_size: int, image_transform, tokenizer, *, resampled: bool, split: str,
                 shuffle_buffer: int, workers: int, rank: int, world_size: int, seed: int, weights=None,
                 max_skips_in_a_row: int = 1000, resume: dict | None = None, start_method: str | None = None,
                 low_priority_workers: bool = False):
    """An endless iterator of this rank's (images, tokens, info) batches (see TrainingBatches); a source
    that gives nothing usable yields a DataFailure (see faults) instead of spinning.

    split="node": shards are dealt to ranks × workers (epoch mode: reshuffled every pass, each
    sample once per epoch; resampled: shards drawn with replacement, by `weights` per source).
    split="replicated": every rank streams the same samples, forms the global batch and keeps
    its own slice — N runs see exactly the global batches one process would (N× the decoding;
    for reproducibility checks, not for scale).
    `resume`: {"readers": {rank-local reader: state}, "batches": batches taken} from a checkpoint.
    `start_method` (fork, spawn, forkserver; None: Python's default) starts the loader workers;
    `low_priority_workers` runs them at idle priority (see start_worker).
    """
    if split not in ("node", "replicated"):
        raise ValueError(f"data.split={split!r}; choose node or replicated")
    if sources and isinstance(sources[0], str):
        sources = [sources]  # one source
    check_shard_count(sum(map(len, sources)), world_size, workers, resampled=resampled, split=split)
    dataset = TrainingBatches(sources, batch_size, image_transform, tokenizer, weights=weights, resampled=resampled,
                              replicated=split == "replicated", shuffle_buffer=shuffle_buffer, workers=workers,
                              rank=rank, world_size=world_size, seed=seed, max_skips_in_a_row=max_skips_in_a_row,
                              resume=resume)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                                         worker_init_fn=functools.partial(start_worker, low_priority=low_priority_workers)
                                         if workers else None,
                                         multiprocessing_context=start_method if workers else None)
    return iter(loader)


def eval_records(urls: list[str], skips: SkipCounter):
    """Every usable (image, captions, label) of the shards, once, in order (see samples.eval_record)."""
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        tar_samples(handler=skips),
        wds.map(eval_record, handler=skips),
        wds.map(_MarkGood(skips)),
    )


def first_eval_record(urls: list[str]):
    """The first sample of a validation set, or the exception that reading it raised (no skipping)."""
    first = wds.DataPipeline(wds.SimpleShardList(urls[:1]), tar_samples(handler=wds.reraise_exception), wds.map(eval_record))
    for record in first:
        return record
    raise DataError(f"{urls[0]} holds no sample")
