"""WebDataset streams for training (infinite, same number of batches on every rank) and evaluation."""
from __future__ import annotations

import itertools
import logging
import random
import signal
from pathlib import Path

import braceexpand
import torch
import webdataset as wds

from clipdist.distributed import STOP_SIGNALS

from .tar_samples import tar_samples

log = logging.getLogger(__name__)
IMAGE_KEYS = "jpg;jpeg;png;webp"


def expand_shards(pattern: str, what: str = "data.train_shards") -> list[str]:
    """Brace-expand a shard spec ('::' separates several) and check that local shards exist."""
    if not pattern:
        raise ValueError(f"{what} is empty: give a shard path, brace pattern or pipe: URL")
    urls = [url for part in pattern.split("::") for url in braceexpand.braceexpand(part)]
    local = [url for url in urls if "://" not in url and not url.startswith("pipe:")]
    missing = [url for url in local if not Path(url).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise FileNotFoundError(
            f"{what}={pattern!r}: {len(missing)} of {len(urls)} shards not found ({shown}). "
            "Check the path, or write shards with `clipdist make-shards`"
        )
    empty = [url for url in local if Path(url).stat().st_size == 0]
    if empty:
        raise ValueError(f"{what}: empty shard file(s): {', '.join(empty[:3])}")
    return urls


def check_shard_count(shards: int, world_size: int, workers: int, *, resampled: bool, split: str) -> None:
    """Epoch mode splits shards over ranks × workers: each needs at least one (a ValueError otherwise)."""
    if not resampled and split != "replicated" and shards < world_size * max(workers, 1):
        raise ValueError(
            f"{shards} shard(s) for {world_size} rank(s) × {max(workers, 1)} worker(s): every worker needs "
            "at least one shard. Use more shards, fewer data.workers, or data.resampled=true"
        )


class SkipCounter:
    """A webdataset handler that skips a bad sample or shard, warns, and counts it.

    The count lives in the process that reads: a DataLoader worker (fork, spawn or forkserver
    alike) or the main process. The training stream attaches `take()` — the skips since the
    last batch — to every batch, so the trainer sums them across workers and ranks; nothing is
    shared between processes.
    """

    def __init__(self):
        self.count = 0
        self._taken = 0

    def __call__(self, exception: Exception) -> bool:
        self.count += 1
        log.warning("skipped a corrupt sample or shard: %r", exception)
        return True

    def take(self) -> int:
        """Skips counted since the last call."""
        fresh, self._taken = self.count - self._taken, self.count
        return fresh


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """DataLoader worker_init_fn: SIGTERM/SIGINT/SIGUSR1 sent to the whole process group (SLURM,
    `timeout`, Ctrl-C) are for the trainer, which checkpoints and then shuts the workers down."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def close_stream(batches) -> None:
    """Stop a train_stream's DataLoader workers now. They ignore SIGTERM (ignore_stop_signals), so the
    DataLoader's own terminate() could not end one blocked on a full queue at exit: they are killed —
    nothing they hold is needed once the trainer stops."""
    for worker in getattr(batches, "_workers", []):
        if worker.is_alive():
            worker.kill()
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


class _SplitByRank:
    """This rank's share of the shard list (rank and world size given, not guessed from the environment)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def __call__(self, sources):
        yield from itertools.islice(sources, self.rank, None, self.world_size)


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


class _EpochShuffledShards(torch.utils.data.IterableDataset):
    """Endless shard list, reshuffled (seed + epoch) at every pass, the same on every rank."""

    def __init__(self, urls: list[str], seed: int):
        super().__init__()
        self.urls, self.seed = urls, seed

    def __iter__(self):
        for epoch in itertools.count():
            urls = list(self.urls)
            random.Random(self.seed + epoch).shuffle(urls)
            yield from ({"url": url} for url in urls)


def _require_caption(sample):
    if not isinstance(sample[1], str) or not sample[1].strip():
        raise ValueError(f"empty caption in sample {sample[1]!r}")
    return sample


def train_stream(urls: list[str], batch_size: int, image_transform, tokenizer, *, resampled: bool, split: str,
                 shuffle_buffer: int, workers: int, rank: int, world_size: int, seed: int, skips: SkipCounter):
    """An endless iterator of (images, tokens, skipped) batches of `batch_size` for this rank;
    `skipped` counts the samples and shards skipped while reading it (see SkipCounter).

    split="node": shards are split by rank and worker (epoch mode: reshuffled every pass, each
    sample once per epoch; resampled: shards drawn with replacement).
    split="replicated": every rank streams the same samples, forms the global batch and keeps
    its own slice — N runs see exactly the global batches one process would (N× the decoding;
    for reproducibility checks, not for scale).
    The stream never ends, so each rank takes exactly one batch per step.
    """
    if split not in ("node", "replicated"):
        raise ValueError(f"data.split={split!r}; choose node or replicated")
    replicated = split == "replicated"
    check_shard_count(len(urls), world_size, workers, resampled=resampled, split=split)
    stream_seed = seed if replicated else seed + 1_000_003 * rank
    if resampled:
        shards = [wds.ResampledShards(urls, seed=stream_seed, deterministic=True)]
    else:
        shards = [_EpochShuffledShards(urls, seed), *([] if replicated else [_SplitByRank(rank, world_size)]),
                  wds.split_by_worker]
    shuffle = [wds.shuffle(shuffle_buffer, initial=min(shuffle_buffer, 100), seed=stream_seed)] if shuffle_buffer > 1 else []
    stages = [
        *shards,
        tar_samples(handler=skips),
        *shuffle,
        wds.decode("pil", handler=skips),
        wds.to_tuple(IMAGE_KEYS, "txt", handler=skips),
        wds.map(_require_caption, handler=skips),
        wds.map_tuple(image_transform, _Tokenize(tokenizer), handler=skips),
    ]
    if replicated:
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        stages += [wds.batched(batch_size * world_size, partial=False), wds.map(_KeepRows(rows))]
    else:
        stages += [wds.batched(batch_size, partial=False)]
    stages += [wds.map(_AttachSkips(skips))]
    loader = wds.WebLoader(wds.DataPipeline(*stages), batch_size=None, num_workers=workers,
                           persistent_workers=workers > 0, worker_init_fn=ignore_stop_signals if workers else None)
    return iter(loader)


def eval_batches(urls: list[str], batch_size: int, image_transform, skips: SkipCounter):
    """Every (images, captions, json) batch of the validation shards, once, in order (rank-local)."""
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        tar_samples(handler=skips),
        wds.decode("pil", handler=skips),
        wds.to_tuple(IMAGE_KEYS, "txt", "json", handler=skips),
        wds.map_tuple(image_transform, lambda text: text, lambda meta: meta, handler=skips),
        wds.batched(batch_size, partial=True, collation_fn=_collate_eval),
    )
    return iter(pipeline)


def _collate_eval(samples):
    images, captions, metas = zip(*samples)
    return torch.stack(images), list(captions), list(metas)
