"""WebDataset streams for training (infinite, same number of batches on every rank) and evaluation."""
from __future__ import annotations

import itertools
import random
import signal

import torch
import webdataset as wds

from clipdist.data.faults import DataError, DataFailure, ShardHealth, SkipCounter
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


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: SIGTERM/SIGINT/SIGUSR1 sent to the whole process group (SLURM,
    `timeout`, Ctrl-C) are for the trainer, which checkpoints and then shuts the workers down."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def close_stream(batches) -> None:
    """Stop a train_stream's DataLoader workers now. They ignore SIGTERM (ignore_stop_signals), so the
    DataLoader's own terminate() could not end one blocked on a full queue at exit: they are killed —
    nothing they hold is needed once the trainer stops — with what they started (`pipe:` commands)."""
    for worker in getattr(batches, "_workers", []):
        if worker.is_alive():
            kill_tree(worker.pid)
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class _Tokenize:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> torch.Tensor:
        return self.tokenizer([text])[0]


class _KeepRows:
    """Replicated split: this rank's rows of a global batch."""

    def __init__(self, rows: slice):
        self.rows = rows

    def __call__(self, batch):
        return [tensor[self.rows] for tensor in batch]


class _AttachSkips:
    def __init__(self, skips: SkipCounter):
        self.skips = skips

    def __call__(self, batch):
        return (*batch, self.skips.take())


class _ShardOrder(torch.utils.data.IterableDataset):
    """The shards this reader (rank × DataLoader worker) opens, endlessly, as {"url": ...}.

    Epoch mode: every pass shuffles the whole list (seed + pass, the same on every rank) and
    deals it out over readers, each shard to one reader. Resampled: shards drawn with
    replacement from the whole list (seed, rank and worker), a pass being len(urls) draws.
    Shards that gave no sample in this pass are left out of later draws; when all of a
    reader's shards failed in one pass, DataError (ShardHealth.check).
    """

    def __init__(self, urls: list[str], seed: int, rank: int, world_size: int, *, resampled: bool,
                 replicated: bool, health: ShardHealth):
        super().__init__()
        self.urls, self.seed, self.resampled, self.health = urls, seed, resampled, health
        self.rank, self.world_size = (0, 1) if replicated else (rank, world_size)
        self.stream_seed = seed if replicated else seed + 1_000_003 * rank

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.resampled:
            yield from self._resampled(random.Random(f"{self.stream_seed}-{worker}"), f"reader {worker} of rank {self.rank}")
            return
        reader, readers = self.rank * workers + worker, self.world_size * workers
        for epoch in itertools.count():
            order = list(self.urls)
            random.Random(self.seed + epoch).shuffle(order)
            mine = order[reader::readers]
            self.health.new_pass()
            yield from ({"url": url} for url in mine)
            self.health.check(mine, f"rank {self.rank} worker {worker}")

    def _resampled(self, rng: random.Random, who: str):
        while True:
            if self.health.read_any or not self.health.failed:
                self.health.new_pass()  # failed shards get another chance; not while nothing reads at all
            for _ in range(len(self.urls)):
                usable = [url for url in self.urls if url not in self.health.failed]
                if not usable:
                    self.health.check(self.urls, who)
                yield {"url": rng.choice(usable)}


class _Tokenize:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> torch.Tensor:
        return self.tokenizer([text])[0]


class _KeepRows:
    """Replicated split: this rank's rows of a global batch."""

    def __init__(self, rows: slice):
        self.rows = rows

    def __call__(self, batch):
        return [tensor[self.rows] for tensor in batch]


class _MarkGood:
    """Passes a usable sample on and tells the SkipCounter (its in-a-row count starts again)."""

    def __init__(self, skips: SkipCounter):
        self.skips = skips

    def __call__(self, sample):
        self.skips.ok()
        return sample


class _AttachSkips:
    def __init__(self, skips: SkipCounter):
        self.skips = skips

    def __call__(self, batch):
        return (*batch, self.skips.take())


def _carry_data_errors(source):
    """Last stage: a DataError becomes a DataFailure value, so it reaches the trainer through a
    DataLoader with its one-line message (a worker's exception would arrive as a traceback dump)."""
    try:
        yield from source
    except DataError as error:
        yield DataFailure(str(error))


def train_stream(urls: list[str], batch_size: int, image_transform, tokenizer, *, resampled: bool, split: str,
                 shuffle_buffer: int, workers: int, rank: int, world_size: int, seed: int, skips: SkipCounter,
                 start_method: str | None = None):
    """An endless iterator of (images, tokens, skipped) batches of `batch_size` for this rank;
    `skipped` counts the samples and shards skipped while reading it (see SkipCounter). A source
    that gives nothing usable yields a DataFailure (see faults) instead of spinning.

    split="node": shards are split by rank and worker (epoch mode: reshuffled every pass, each
    sample once per epoch; resampled: shards drawn with replacement).
    split="replicated": every rank streams the same samples, forms the global batch and keeps
    its own slice — N runs see exactly the global batches one process would (N× the decoding;
    for reproducibility checks, not for scale).
    The stream never ends, so each rank takes exactly one batch per step. `start_method` (fork, spawn,
    forkserver; None: Python's default) starts the loader workers; the stages are picklable for all three.
    """
    if split not in ("node", "replicated"):
        raise ValueError(f"data.split={split!r}; choose node or replicated")
    replicated = split == "replicated"
    check_shard_count(len(urls), world_size, workers, resampled=resampled, split=split)
    health = ShardHealth()
    shards = _ShardOrder(urls, seed, rank, world_size, resampled=resampled, replicated=replicated, health=health)
    stream_seed = shards.stream_seed
    shuffle = [wds.shuffle(shuffle_buffer, initial=min(shuffle_buffer, 100), seed=stream_seed)] if shuffle_buffer > 1 else []
    stages = [
        shards,
        tar_samples(handler=skips, health=health),
        *shuffle,
        wds.map(training_pair, handler=skips),
        wds.map_tuple(image_transform, _Tokenize(tokenizer), handler=skips),
        wds.map(_MarkGood(skips)),
    ]
    if replicated:
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        stages += [wds.batched(batch_size * world_size, partial=False), wds.map(_KeepRows(rows))]
    else:
        stages += [wds.batched(batch_size, partial=False)]
    stages += [wds.map(_AttachSkips(skips)), _carry_data_errors]
    loader = wds.WebLoader(wds.DataPipeline(*stages), batch_size=None, num_workers=workers,
                           persistent_workers=workers > 0, worker_init_fn=ignore_stop_signals if workers else None,
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

    def fail(exception):
        raise exception

    for record in wds.DataPipeline(wds.SimpleShardList(urls[:1]), tar_samples(handler=fail), wds.map(eval_record)):
        return record
    raise DataError(f"{urls[0]} holds no sample")
