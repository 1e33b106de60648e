"""This rank's training stream: endless batches, the counts a run logs, and the position that lets a
resumed run continue sample for sample.

    TrainStream        what the trainer holds: next / consumed / state_dict / load_state_dict / close
    TrainingBatches    the IterableDataset behind it: each DataLoader worker slot plays one reader
    start_worker       DataLoader worker_init_fn (stop signals ignored, idle priority on request)
"""
from __future__ import annotations

import functools
import hashlib
import random
import signal
import sys
import time
import traceback
from typing import NamedTuple

import torch

from clipdist.data.faults import DataError, DataFailure, ShardHealth, SkipCounter
from clipdist.data.images import CaptionTokens, ImageBatcher
from clipdist.data.reader import Reader, ShardSequence
from clipdist.data.samples import SampleKeys, training_pair, undecodable
from clipdist.data.workers import LoaderPlan, LoaderTuning, set_low_priority
from clipdist.launch import STOP_SIGNALS, kill_tree
from clipdist.parallel import all_ranks

RESHUFFLE_SEED_STRIDE = 7919  # a prime: a stream restarted after n batches is seeded seed + stride · n


def check_shard_count(shards: int, world_size: int, readers: int, *, resampled: bool, split: str) -> None:
    """Epoch mode splits shards over ranks × readers: each needs at least one (a ValueError otherwise)."""
    if not resampled and split != "replicated" and shards < world_size * max(readers, 1):
        raise ValueError(
            f"{shards} shard(s) for {world_size} rank(s) × {max(readers, 1)} reader(s) (loader workers): every "
            "reader needs at least one shard. Use more shards, fewer data.workers, or data.resampled=true"
        )


class Batch(NamedTuple):
    images: torch.Tensor
    tokens: torch.Tensor
    counts: list[int]  # this rank's [samples skipped, shards skipped while reading it, samples of each source]
    load_s: float | None = None  # CPU seconds the loader spent making it (reading, decoding, augmenting)

    @staticmethod
    def zero_counts(sources: int) -> list[int]:
        """The counts of a batch that read nothing (the step's agreement sums counts of one length)."""
        return [0, 0] + [0] * sources


class TrainStream:
    """This rank's endless batches of `data` (a DataConfig: split, resampled, weights, shuffle_buffer,
    workers, max_skips_in_a_row) and everything a checkpoint needs to continue them.

    split=node: shards are dealt to ranks × workers (epoch mode: reshuffled every pass, each sample once
    per epoch; resampled: shards drawn with replacement, by `weights` per source). split=replicated:
    every rank streams the same samples, forms the global batch and keeps its own slice — N ranks see
    exactly the batches one process would (N× the decoding; for checks, not for scale).

    `next(stream)` gives a Batch; `consumed(counts)` says the step used it (trained on it or skipped it
    as non-finite), with the counts summed over ranks: only then does its position count as read.
    `state_dict` / `load_state_dict` follow the StatefulDataLoader protocol and are collectives (every
    rank's readers are saved in one place); `load_state_dict` comes before the first `next`, which
    starts the DataLoader. A source that gives nothing usable raises DataError instead of spinning.
    `pixels`: images come as uint8 (B, H, W, C), for the rank to normalize on its device
    (images.PixelNormalize); `pin_memory`: batches are put in pinned memory for an asynchronous copy.

    `readers` (default: data.workers, at least 1) is how many readers the rank's shards are dealt to,
    part of the layout; the worker processes that run them (data.workers) may be any divisor of it, and
    may change between batches (`set_workers`) without changing a sample of the stream.

    `data.pieces` (dividing batch_size): the loader reads each batch as that many pieces, piece g of the
    stream from reader g mod readers, copied one by one into the batch's host buffer (pinned where
    `pin_memory`). Host memory is then the batch plus the pieces read ahead (workers × 2), not whole
    batches read ahead: what lets a batch larger than the device (gradient caching) be held at all.
    """

    def __init__(self, sources: list[list[str]], data, *, batch_size: int, image_transform, tokenizer,
                 rank: int = 0, world_size: int = 1, seed: int = 0, low_priority_workers: bool = False,
                 pixels: bool = False, pin_memory: bool = False, start_method: str | None = None,
                 readers: int | None = None):
        split = str(data.split)
        if split not in ("node", "replicated"):
            raise ValueError(f"data.split={split!r}; choose node or replicated")
        self.pieces = int(getattr(data, "pieces", 1) or 1)
        check_pieces(self.pieces, batch_size)
        self.readers_count = readers or max(data.workers, 1)
        self.workers = data.workers
        check_workers(self.workers, self.readers_count)
        check_shard_count(sum(map(len, sources)), world_size, self.readers_count, resampled=data.resampled, split=split)
        self.sources, self.data, self.rank, self.world_size, self.seed = sources, data, rank, world_size, seed
        self.batch_size, self.image_transform, self.tokenizer = batch_size, image_transform, tokenizer
        self.low_priority_workers, self.start_method = low_priority_workers, start_method
        self.pixels, self.pin_memory = pixels, pin_memory
        self.layout = {"world_size": world_size, "readers": self.readers_count, "split": split, "resampled": data.resampled,
                       "seed": seed, "shuffle_buffer": data.shuffle_buffer,
                       "weights": list(data.weights) if data.weights else None,
                       "shards": hashlib.sha1("\n::\n".join("\n".join(urls) for urls in sources).encode()).hexdigest()}
        self.skipped_samples, self.skipped_shards, self.source_samples = 0, 0, [0] * len(sources)
        self.readers: dict[int, dict] = {}  # rank-local reader -> position after the batches consumed
        self.batches = 0  # loader batches consumed (pieces, where data.pieces > 1)
        self.restart_reason: str | None = None  # set by load_state_dict when the stream cannot continue exactly
        self._loader = None
        self.tuning: LoaderTuning | None = None
        self._pending: list[tuple[int, dict]] = []  # the reader and position of each piece handed out

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._loader is None:
            self._loader = self._start()
        self._pending = []
        if self.pieces == 1:
            images, tokens, counts, load_s = self._piece()
            return Batch(images, tokens, counts, load_s)
        images = tokens = counts = None
        load_s, rows = 0.0, self.batch_size // self.pieces
        for piece in range(self.pieces):
            piece_images, piece_tokens, piece_counts, piece_load_s = self._piece()
            if images is None:  # the batch's host buffer, filled piece by piece as the pieces arrive
                images = torch.empty((self.batch_size, *piece_images.shape[1:]), dtype=piece_images.dtype,
                                     pin_memory=self.pin_memory)
                tokens = torch.empty((self.batch_size, *piece_tokens.shape[1:]), dtype=piece_tokens.dtype)
                counts = [0] * len(piece_counts)
            images[piece * rows:(piece + 1) * rows] = piece_images
            tokens[piece * rows:(piece + 1) * rows] = piece_tokens
            counts = [total + count for total, count in zip(counts, piece_counts)]
            load_s += piece_load_s
            del piece_images
        return Batch(images, tokens, counts, load_s)

    def _piece(self) -> tuple[torch.Tensor, torch.Tensor, list[int], float]:
        """The loader's next batch (a piece of the rank's batch where data.pieces > 1), its position pending."""
        item = next(self._loader)
        if isinstance(item, DataFailure):
            raise DataError(f"rank {self.rank}: {item.message}")
        images, tokens, info = item
        self._pending.append((info["reader"], info["state"].state))
        return images, tokens, [*info["skipped"], *info["sources"]], info["load_s"]

    def consumed(self, counts: list[int] | None = None) -> None:
        """The batch last handed out was used by the step: its readers' positions are now the saved ones, and
        `counts` (Batch.counts summed over ranks; this rank's own where None) are added to the totals."""
        for reader, position in self._pending:
            self.readers[reader] = position
        self._pending = []
        self.batches += self.pieces
        if counts is not None:
            self.skipped_samples += counts[0]
            self.skipped_shards += counts[1]
            self.source_samples = [total + count for total, count in zip(self.source_samples, counts[2:])]

    def state_dict(self) -> dict:
        """Collective: the layout, the totals, and every rank's reader positions (in rank order)."""
        return {"layout": self.layout, "skipped_samples": self.skipped_samples, "skipped_shards": self.skipped_shards,
                "source_samples": list(self.source_samples),
                "ranks": all_ranks({"readers": self.readers, "batches": self.batches})}

    def load_state_dict(self, saved: dict | None) -> None:
        """Continue from `saved`: sample for sample when the layout is unchanged; otherwise (another world
        size, reader count, shard list, seed, ...) reshuffled from a seed of its own, with `restart_reason`
        saying why. The totals carry on either way."""
        if self._loader is not None:
            raise RuntimeError("TrainStream.load_state_dict must come before the first batch")
        saved = saved or {}
        self.skipped_samples, self.skipped_shards = saved.get("skipped_samples", 0), saved.get("skipped_shards", 0)
        totals = saved.get("source_samples") or []
        self.source_samples = list(totals) if len(totals) == len(self.sources) else [0] * len(self.sources)
        if "layout" in saved and "workers" in saved["layout"]:  # written before readers and workers were apart
            saved = {**saved, "layout": {("readers" if key == "workers" else key): (max(value, 1) if key == "workers" else value)
                                         for key, value in saved["layout"].items()}}
        if saved.get("layout") == self.layout:
            mine = saved["ranks"][self.rank]
            self.readers, self.batches = dict(mine["readers"]), mine["batches"]
            return
        if "layout" not in saved:
            reason = "the checkpoint holds no data position"
        else:
            changed = [key for key, value in self.layout.items() if saved["layout"].get(key) != value]
            reason = "changed since the checkpoint: " + ", ".join(
                f"{key} {saved['layout'].get(key)} -> {self.layout[key]}" if key != "shards" else "the shard list"
                for key in changed)
        batches = max((rank["batches"] for rank in saved.get("ranks", [])), default=0)
        self.seed += RESHUFFLE_SEED_STRIDE * batches
        self.restart_reason = reason

    def _start(self):
        """The DataLoader, its readers placed where the consumed batches left them (nothing is consumed yet:
        that is the restored position, or the start)."""
        workers = self.workers
        dataset = TrainingBatches(self.sources, self.batch_size // self.pieces, self.image_transform, self.tokenizer,
                                  data=self.data, rank=self.rank, world_size=self.world_size, seed=self.seed,
                                  resume={"readers": dict(self.readers), "batches": self.batches}, pixels=self.pixels,
                                  readers=self.readers_count, workers=workers)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
            pin_memory=self.pin_memory and self.pieces == 1,  # pieces are copied into a pinned batch instead
            worker_init_fn=functools.partial(start_worker, low_priority=self.low_priority_workers) if workers else None,
            multiprocessing_context=self.start_method if workers else None,
            # its own generator for the workers' base seed: the rank's RNG (dropout masks) is not drawn from, so a
            # loader started after a resume leaves the restored RNG as it was (samples are seeded by key instead)
            generator=torch.Generator().manual_seed(self.seed))
        return iter(loader)

    def close(self) -> None:
        """Stop the DataLoader's workers now. They ignore SIGTERM (start_worker), so the DataLoader's own
        shutdown could not end one blocked on a full queue at exit: they are killed — nothing they hold is
        needed once the trainer stops — with what they started (`pipe:` commands)."""
        loader, self._loader = self._loader, None
        if loader is None:
            return
        workers = getattr(loader, "_workers", [])
        if workers and getattr(loader, "_worker_pids_set", False):
            # Unregister them first, or the DataLoader's SIGCHLD handler reports the kill as a worker crash.
            torch.utils.data._utils.signal_handling._remove_worker_pids(id(loader))
            loader._worker_pids_set = False
        for worker in workers:
            if worker.is_alive():
                kill_tree(worker.pid)
        shutdown = getattr(loader, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def tune(self, plan: LoaderPlan, priority_for, threads) -> str | None:
        """Let the run decide the workers' count and priority (data.workers.LoaderTuning); the start's line."""
        self.tuning = LoaderTuning(self, plan, priority_for, threads)
        return self.tuning.started

    def observe(self, waited: float, seconds: float, load_s: float | None) -> list[str]:
        """After a step: what the tuning changed or found, as lines for the log (none without tuning)."""
        return [] if self.tuning is None else self.tuning.observe(waited, seconds, load_s)

    def set_workers(self, workers: int) -> None:
        """Run the readers on `workers` processes from the next batch on (a divisor of the reader count):
        the DataLoader is restarted where the consumed batches left it, so the stream is sample for sample
        the same; batches read ahead are read again."""
        check_workers(workers, self.readers_count)
        if workers != self.workers:
            self.close()
            self.workers = workers

    def set_worker_priority(self, low: bool) -> bool:
        """Every loader worker to idle priority (`low`) or back to normal; False where the OS refuses."""
        return all([set_low_priority(pid, low) for pid in self.worker_pids()])

    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in getattr(self._loader, "_workers", [])]


def check_pieces(pieces: int, batch_size: int) -> None:
    if pieces < 1 or batch_size % pieces:
        raise ValueError(f"data.pieces={pieces} does not divide world.batch_per_device={batch_size}: "
                         "use a divisor of the rank's batch (1: the loader reads whole batches)")


def check_workers(workers: int, readers: int) -> None:
    """Each worker runs every (workers)th reader: their count must divide the readers'."""
    if workers and readers % workers:
        raise ValueError(f"{workers} loader worker(s) cannot share {readers} reader(s) evenly; use a divisor of {readers}")


def start_worker(_worker_id: int = 0, low_priority: bool = False) -> None:
    """DataLoader worker_init_fn. SIGTERM/SIGINT/SIGUSR1 sent to the whole process group (SLURM,
    `timeout`, Ctrl-C) are for the trainer, which checkpoints and then shuts the workers down.
    `low_priority`: SCHED_IDLE (see data.workers.loader_priority; nice 19 where there is none).

    A stop signal can also interrupt the trainer while it receives a batch's tensors (their file
    descriptors come through multiprocessing's resource sharer): the worker's sharer thread then
    sees the connection reset and would print a traceback for a batch nobody wants any more."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if low_priority:
        set_low_priority(0, True)
    sys.excepthook = _quiet_on_abandoned_transfer(sys.excepthook)


def _quiet_on_abandoned_transfer(excepthook):
    def hook(kind, value, trace):
        if issubclass(kind, (ConnectionError, EOFError)) and any(
                "resource_sharer" in frame.filename for frame in traceback.extract_tb(trace)):
            return
        excepthook(kind, value, trace)
    return hook


class Position:
    """A reader's state, opaque to the DataLoader (its default_convert would walk every list in it)."""

    __slots__ = ("state",)

    def __init__(self, state: dict):
        self.state = state


class TrainingBatches(torch.utils.data.IterableDataset):
    """This rank's endless (images, tokens, info) batches from its `readers` readers (see reader.py).
    Batch g of the stream (counted from the start of the run) comes from reader g mod readers; in a
    DataLoader with W workers (W divides readers), batch g is worker g mod W's, so worker slot s runs the
    readers s', s' + W, ... (s' = (s + resumed batches) mod W) in turn — the same batches, in the same order,
    for any W. Augmentation is seeded per sample (seed, reader, shard entry, sample number).

    `info`: {"reader": the rank-local reader, "state": its Position after this batch, "skipped": the
    (samples, shards) skipped while reading it, "sources": samples per source in this rank's rows,
    "load_s": the CPU seconds this thread spent on the batch (reading, decoding, augmenting)}.
    """

    def __init__(self, sources: list[list[str]], batch_size: int, image_transform, tokenizer, *, data, rank: int,
                 world_size: int, seed: int, resume: dict, pixels: bool = False, readers: int | None = None,
                 workers: int | None = None):
        super().__init__()
        self.sources, self.batch_size, self.image_transform, self.tokenizer = sources, batch_size, image_transform, tokenizer
        self.data, self.replicated = data, str(data.split) == "replicated"
        self.workers = max(data.workers if workers is None else workers, 1)
        self.readers = readers or self.workers
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.resume, self.pixels = resume, pixels
        probs = None if data.caption_probs is None else tuple(data.caption_probs)
        self.keys = SampleKeys(tuple(data.caption_keys), probs, tuple(data.image_keys), seed)

    def reader(self, local: int, skips: SkipCounter, health: ShardHealth) -> Reader:
        index, count = (local, self.readers) if self.replicated else (self.rank * self.readers + local,
                                                                       self.world_size * self.readers)
        sequence = ShardSequence(self.sources, self.data.weights, self.seed, index, count, self.data.resampled)
        reader = Reader(sequence, self.data.shuffle_buffer, f"{self.seed}-shuffle-{index}", skips, health,
                        name=f"rank {self.rank} worker {local}")
        saved = self.resume["readers"].get(local)
        if saved is not None:
            reader.load_state_dict(saved)
        return reader

    @staticmethod
    def _augment(images: ImageBatcher, image, key: tuple[int, ...]):
        """The image's per-image transform steps with torch's CPU generator and Python's `random` (timm's
        augmentations draw from it) seeded from `key`, then put back as they were. Not torch.manual_seed: it
        also queues a CUDA seeding with a stack trace, ~0.6 ms a call."""
        generator, seed = torch.default_generator, hash(key) & 0xFFFF_FFFF_FFFF_FFFF
        saved, saved_random = generator.get_state(), random.getstate()
        generator.manual_seed(seed)
        random.seed(seed)
        try:
            return images(image)
        finally:
            generator.set_state(saved)
            random.setstate(saved_random)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first = self.resume["batches"] + (info.id if info is not None else 0)  # this worker's first batch
        locals_ = sorted({(first + self.workers * k) % self.readers for k in range(self.readers)})
        batcher, tokenize = ImageBatcher(self.image_transform), CaptionTokens(self.tokenizer)
        streams = {local: self._batches(local, batcher, tokenize) for local in locals_}
        try:
            for batch in range(first, sys.maxsize, self.workers):
                item = next(streams[batch % self.readers], None)
                if item is None:  # a reader that ends ends the stream
                    return
                yield item
        except DataError as error:
            yield DataFailure(str(error))
        finally:
            for stream in streams.values():
                stream.close()

    def _batches(self, local: int, batcher: ImageBatcher, tokenize: CaptionTokens):
        """Reader `local`'s batches, each with its info."""
        skips, health = SkipCounter(self.data.max_skips_in_a_row), ShardHealth()
        rows = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size) if self.replicated else slice(None)
        size = self.batch_size * (self.world_size if self.replicated else 1)
        reader = self.reader(local, skips, health)
        images, captions, sources = [], [], []
        started = time.thread_time()
        for sample in reader:
            try:
                image, caption = training_pair(sample, self.keys)
            except DataError:
                raise
            except Exception as exn:  # noqa: BLE001 -- a bad sample: counted and skipped by the handler
                skips(exn)
                continue
            try:  # decoded here, at the size its crop needs
                image = self._augment(batcher, image,
                                      (self.seed, reader.sequence.reader, sample["__entry__"], sample["__index__"]))
            except Exception as exn:  # noqa: BLE001 -- as above, named by shard and key
                skips(undecodable(sample, exn))
                continue
            skips.ok()
            images.append(image)
            captions.append(caption)
            sources.append(sample["__source__"])
            if len(images) == size:
                counts = torch.bincount(torch.tensor(sources[rows]), minlength=len(self.sources)).tolist()
                batch = (batcher.stack(images[rows], pixels=self.pixels), tokenize(captions[rows]))
                yield (*batch, {"reader": local, "state": Position(reader.state_dict()), "skipped": skips.take(),
                                "sources": counts, "load_s": time.thread_time() - started})
                images, captions, sources = [], [], []
                started = time.thread_time()
